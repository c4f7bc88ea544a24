"""Run every benchmark under bench/ in turn (each prints its own table).

    .venv/bin/python bench/run_all.py [NAME ...]     e.g. run_all.py elastic_linear level_switch
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    wanted = set(sys.argv[1:])
    scripts = sorted(p for p in HERE.glob("bench_*.py") if not wanted or p.stem.removeprefix("bench_") in wanted)
    failed = []
    for script in scripts:
        print(f"\n=== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script)]).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
