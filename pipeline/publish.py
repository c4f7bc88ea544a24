"""Stage `publish`: put the build's other outputs into the package, sign it, and emit the final package.

Each optional input has an installer that writes it into the package and the manifest:
quality from the report card, the latency cost model, the TLM, and (CLONE) profiles and
experts. The input package is copied, never edited in place: stage inputs may be shared
cache artifacts. The export stage's levels (GGUF, transformers) go beside the package, in
`exports/` outside its manifest (pipeline.elastilm.export), so that pulling the package does not fetch them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from device_sdk.format import MANIFEST, atomic_write_bytes, canonical_json, read_manifest, sign_manifest
from pipeline.clone.experts import install_experts
from pipeline.clone.search import install_profiles
from pipeline.contract import StageSettings
from pipeline.elastilm.evaluate import apply_quality, install_quality_plot
from pipeline.elastilm.export import install_exports
from pipeline.elastilm.latency import apply_latency
from pipeline.elastilm.tlm import install_tlm
from pipeline.stage import StageContext


def _json_installer(apply: Callable[[Path, dict], None]) -> Callable[[Path, Path], None]:
    return lambda package_dir, path: apply(package_dir, json.loads(Path(path).read_text()))


# Publish input name -> how it goes into a package directory (before signing), in this order.
INSTALLERS: dict[str, Callable[[Path, Path], None]] = {
    "report": _json_installer(apply_quality),
    "quality_plot": install_quality_plot,
    "latency": _json_installer(apply_latency),
    "tlm": install_tlm,
    "profiles": install_profiles,
    "experts": install_experts,
}


def load_private_key(pem: str | bytes):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = serialization.load_pem_private_key(pem.encode() if isinstance(pem, str) else pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("the signing key must be an Ed25519 private key (PEM)")
    return key


def publish_package(package_dir: Path, out_dir: Path, private_key, extras: dict[str, Path] | None = None,
                    exports: Path | None = None, *, sequence: int | None = None,
                    expires_at: str | None = None) -> Path:
    """Write a copy of `package_dir` to `out_dir`, with each extra installed by its INSTALLERS entry, signed
    with `private_key` (None: left unsigned), and the export stage's output, if any, beside it (not in the
    manifest). `sequence` and `expires_at`, when given, go into the manifest before it is signed (the
    rollback and freeze fields of device_sdk.format.Manifest)."""
    package_dir, out_dir = Path(package_dir), Path(out_dir)
    extras = extras or {}
    unknown = sorted(set(extras) - set(INSTALLERS))
    if unknown:
        raise ValueError(f"publish cannot install {unknown}; it knows {sorted(INSTALLERS)}")
    read_manifest(package_dir)  # refuse anything that is not a package before copying it
    staging = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(package_dir, staging)
    for name, install in INSTALLERS.items():
        if name in extras:
            install(staging, Path(extras[name]))
    if sequence is not None or expires_at is not None:
        manifest = read_manifest(staging)
        manifest.sequence = manifest.sequence if sequence is None else sequence
        manifest.expires_at = manifest.expires_at if expires_at is None else expires_at
        manifest.validate()
        atomic_write_bytes(staging / MANIFEST, canonical_json(manifest.to_dict()))
    if private_key is not None:
        manifest = sign_manifest(read_manifest(staging), private_key)
        atomic_write_bytes(staging / MANIFEST, canonical_json(manifest.to_dict()))
    if exports is not None:
        install_exports(staging, Path(exports))
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir


def run(inputs: dict[str, Path], settings: StageSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package", optional extras (see INSTALLERS)} -> {"package"}, signed with
    ctx.runtime["signing_key"] (Ed25519 private key, PEM). Publish has no settings of its own.

    The scheduler always hands over the deployment's key (it refuses to dispatch without one); only a
    build run in-process without a key (`elastify elastify`) writes an unsigned package. The manifest's
    `sequence` is ctx.runtime["package_sequence"] (cluster.packages.next_sequence, handed over at dispatch)
    and its `expires_at` ctx.runtime["package_expires_at"], when the caller provides them.
    """
    signing_key = ctx.runtime.get("signing_key")
    extras = {name: Path(path) for name, path in inputs.items() if name not in ("package", "exports")}
    exports = Path(inputs["exports"]) if "exports" in inputs else None
    sequence = ctx.runtime.get("package_sequence")
    out = publish_package(Path(inputs["package"]), ctx.work_dir / "package",
                          load_private_key(signing_key) if signing_key else None, extras, exports,
                          sequence=None if sequence is None else int(sequence),
                          expires_at=ctx.runtime.get("package_expires_at"))
    ctx.logger.info("installed %s and %s the manifest of %s%s", sorted(extras) or "nothing",
                    "signed" if signing_key else "did not sign (no signing key)", out,
                    "; exports beside it" if exports is not None else "")
    return {"package": out}
