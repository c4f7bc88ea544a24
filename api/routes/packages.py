"""Packages: list, versions, manifest, file download (HTTP Range locally, presigned URL on S3), aliases."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import FileResponse, RedirectResponse
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable

from api.problems import ProblemError, not_found
from api.routes import CallerDep, JsonBody, problems, sessions, store
from api.schemas import AliasIn, AliasOut, PackageList, PackageVersionList, PresignedUrl
from cluster.packages import package_prefix
from cluster.service import find_package, list_packages, move_alias, package_versions
from cluster.spec import NAME_PATTERN, VERSION_PATTERN
from device_sdk.format import EXPORTS_DIR, EXPORTS_INDEX, MANIFEST

router = APIRouter(prefix="/v1/packages", tags=["packages"])
# Segments may not start with a dot, so `.` and `..` (and hidden files) cannot be named.
FILE_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}){0,7}$"
PRESIGN_SECONDS = 900

Name = Annotated[str, Path(pattern=NAME_PATTERN, description="package name")]
Version = Annotated[str, Path(pattern=VERSION_PATTERN, description="a version, or an alias such as `latest`")]
AliasName = Annotated[str, Path(pattern=NAME_PATTERN, description="alias name")]


@router.get("", response_model=PackageList)
def list_route(request: Request, caller: CallerDep) -> dict:
    """Every package the caller's tenant published (admins: every tenant's)."""
    with sessions(request)() as session:
        return {"items": list_packages(session, caller.scope)}


@router.get("/{name}/versions", response_model=PackageVersionList, responses=problems(404, 422))
def versions(name: Name, request: Request, caller: CallerDep) -> dict:
    """The package's versions, oldest first, with the aliases that point at each."""
    with sessions(request)() as session:
        try:
            return {"items": package_versions(session, name, caller.scope)}
        except KeyError:
            raise not_found(f"no package {name}") from None


def _package(request: Request, caller, name: str, version: str):
    with sessions(request)() as session:
        try:
            return find_package(session, name, version, caller.scope)
        except KeyError:
            raise not_found(f"no package {name} {version}") from None


def _manifest(request: Request, prefix: str) -> bytes:
    try:
        return store(request).get_bytes(f"{prefix}/{MANIFEST}")
    except FileNotFoundError:
        raise ProblemError(503, f"{prefix}/{MANIFEST} is missing from the store", kind="store-missing") from None


_LISTED: dict[str, frozenset[str]] = {}  # manifest sha256 -> the paths it lists


def _listed_files(request: Request, package) -> frozenset[str]:
    """The package's file paths. Cached by manifest digest (versions are immutable): a partial pull
    asks for hundreds of byte ranges, and each would otherwise fetch and parse the whole manifest."""
    listed = _LISTED.get(package.manifest_sha256)
    if listed is None:
        listed = frozenset(entry["path"] for entry in json.loads(_manifest(request, package.uri)).get("files", []))
        listed |= _exported_files(request, package.uri)
        if len(_LISTED) >= 1024:
            _LISTED.clear()
        _LISTED[package.manifest_sha256] = listed
    return listed


def _exported_files(request: Request, prefix: str) -> frozenset[str]:
    """The files the `export` stage published beside the package (its index lists them), and the index."""
    try:
        index = json.loads(store(request).get_bytes(f"{prefix}/{EXPORTS_INDEX}"))
    except FileNotFoundError:
        return frozenset()
    return frozenset({EXPORTS_INDEX, *(f"{EXPORTS_DIR}/{entry['path']}" for entry in index.get("files", []))})


@router.get("/{name}/{version}/manifest", responses={
    200: {"description": "the signed manifest.json, byte for byte", "content": {"application/json": {"schema": {"type": "object"}}}},
    **problems(404, 422, 503),
})
def manifest(name: Name, version: Version, request: Request, caller: CallerDep):
    """The package's manifest (format v1) exactly as signed; its sha256 is the version's manifest_sha256."""
    package = _package(request, caller, name, version)
    return Response(_manifest(request, package.uri), media_type="application/json",
                    headers={"ETag": f'"{package.manifest_sha256}"'})


@router.get(
    "/{name}/{version}/files/{path:path}",
    responses={
        200: {"description": "the whole file", "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        206: {"description": "the requested byte range (`Range: bytes=a-b`)",
              "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        307: {"description": "S3 store: redirect to a presigned URL (which honours Range too)"},
        **problems(404, 416, 422, 503),
    },
)
def download(
    name: Name,
    version: Version,
    path: Annotated[str, Path(pattern=FILE_PATTERN, description="a file of the package, e.g. model/weights.safetensors")],
    request: Request,
    caller: CallerDep,
    range_header: Annotated[str | None, Header(alias="Range", description="bytes=a-b, bytes=a- or bytes=-n")] = None,
    presign: Annotated[bool, Query(description="S3 store: answer the presigned URL as JSON instead of redirecting")] = False,
):
    """Download one file of a package. A local store streams it with HTTP Range support (206, 416);
    an S3 store redirects to a short-lived presigned URL."""
    package = _package(request, caller, name, version)
    if path != MANIFEST and path not in _listed_files(request, package):
        raise not_found(f"{name} {package.version} has no file {path}")
    key = f"{package_prefix(package.name, package.version)}/{path}"
    artifacts = store(request)
    local = artifacts.local_path(key)
    if local is not None:
        if not local.is_file():
            raise ProblemError(503, f"{key} is missing from the store", kind="store-missing")
        if range_header is not None:
            _check_range(range_header, local.stat().st_size)
        return FileResponse(local, media_type="application/octet-stream", filename=path.rsplit("/", 1)[-1])
    url = artifacts.presigned_url(key, PRESIGN_SECONDS)
    if url is None:
        raise ProblemError(503, "the store can neither serve files nor presign URLs", kind="store-unsupported")
    if presign:
        return PresignedUrl(url=url, expires_in=PRESIGN_SECONDS)
    return RedirectResponse(url, status_code=307)


def _check_range(header: str, size: int) -> None:
    """Answer an unsatisfiable or malformed Range as a problem (FileResponse would answer in plain text)."""
    try:
        FileResponse._parse_range_header(header, size)
    except RangeNotSatisfiable:
        raise ProblemError(416, f"{header} is outside the file's {size} bytes", kind="range-not-satisfiable",
                           headers={"Content-Range": f"bytes */{size}"}) from None
    except MalformedRangeHeader as err:
        raise ProblemError(416, f"{header}: {err.content}", kind="range-not-satisfiable",
                           headers={"Content-Range": f"bytes */{size}"}) from None


@router.put("/{name}/aliases/{alias}", response_model=AliasOut, responses=problems(404, 415, 422))
def set_alias(name: Name, alias: AliasName, body: AliasIn, request: Request, caller: CallerDep,
              _json: Annotated[None, JsonBody]) -> dict:
    """Point an alias (e.g. `latest`, `stable`) at one of the package's versions; aliases move, versions don't."""
    if alias == "aliases":
        raise ProblemError(422, "'aliases' is reserved", kind="invalid-request", errors=[("alias", "reserved")])
    try:
        return move_alias(sessions(request), store(request), name, alias, body.version, caller.scope)
    except KeyError as err:
        raise not_found(str(err).strip("'")) from None
