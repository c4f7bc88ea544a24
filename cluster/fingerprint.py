"""Content digests of external inputs (the source model, files named in settings), for stage cache keys.

A directory's digest covers every file's relative path and sha256. Hashing a model takes a
second or two, so results are remembered per process by (path, size, mtime) of each file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from device_sdk.format import canonical_json, sha256_file

_memo: dict[tuple[str, int, int], str] = {}
# Code whose change can change a stage's output; its digest is part of every cache key.
PIPELINE_SOURCES = ("pipeline", "workers", "device_sdk")


def pipeline_version() -> str:
    """The installed version plus a digest of the pipeline's source, e.g. '0.1.0+3f2a9c1b7d04'."""
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in PIPELINE_SOURCES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{version('elastify')}+{digest.hexdigest()[:12]}"


def _file_digest(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _memo:
        _memo[key] = sha256_file(path)
    return _memo[key]


def named_files_fingerprint(paths: list[str]) -> dict[str, str]:
    """Content digest per path a stage's settings name (StageSettings.named_paths), for its cache key.

    Names that are not paths here (`ptb:train`, `lambada`) are left out: the settings carry them already.
    """
    return {path: path_fingerprint(path) for path in sorted(set(paths)) if Path(path).expanduser().exists()}


def path_fingerprint(path: str) -> str:
    """sha256 over a file, or over a directory's (relative path, sha256) list; 'missing:…' if absent."""
    target = Path(path).expanduser()
    if target.is_file():
        return _file_digest(target)
    if target.is_dir():
        files = sorted(p for p in target.rglob("*") if p.is_file())
        listing = [[p.relative_to(target).as_posix(), _file_digest(p)] for p in files]
        return hashlib.sha256(canonical_json(listing)).hexdigest()
    return f"missing:{path}"
