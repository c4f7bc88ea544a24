#!/usr/bin/env bash
# Fill .gpu/ with what bench/gpu_scale.sh needs on a GPU machine that reaches no registry, within the
# device tool's 64 MiB: the wheels the pipeline imports beyond torch, at the versions the project venv
# pins (pip freeze, then pip download), SmolLM2's tokenizer files, and PTB's training text.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/tokenizer
grep -iE '^(transformers|peft|safetensors|tokenizers|huggingface[-_]hub|pydantic|pydantic[-_]core|accelerate|annotated-types|typing-inspection|regex|pyyaml|tqdm|filelock|fsspec|packaging|rich|markdown-it-py|mdurl|pygments|hf-xet|typer|click|shellingham|cryptography|cffi|pycparser|jinja2|markupsafe|psutil)==' \
  <("$PY" -m pip freeze --disable-pip-version-check) | sort -u > .gpu/wheels/requirements.txt
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 -d .gpu/wheels -r .gpu/wheels/requirements.txt
"$PY" - <<'PY'
from pathlib import Path
import shutil
from pipeline.assets import prepare_smollm2
from pipeline.data.calibration import load_corpus

source = prepare_smollm2()
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    if (source / name).is_file():
        shutil.copy(source / name, Path(".gpu/tokenizer") / name)
Path(".gpu/ptb-train.txt").write_text(load_corpus("ptb:train"))
PY
du -sh .gpu
