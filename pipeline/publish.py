"""Stage `publish`: fold evaluate-light quality into the manifest, sign it, and emit the final package.

The input package is copied, never edited in place: stage inputs may be shared cache artifacts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from device_sdk.package import MANIFEST, atomic_write_bytes, canonical_json, read_manifest, sign_manifest
from pipeline.evaluate import apply_quality
from pipeline.stage import StageContext


def load_private_key(pem: str | bytes):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = serialization.load_pem_private_key(pem.encode() if isinstance(pem, str) else pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("the signing key must be an Ed25519 private key (PEM)")
    return key


def publish_package(package_dir: Path, out_dir: Path, private_key, report: dict | None = None) -> Path:
    """Write a signed copy of `package_dir` to `out_dir` (with the report's quality if given)."""
    package_dir, out_dir = Path(package_dir), Path(out_dir)
    read_manifest(package_dir)  # refuse anything that is not a package before copying it
    staging = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(package_dir, staging)
    if report is not None:
        apply_quality(staging, report)
    manifest = sign_manifest(read_manifest(staging), private_key)
    atomic_write_bytes(staging / MANIFEST, canonical_json(manifest.to_dict()))
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def run(inputs: dict[str, Path], settings: dict, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package", optional "report"}, settings {"signing_key": PEM} -> {"package"}."""
    if not settings.get("signing_key"):
        raise ValueError("publish needs a signing_key (Ed25519 private key, PEM)")
    report = json.loads(Path(inputs["report"]).read_text()) if "report" in inputs else None
    out = publish_package(Path(inputs["package"]), ctx.work_dir / "package", load_private_key(settings["signing_key"]), report)
    ctx.logger.info("signed manifest of %s", out)
    return {"package": out}
