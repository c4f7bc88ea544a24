#!/usr/bin/env bash
# Recovery tokens/s on a GPU, and the extrapolated GPU-hours of a 7B model's recovery (by FLOPs per token).
#
#   bench/gpu_recovery.sh                         # defaults: level 0.5, distill, 30 timed steps × 16 × 512
#   bench/gpu_recovery.sh --loss lm --seq-len 1024
#
# Runs the recover stage's own CUDA + bf16-autocast path (bench/bench_gpu_recovery.py explains the
# FLOP count). Needs the project venv (`make assets`: SmolLM2 is built into a package once and cached
# under ~/.cache/elastify/bench/gpu-recovery) and a CUDA device; it refuses to run without one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible to torch; this benchmark measures GPU recovery")'
"$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")'
exec "$PYTHON" -m bench.bench_gpu_recovery "$@"
