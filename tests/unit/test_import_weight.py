"""The API and the control plane read the package format without importing torch.

Each check runs in a fresh interpreter, since this test process has torch loaded already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Imports every module of the named packages and reports which heavy modules got loaded.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
for package in sys.argv[1:]:
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        importlib.import_module(info.name)
print(json.dumps({"torch": "torch" in sys.modules, "modules": sorted(sys.modules)}))
"""


def imported_by(*packages: str) -> dict:
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, *packages], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_every_cluster_and_api_module_does_not_import_torch():
    loaded = imported_by("cluster", "api")
    assert {"cluster.spec", "cluster.scheduler", "api.app", "api.cli", "api.routes.builds",
            "api.commands.local"} <= set(loaded["modules"])
    assert not loaded["torch"], "a cluster or api module imports torch at import time"


def test_the_package_format_is_torch_free_and_only_the_weights_side_needs_torch():
    assert not torch_loaded_after("import device_sdk.format")
    assert not torch_loaded_after("import device_sdk")  # the SDK's public names load on first use
    assert torch_loaded_after("import device_sdk.package")


def torch_loaded_after(statement: str) -> bool:
    done = subprocess.run([sys.executable, "-c", f"{statement}; import sys; print('torch' in sys.modules)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip() == "True"
