"""Sources: a tenant uploads a model directory or a data file, then names it in a build as `upload:<digest>`.

    POST   /v1/sources[?name=FILE]   a tar / tar.gz / zip of a directory, or one file (application/octet-stream)
    GET    /v1/sources               the caller's uploads, their total and the quota
    DELETE /v1/sources/{digest}      forget one and delete its content

The body is streamed to a temporary file (never held in memory) and refused with 413 beyond
`ELASTIFY_MAX_UPLOAD_BYTES`, unpacked (cluster.sources.unpack_upload: regular files only) and stored
as an artifact at `sources/<tenant>/<digest>`, where the digest is that of the artifact's index (the
content, file names included). The same content again is the same upload (200). Uploads count
against the tenant's `ELASTIFY_UPLOAD_QUOTA_BYTES` (429 beyond it).

Each upload's scratch directory (`elastify-upload-*` in the temp dir) is flock'ed while in use; a process
killed mid-body leaves its directory unlocked, and the next upload (or a failed one) sweeps such leftovers.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path as FilePath
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api.problems import ProblemError, not_found
from api.routes import CallerDep, problems, sessions, store
from api.schemas import Schema, datetime  # aware UTC on the wire (RFC 3339)
from cluster.service import (
    QuotaExceeded,
    check_upload_quota,
    delete_upload,
    list_uploads,
    record_upload,
    uploaded_bytes,
)
from cluster.sources import ARCHIVES, SINGLE_FILE, UPLOAD_SCHEME, UploadRefused, unpack_upload, upload_key
from workers.store import artifact_index

router = APIRouter(prefix="/v1/sources", tags=["sources"])
ACCEPTED = sorted({*ARCHIVES, SINGLE_FILE})
SCRATCH_PREFIX = "elastify-upload-"
# A directory this young may be one mkdtemp just made, not yet locked by its owner: leave it alone.
SCRATCH_GRACE_S = 60.0


@contextmanager
def upload_scratch() -> Iterator[FilePath]:
    """A scratch directory held under an exclusive flock until the upload is done, then removed."""
    scratch = FilePath(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    held = os.open(scratch, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        os.close(held)


def sweep_upload_scratch(root: FilePath | None = None, grace_s: float = SCRATCH_GRACE_S) -> int:
    """Remove the scratch directories no live upload holds (their process died mid-body); how many."""
    removed = 0
    for path in FilePath(root or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        try:
            if time.time() - path.stat().st_mtime < grace_s:
                continue
            probe = os.open(path, os.O_RDONLY)
        except OSError:  # gone already, or not ours to open
            continue
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live upload holds it
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        finally:
            os.close(probe)
    return removed


class UploadOut(Schema):
    source: str  # what a build spec names: upload:<digest>
    digest: str
    kind: str  # "dir" (an unpacked archive) or "file"
    name: str
    size: int
    created_at: datetime


class UploadList(Schema):
    items: list[UploadOut]
    total_bytes: int
    quota_bytes: int


def _out(row) -> dict:
    return {"source": f"{UPLOAD_SCHEME}{row.digest}", "digest": row.digest, "kind": row.kind, "name": row.name,
            "size": row.size, "created_at": row.created_at}


def _too_large(limit: int) -> ProblemError:
    return ProblemError(413, f"the upload is larger than {limit} bytes", kind="body-too-large")


@router.post("", status_code=201, response_model=UploadOut,
             responses={200: {"model": UploadOut, "description": "this content was uploaded before: the same upload"},
                        **problems(413, 415, 422, 429)},
             openapi_extra={"requestBody": {"required": True, "content": {
                 media: {"schema": {"type": "string", "format": "binary"}} for media in ACCEPTED}}})
async def upload_source(
    request: Request,
    response: Response,
    caller: CallerDep,
    name: Annotated[str | None, Query(max_length=128, description="the file's name, for a single file "
                                      "(its suffix matters: .gguf, .jsonl, .txt)")] = None,
) -> dict:
    """Upload a model directory (as tar, tar.gz or zip) or a single file; answer the `upload:<digest>` to
    name in a build spec (`source.model`, `calibration`, corpora, …)."""
    settings = request.app.state.settings
    limit = settings.max_upload_bytes
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in ACCEPTED:
        raise ProblemError(415, f"send one of {ACCEPTED}, not {media or 'no Content-Type'}",
                           kind="unsupported-media-type", headers={"Accept-Post": ", ".join(ACCEPTED)})
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    with sessions(request)() as session:  # refuse early what cannot fit; checked again under a lock at the end
        check_upload_quota(session, caller.tenant, int(declared) if declared.isdigit() else 0,
                           settings.upload_quota_bytes)
    await run_in_threadpool(sweep_upload_scratch)  # what uploads killed mid-body left behind
    with upload_scratch() as scratch:
        body, received = scratch / "body", 0
        with open(body, "wb") as out:
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit:
                    raise _too_large(limit)
                out.write(chunk)
        if not received:
            raise ProblemError(422, "the upload is empty", kind="invalid-upload")
        row, created = await run_in_threadpool(_store_upload, request, caller.tenant, body, media, name,
                                               scratch / "unpacked")
    if not created:
        response.status_code = 200
    return _out(row)


def _store_upload(request: Request, tenant: str, body: FilePath, media: str, name: str | None, dest: FilePath):
    settings = request.app.state.settings
    try:
        content = unpack_upload(body, media, name, dest, settings.max_upload_bytes)
    except UploadRefused as err:
        if err.too_large:
            raise _too_large(settings.max_upload_bytes) from None
        raise ProblemError(422, str(err), kind="invalid-upload") from None
    entries, index = artifact_index(content)
    digest = hashlib.sha256(index).hexdigest()
    size = sum(file.stat().st_size for file, _ in entries)
    artifacts, key = store(request), upload_key(tenant, digest)
    stored_now = not artifacts.exists(f"{key}/index.json")
    if stored_now:
        artifacts.put_artifact(key, content)
    kind = "file" if content.is_file() else "dir"
    try:
        return record_upload(sessions(request), tenant, digest, kind, name or content.name, size,
                             settings.upload_quota_bytes)
    except QuotaExceeded:  # concurrent uploads filled the quota meanwhile: keep no content without its row
        if stored_now:
            artifacts.delete_prefix(key)
        raise


@router.get("", response_model=UploadList, responses=problems())
def list_sources(request: Request, caller: CallerDep) -> dict:
    """The caller's uploads, oldest first, with the bytes they hold and the tenant's quota."""
    with sessions(request)() as session:
        rows = list_uploads(session, caller.tenant)
        total = uploaded_bytes(session, caller.tenant)
    return {"items": [_out(row) for row in rows], "total_bytes": total,
            "quota_bytes": request.app.state.settings.upload_quota_bytes}


@router.delete("/{digest}", status_code=204, responses=problems(404, 422))
def delete_source(digest: Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")], request: Request,
                  caller: CallerDep) -> Response:
    """Forget an upload and delete its content; builds queued with it fail at dispatch, naming it."""
    try:
        delete_upload(sessions(request), store(request), caller.tenant, digest)
    except KeyError:
        raise not_found(f"no upload {digest}") from None
    return Response(status_code=204)
