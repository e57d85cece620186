# Every target bootstraps .venv first, idempotently: re-running is cheap, and a changed
# pyproject.toml reinstalls. TORCH_SPEC defaults to the CPU build; override for CUDA, e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed

.PHONY: setup serve test lint bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -c "import torch"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -c "import pdserve.model_runtime, pdserve.router, pdserve.deploy, ray, grpc, transformers"
	@touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/pdserve serve --model tiny --prefill 1 --decode 1

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m benchmarks.engine_roofline

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
