"""The artifact store: one interface, a local-directory backend and an S3 backend (boto3).

Every object write is atomic (temp then rename locally; temp key then server-side copy, or a
completed multipart upload, on S3) and every read is checked against the expected sha256.

An *artifact* (one stage output: a file or a directory) is a set of objects under a prefix
plus `index.json`, written last, that lists each file's size and sha256. The artifact's digest
is the sha256 of that index, so a reader who finds the index finds a complete artifact, and a
worker killed mid-upload leaves nothing that looks like one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from device_sdk.format import canonical_json, sha256_file

INDEX = "index.json"
CHUNK = 1 << 22
MULTIPART_THRESHOLD = 8 << 20


class StoreError(RuntimeError):
    """The store failed an operation (retryable: the store may come back)."""


class StoreUnavailable(StoreError):
    """The store could not be reached at all."""


class StoreIntegrityError(ValueError):
    """What was read does not match its recorded digest (permanent: retrying reads the same bytes)."""


@dataclass(frozen=True)
class StoreConfig:
    """Everything a worker on another machine needs to open the same store (picklable)."""

    url: str  # /abs/dir, file:///abs/dir or s3://bucket/prefix
    endpoint_url: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    region: str = "us-east-1"

    def open(self) -> ArtifactStore:
        parsed = urlparse(self.url)
        if parsed.scheme in ("", "file"):
            return LocalStore(Path(parsed.path if parsed.scheme else self.url).expanduser())
        if parsed.scheme == "s3":
            return S3Store(self, parsed.netloc, parsed.path.strip("/"))
        raise ValueError(f"unsupported store URL {self.url!r}: use a directory, file://… or s3://bucket/prefix")


@dataclass(frozen=True)
class ArtifactRef:
    key: str  # prefix of the artifact, relative to the store root
    digest: str  # sha256 of its index
    size: int  # total bytes of its files


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_copy(source, dest: Path, expected: str | None, what: str, durable: bool = False) -> str:
    """Stream `source` (a binary file object) into `dest` atomically, hashing as it goes.

    `durable` (the store's own objects) fsyncs the file before the rename and its directory after it, so
    a power loss leaves the old object or the whole new one, never a renamed-but-empty file; copies out of
    the store (a worker's scratch) skip it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            while block := source.read(CHUNK):
                digest.update(block)
                out.write(block)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        if expected is not None and digest.hexdigest() != expected:
            raise StoreIntegrityError(f"{what}: sha256 {digest.hexdigest()} does not match the recorded {expected}")
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_directory(dest.parent)
    return digest.hexdigest()


class ArtifactStore(ABC):
    """Object operations per backend; artifact operations shared on top of them."""

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_file(self, key: str, dest: Path, sha256: str | None = None) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]: ...

    @abstractmethod
    def copy(self, source: str, dest: str) -> None: ...

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix/` (a whole artifact or attempt); return how many. Idempotent."""

    @abstractmethod
    def ensure_ready(self) -> None:
        """Create the bucket or root directory if needed (idempotent)."""

    def local_path(self, key: str) -> Path | None:
        """Where `key` lives on this machine's disk, for backends that have one."""
        return None

    def presigned_url(self, key: str, expires_in: int) -> str | None:
        """A URL that lets anyone holding it GET `key` for `expires_in` seconds, for backends that sign."""
        return None

    # ------------------------------------------------------------------ artifacts

    def put_artifact(self, prefix: str, path: Path) -> ArtifactRef:
        entries, index = artifact_index(path)
        for file, relative in entries:
            self.put_file(f"{prefix}/files/{relative}", file)
        self.put_bytes(f"{prefix}/{INDEX}", index)  # last: the artifact exists from here on
        return ArtifactRef(prefix, hashlib.sha256(index).hexdigest(), sum(f.stat().st_size for f, _ in entries))

    def read_index(self, ref: ArtifactRef) -> dict:
        raw = self.get_bytes(f"{ref.key}/{INDEX}")
        if hashlib.sha256(raw).hexdigest() != ref.digest:
            raise StoreIntegrityError(f"artifact {ref.key}: index does not match its digest {ref.digest}")
        return json.loads(raw)

    def get_artifact(self, ref: ArtifactRef, dest_dir: Path) -> Path:
        """Download into `dest_dir`, verifying every file; return the file or directory path."""
        index = self.read_index(ref)
        root = Path(dest_dir)
        for entry in index["files"]:
            relative = Path(entry["path"])
            if relative.is_absolute() or ".." in relative.parts:
                raise StoreIntegrityError(f"artifact {ref.key} lists a path outside itself: {entry['path']}")
            self.get_file(f"{ref.key}/files/{entry['path']}", root / relative, entry["sha256"])
        if index["kind"] == "file":
            return root / index["files"][0]["path"]
        root.mkdir(parents=True, exist_ok=True)
        return root

    def artifact_exists(self, ref: ArtifactRef) -> bool:
        try:
            self.read_index(ref)
        except (KeyError, FileNotFoundError, StoreIntegrityError):
            return False
        return True


def artifact_index(path: Path) -> tuple[list[tuple[Path, str]], bytes]:
    """The (file, relative path) entries of a file or directory and the index `put_artifact` writes for it:
    its sha256 is the artifact's digest, known before anything is stored (content-addressed uploads)."""
    path = Path(path)
    if path.is_dir():
        entries = [(p, p.relative_to(path).as_posix()) for p in sorted(p for p in path.rglob("*") if p.is_file())]
        kind = "dir"
    elif path.is_file():
        entries, kind = [(path, path.name)], "file"
    else:
        raise FileNotFoundError(f"stage output {path} does not exist")
    listing = [{"path": relative, "size": file.stat().st_size, "sha256": sha256_file(file)} for file, relative in entries]
    return entries, canonical_json({"kind": kind, "files": listing})


class LocalStore(ArtifactStore):
    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"store key {key!r} points outside the store")
        return path

    def ensure_ready(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as source:
            _hash_copy(source, self._path(key), None, key, durable=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        _hash_copy(io.BytesIO(data), self._path(key), None, key, durable=True)

    def get_file(self, key: str, dest: Path, sha256: str | None = None) -> None:
        with open(self._path(key), "rb") as source:
            _hash_copy(source, Path(dest), sha256, key)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(f"no object {key} in the store at {self.root}")
        return path.read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.exists():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())

    def copy(self, source: str, dest: str) -> None:
        self.put_file(dest, self._path(source))

    def delete_prefix(self, prefix: str) -> int:
        import shutil

        base = self._path(prefix)
        if base == self.root.resolve() or not base.exists():  # never the whole store
            return 0
        count = sum(1 for p in base.rglob("*") if p.is_file()) if base.is_dir() else 1
        shutil.rmtree(base) if base.is_dir() else base.unlink()
        return count


class S3Store(ArtifactStore):
    def __init__(self, config: StoreConfig, bucket: str, prefix: str):
        import boto3
        from botocore.config import Config

        self.config, self.bucket, self.prefix = config, bucket, prefix
        self.client = boto3.client(
            "s3",
            endpoint_url=config.endpoint_url,
            aws_access_key_id=config.access_key,
            aws_secret_access_key=config.secret_key,
            region_name=config.region,
            config=Config(
                retries={"max_attempts": 2, "mode": "standard"},
                connect_timeout=3,
                read_timeout=60,
                s3={"addressing_style": "path"},
            ),
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn, *args, **kwargs):
        """Run one boto3 call, turning transport failures into StoreUnavailable with the endpoint."""
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

        try:
            return fn(*args, **kwargs)
        except EndpointConnectionError as err:
            raise StoreUnavailable(f"artifact store unreachable at {self.config.endpoint_url}: {err}") from None
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(f"no object {what} in s3://{self.bucket}/{self.prefix}") from None
            raise StoreError(f"{what}: {err}") from None
        except BotoCoreError as err:
            raise StoreUnavailable(f"artifact store at {self.config.endpoint_url} failed on {what}: {err}") from None

    def ensure_ready(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call("bucket", self.client.head_bucket, Bucket=self.bucket)
        except (FileNotFoundError, StoreError, ClientError):
            self._call("bucket", self.client.create_bucket, Bucket=self.bucket)

    def put_file(self, key: str, path: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        size = Path(path).stat().st_size
        if size >= MULTIPART_THRESHOLD:
            # A multipart upload becomes visible only when it is completed: atomic by itself.
            transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD)
            self._call(key, self.client.upload_file, str(path), self.bucket, self._key(key), Config=transfer)
            return
        with open(path, "rb") as handle:
            self.put_bytes(key, handle.read())

    def put_bytes(self, key: str, data: bytes) -> None:
        temp = self._key(f".tmp/{uuid.uuid4().hex}")
        self._call(key, self.client.put_object, Bucket=self.bucket, Key=temp, Body=data)
        self._copy_key(temp, self._key(key))
        self._call(key, self.client.delete_object, Bucket=self.bucket, Key=temp)

    def _copy_key(self, source: str, dest: str) -> None:
        self._call(dest, self.client.copy_object, Bucket=self.bucket, Key=dest, CopySource={"Bucket": self.bucket, "Key": source})

    def get_file(self, key: str, dest: Path, sha256: str | None = None) -> None:
        response = self._call(key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
        with response["Body"] as body:
            _hash_copy(body, Path(dest), sha256, key)

    def get_bytes(self, key: str) -> bytes:
        response = self._call(key, self.client.get_object, Bucket=self.bucket, Key=self._key(key))
        with response["Body"] as body:
            return body.read()

    def exists(self, key: str) -> bool:
        try:
            self._call(key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        strip = len(self._key("")) if self.prefix else 0
        keys = []
        pages = self._call(prefix, lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix))))
        for page in pages:
            keys += [item["Key"][strip:] for item in page.get("Contents", [])]
        return sorted(keys)

    def presigned_url(self, key: str, expires_in: int) -> str:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires_in
        )

    def delete_prefix(self, prefix: str) -> int:
        if not prefix.strip("/"):  # never the whole bucket prefix
            return 0
        keys = self.list(prefix.rstrip("/") + "/")
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[start:start + 1000]]
            self._call(prefix, self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        return len(keys)

    def copy(self, source: str, dest: str) -> None:
        if self._call(source, self.client.head_object, Bucket=self.bucket, Key=self._key(source))["ContentLength"] >= 5 << 30:
            raise StoreError(f"{source} is larger than a single server-side copy allows")
        self._copy_key(self._key(source), self._key(dest))


def copy_tree(store: ArtifactStore, source_prefix: str, dest_prefix: str, last: str | None = None) -> list[str]:
    """Copy every object under a prefix to another; `last` (a relative key) is copied after the rest."""
    keys = [k[len(source_prefix) + 1 :] for k in store.list(source_prefix)]
    ordered = sorted(k for k in keys if k != last) + ([last] if last in keys else [])
    for relative in ordered:
        store.copy(f"{source_prefix}/{relative}", f"{dest_prefix}/{relative}")
    return ordered
