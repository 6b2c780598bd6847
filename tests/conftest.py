"""Shared test set-up: offline, CPU, quiet TRL experimental warnings, every write under a temporary directory, a
derandomized hypothesis profile, and a tiny model built once per session."""

import os
import tempfile
from pathlib import Path

# Set before transformers / huggingface_hub are imported anywhere: no test may touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# OpenMP threads that wait at a barrier spin ~300k rounds before sleeping (libgomp's default): on a loaded machine they
# burn the core the thread they wait for needs. Beside one busy core, SmolLM2's generation at 2 threads took 37 s by
# default, 9 s with 10k rounds, the same 3.2 s as the default on a quiet machine (measured by hand,
# 2026-11-26, not a test; docs/reliability.md). Read when libgomp loads (the first `import torch`); subprocesses inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# Under pytest-xdist (`make test` runs the integration tiers on 2 workers) each worker computes with one thread: two
# single-threaded processes share the cores without OpenMP barriers, which is what keeps the tiers fast beside another
# CPU-heavy job (docs/reliability.md). Subprocesses (accelerate launch, the CLI) inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests write only under temporary directories. The converted SmolLM2 (~30 s to convert, 540 MB) is the one thing
# worth keeping between sessions: its cache lives in the system temp directory, outside the checkout, shared by the
# sessions of one user (conversion is locked, so parallel sessions are safe). `TRL_AGENTIC_TEST_CACHE` moves it.
_CACHE = os.environ.get("TRL_AGENTIC_TEST_CACHE") or os.path.join(
    tempfile.gettempdir(), f"trl_agentic-test-cache-{os.getuid()}"
)
os.environ["TRL_AGENTIC_CACHE"] = _CACHE
# Matplotlib (the reporting curves) would otherwise write its font cache under $HOME.
os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), f"trl_agentic-test-mpl-{os.getuid()}"))

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

# No `.hypothesis/` in the checkout: hypothesis keeps its files in a temporary directory.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / f"trl_agentic-test-hypothesis-{os.getuid()}")
# "ci" (the default): the same examples every run, so a failure reproduces; no example database; no deadline (a
# loaded machine is slow, not wrong). "dev": hypothesis' random exploration, for looking for new failures.
settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of the tiny random Qwen3 + byte-level tokenizer (TRL's Qwen3 chat template), built once per session."""
    from trl_agentic.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def event_loop_thread():
    """An event loop running in a daemon thread, as TRL runs the async tools' loop."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    loop.thread = thread  # for tests that check the loop survived
    yield loop
    loop.call_soon_threadsafe(loop.stop)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the positions are among the tests that run
def pytest_collection_modifyitems(config, items):
    """Put the live tests (`tests/test_live_*.py`, minutes each on the embedded model) at positions 0, 2, 4, ...

    `make test` schedules the integration tiers with `-n 2 --dist load --maxschedchunk 1`: each worker starts with the
    first two tests of its share and holds the second until the first is done. Interleaved, the first two live tests
    start at once on different workers and the third goes to whichever finishes first, while the many short tests fill
    the gaps; in collection order (all three last) one worker ran them one after the other while the other sat idle.
    Without xdist only the order changes.
    """
    live = [item for item in items if item.nodeid.startswith("tests/test_live_")]
    rest = [item for item in items if not item.nodeid.startswith("tests/test_live_")]
    ordered = []
    for i in range(max(len(live), len(rest))):
        ordered += live[i : i + 1] + rest[i : i + 1]
    items[:] = ordered


def pytest_sessionfinish(session, exitstatus):
    """A run in which no test passed (everything skipped or deselected) fails like one that collected nothing (exit 5):
    a tier of `make test` cannot pass empty. `--collect-only` is left alone."""
    if exitstatus != pytest.ExitCode.OK or session.config.option.collectonly:
        return
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller, which sees every report, decides
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not reporter.stats.get("passed"):
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


@pytest.fixture
def tool_clock(monkeypatch):
    """`rollout_helpers.ToolClock` in place of the wall clock of `tool_timeout`: a tool times out iff it calls
    `tool_clock.hang()` (see the class)."""
    import threading

    from rollout_helpers import ToolClock

    clock = ToolClock(threading.Thread.join)
    monkeypatch.setattr(threading.Thread, "join", lambda thread, timeout=None: clock.join(thread, timeout))
    return clock
