"""The import direction api → cluster → workers → pipeline → device_sdk, checked on the source.

Also, inside each of those packages: no import cycle between its modules (every import counts,
function-level ones too, since a cycle hidden in a function is still a cycle), and no
function-level import of the project's own modules unless a comment with the marker `lazy:` says
why (e.g. `# lazy: keeps chain importable without torch`), on the import's own line or on a comment
line right above the run of consecutive imports it belongs to. `from pkg import name` points at the module pkg.name when that file exists, else
at pkg itself (its __init__); a package's __init__ is a module like any other, so a sibling that
imports a name from it while it imports that sibling is a cycle.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["api", "cluster", "workers", "pipeline", "device_sdk"]  # each may import only those after it
DEVICE_SDK_THIRD_PARTY = {"torch", "safetensors", "tokenizers", "numpy", "cryptography", "jinja2", "rich", "httpx",
                          "httpx_sse", "typer"}
# device_sdk's extras, each imported only by its module (which the CLI loads lazily): `export`, `serve`.
DEVICE_SDK_OPTIONAL = {"export_gguf.py": {"gguf"}, "serve.py": {"fastapi", "uvicorn", "prometheus_client"}}
LAZY_MARKER = "lazy:"  # in a comment on a function-level import of the project's own modules, or above its run


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
    optional = DEVICE_SDK_OPTIONAL
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
    # PEP 503: a distribution's name with '-' is imported with '_' (httpx-sse is httpx_sse)
    names = {re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower().replace("-", "_") for requirement in declared}
    assert DEVICE_SDK_THIRD_PARTY <= names


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def own_imports(path: Path, root: Path = ROOT, packages=LAYERS) -> Iterator[tuple[str, int, bool]]:
    """(module imported, line, whether at function level) for each import of a module of `packages`.

    Relative imports are resolved; `from a.b import c` names the module a.b.c when that file exists.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]

    def is_module(name: str) -> bool:
        base = root.joinpath(*name.split("."))
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[str, int, bool]]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in packages:
                    yield alias.name, node.lineno, in_function
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] in packages:
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    yield (target if is_module(target) else base), node.lineno, in_function
        nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            yield from visit(child, nested)

    yield from visit(tree, False)


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same top-level package it imports (at any level)."""
    paths = sorted(p for p in (root / package).rglob("*.py") if ".venv" not in p.parts)
    graph = {module_name(p, root): set() for p in paths}
    for path in paths:
        source = module_name(path, root)
        graph[source] |= {target for target, _, _ in own_imports(path, root, [package])
                          if target in graph and target != source}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def unmarked_function_imports(path: Path, root: Path = ROOT) -> list[int]:
    """Lines of function-level imports of the project's own modules that no `lazy:` comment covers.

    A marker covers an import when it is in a comment on one of the import's own lines, or on a
    comment line right above the run of consecutive import statements the import belongs to.
    """
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), filename=str(path))

    def commented(first: int, last: int) -> bool:
        return any(LAZY_MARKER in lines[n - 1].partition("#")[2] for n in range(first, last + 1))

    covered: set[int] = set()
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            run_marked, in_run = False, False
            statements = getattr(node, field, None)
            for statement in statements if isinstance(statements, list) else []:
                if not isinstance(statement, (ast.Import, ast.ImportFrom)):
                    in_run = False
                    continue
                if not in_run:  # a run of imports starts: is the line above it a marked comment?
                    above = lines[statement.lineno - 2].strip() if statement.lineno >= 2 else ""
                    run_marked, in_run = above.startswith("#") and LAZY_MARKER in above, True
                if run_marked or commented(statement.lineno, statement.end_lineno or statement.lineno):
                    covered.add(statement.lineno)
    return sorted({line for _, line, in_function in own_imports(path, root) if in_function and line not in covered})


@pytest.mark.parametrize("package", LAYERS)
def test_no_import_cycle_inside_a_package(package):
    found = cycles(import_graph(package))
    assert not found, f"{package} has import cycles between its modules: {found}"


@pytest.mark.parametrize("package", LAYERS)
def test_function_level_imports_of_own_modules_say_why(package):
    offenders = {str(path.relative_to(ROOT)): lines for path in sources(package)
                 if (lines := unmarked_function_imports(path))}
    assert not offenders, (f"{package} imports the project's own modules inside functions without a "
                           f"'# {LAZY_MARKER} <why>' comment: {offenders}")


def test_checker_catches_a_cycle_and_an_unmarked_function_level_import(tmp_path):
    package = tmp_path / "pipeline"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "data" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pipeline.data import b\n")
    (package / "data" / "b.py").write_text("from .. import c\n")
    (package / "c.py").write_text("def load():\n    from pipeline import a\n    return a\n")
    (package / "d.py").write_text("from pipeline.a import thing\n\n\ndef run():\n"
                                  "    # lazy: a stands in for a torch-heavy module\n    from pipeline import a\n"
                                  "    from pipeline import c\n    x = 1\n"
                                  "    from . import a as again\n    import os\n"
                                  "    from pipeline import c as too  # lazy: marked on its own line\n"
                                  "    return a, c, again, os, too, x\n")
    graph = import_graph("pipeline", tmp_path)
    assert graph["pipeline.a"] == {"pipeline.data.b"} and graph["pipeline.data.b"] == {"pipeline.c"}
    assert graph["pipeline.d"] == {"pipeline.a", "pipeline.c"}
    assert cycles(graph) == [["pipeline.a", "pipeline.c", "pipeline.data.b"]]
    assert unmarked_function_imports(package / "c.py", tmp_path) == [2]
    # the marked run (lines 6-7) and the marked line 11 pass; line 9 follows code, so the mark above 6 misses it
    assert unmarked_function_imports(package / "d.py", tmp_path) == [9]
    (package / "c.py").write_text("")
    assert cycles(import_graph("pipeline", tmp_path)) == []


def test_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import api.cli\nfrom cluster import store\n")
    assert imported_roots(bad) & set(LAYERS[:3]) == {"api", "cluster"}
    hidden = tmp_path / "hidden.py"
    hidden.write_text("import importlib\n\ndef run():\n    from pipeline import recover\n    return importlib.import_module('x')\n")
    assert imported_roots(hidden) == {"importlib", "pipeline"} and dynamic_imports(hidden) == [5]


def service_imports_reached(path: Path, root: Path = ROOT, seen: set[Path] | None = None) -> set[str]:
    """The service packages (api, cluster, workers, pipeline) that `path` imports, directly or through
    the `tests.*` helper modules it imports, at any depth of the file."""
    seen = set() if seen is None else seen
    if path in seen:
        return set()
    seen.add(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    found = imported_roots(path) & set(LAYERS[:-1])
    for node in ast.walk(tree):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        for name in names:
            if name.split(".")[0] == "tests" and (helper := root / (name.replace(".", "/") + ".py")).exists():
                found |= service_imports_reached(helper, root, seen)
    return found


def test_device_sdk_tests_need_only_the_sdk():
    """tests/unit/device_sdk/ runs where only the SDK is installed: neither its files nor the test helpers
    they import reach the service's packages (round trips from a pipeline build live in tests/unit/pipeline/)."""
    folder = ROOT / "tests" / "unit" / "device_sdk"
    offenders = {str(path.relative_to(ROOT)): sorted(reached) for path in sorted(folder.glob("*.py"))
                 if (reached := service_imports_reached(path))}
    assert not offenders, f"device_sdk tests import the service: {offenders}"


def test_checker_follows_test_helpers(tmp_path):
    (tmp_path / "tests" / "support").mkdir(parents=True)
    (tmp_path / "tests" / "support" / "helper.py").write_text("def make():\n    from pipeline.models import loading\n")
    test = tmp_path / "test_x.py"
    test.write_text("from device_sdk.format import Level\nfrom tests.support.helper import make\n")
    assert service_imports_reached(test, tmp_path) == {"pipeline"}
