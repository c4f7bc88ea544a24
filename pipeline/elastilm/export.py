"""Stage `export` (off by default): the finished package's levels as dense models other runtimes load.

Each chosen level is written with `device_sdk.export` (transformers) and/or `device_sdk.export_gguf`
(llama.cpp), its recovery LoRA merged in, under `<level>/<format>/`, with an `index.json` that lists
every file with its size and sha256 and names the manifest it was exported from. Publish puts this
directory beside the signed package (`exports/`), outside its manifest: a device pulling the package
does not download a second copy of every level's weights.

The name is device_sdk.export's on purpose: this stage runs that module's writers at build time.
Design: docs/design.md, 'export'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from device_sdk.export import export_hf
from device_sdk.export_gguf import export_gguf
from device_sdk.format import (
    EXPORTS_DIR,
    EXPORTS_INDEX,
    MANIFEST,
    atomic_write_bytes,
    read_manifest,
    sha256_file,
)
from pipeline.settings import ExportSettings
from pipeline.stage import StageContext

INDEX = EXPORTS_INDEX.removeprefix(f"{EXPORTS_DIR}/")


def usable_levels(package_dir: Path, report: dict | None) -> list[str]:
    """The package's levels that the report card (else the manifest) calls usable, smallest first."""
    verdicts = {name: row["usable"] for name, row in (report or {}).get("levels", {}).items()
                if isinstance(row, dict) and "usable" in row}
    return [level.name for level in read_manifest(package_dir).elastic.levels
            if verdicts.get(level.name, level.usable)]


def export_levels(package_dir: Path, out_dir: Path, settings: ExportSettings, levels: list[str],
                  ctx: StageContext) -> Path:
    """Write each level in each format under `out_dir/<level>/<format>/` and the index; returns `out_dir`."""
    package_dir, out_dir = Path(package_dir), Path(out_dir)
    manifest = read_manifest(package_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    entries = []
    for level in ctx.track(levels, "export"):
        for fmt in settings.formats:
            target = out_dir / level / fmt
            if fmt == "gguf":
                export_gguf(package_dir, target / f"{manifest.name}-{level}-{settings.gguf_type}.gguf", level=level,
                            dtype=settings.gguf_type)
                dtype = settings.gguf_type
            else:
                export_hf(package_dir, target, level=level, dtype=settings.hf_type)
                dtype = settings.hf_type
            entries += [{"level": level, "format": fmt, "type": dtype, "path": path.relative_to(out_dir).as_posix(),
                         "size": path.stat().st_size, "sha256": sha256_file(path)}
                        for path in sorted(target.rglob("*")) if path.is_file()]
    index = {"package": manifest.name, "version": manifest.version,
             "manifest_sha256": sha256_file(package_dir / MANIFEST), "files": entries}
    atomic_write_bytes(out_dir / INDEX, (json.dumps(index, indent=2) + "\n").encode())
    return out_dir


def install_exports(out_dir: Path, exports: Path) -> None:
    """Put an export stage's output beside a published package (`out_dir/exports/`), outside its manifest."""
    shutil.copytree(exports, Path(out_dir) / EXPORTS_DIR)


def run(inputs: dict[str, Path], settings: ExportSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package", optional "report" (the report card)} -> {"exports": dir}."""
    package_dir = Path(inputs["package"])
    report = json.loads(Path(inputs["report"]).read_text()) if "report" in inputs else None
    levels = settings.levels or usable_levels(package_dir, report)
    if not levels:
        raise ValueError("no level to export: the report card calls none usable; name them in `levels`")
    out = export_levels(package_dir, ctx.work_dir / EXPORTS_DIR, settings, levels, ctx)
    ctx.logger.info("exported levels %s as %s to %s", levels, settings.formats, out)
    return {"exports": out}
