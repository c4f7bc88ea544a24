"""The import direction api → cluster → workers → pipeline → device_sdk, checked on the source."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["api", "cluster", "workers", "pipeline", "device_sdk"]  # each may import only those after it
DEVICE_SDK_THIRD_PARTY = {"torch", "safetensors", "tokenizers", "numpy", "cryptography", "jinja2", "rich"}
DEVICE_SDK_OPTIONAL = {"gguf"}  # device_sdk's `export` extra, imported lazily by device_sdk.export_gguf only


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def sources(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if ".venv" not in p.parts)


@pytest.mark.parametrize("package", LAYERS)
def test_imports_point_one_way(package):
    forbidden = set(LAYERS[: LAYERS.index(package)])
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_roots(path) & forbidden)
        for path in sources(package)
        if imported_roots(path) & forbidden
    }
    assert not offenders, f"{package} imports against the direction {' → '.join(LAYERS)}: {offenders}"


def dynamic_imports(path: Path) -> list[int]:
    """Lines that import a module by a name computed at run time, which the check above cannot see."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in ("import_module", "__import__")]


@pytest.mark.parametrize("package", LAYERS[:-1])
def test_every_edge_is_an_import_statement(package):
    """Stages are objects handed over (pipeline.chain → api → cluster), never "module:function" strings."""
    offenders = {str(path.relative_to(ROOT)): lines for path in sources(package) if (lines := dynamic_imports(path))}
    assert not offenders, f"{package} imports modules by name at run time: {offenders}"


def test_device_sdk_stands_alone():
    allowed = DEVICE_SDK_THIRD_PARTY | set(sys.stdlib_module_names) | {"device_sdk", "__future__"}
    optional = {"export_gguf.py": DEVICE_SDK_OPTIONAL}
    offenders = {
        str(path.relative_to(ROOT)): sorted(extra)
        for path in sources("device_sdk")
        if (extra := imported_roots(path) - allowed - optional.get(path.name, set()))
    }
    assert not offenders, f"device_sdk may depend only on {sorted(DEVICE_SDK_THIRD_PARTY)}: {offenders}"


def test_device_sdk_declares_what_it_imports():
    """Every third-party package the device SDK may import is a dependency of its own pyproject."""
    import re
    import tomllib

    declared = tomllib.loads((ROOT / "device_sdk" / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower() for requirement in declared}
    assert DEVICE_SDK_THIRD_PARTY <= names


def test_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import api.cli\nfrom cluster import store\n")
    assert imported_roots(bad) & set(LAYERS[:3]) == {"api", "cluster"}
    hidden = tmp_path / "hidden.py"
    hidden.write_text("import importlib\n\ndef run():\n    from pipeline import recover\n    return importlib.import_module('x')\n")
    assert imported_roots(hidden) == {"importlib", "pipeline"} and dynamic_imports(hidden) == [5]
