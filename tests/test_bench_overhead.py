"""`python -m trl_agentic.bench --only overhead` (trl_agentic/bench/overhead.py) without a model: the rollout-engine
overhead counts trl-agentic's work around `model.generate` (prefix caching's bookkeeping) as engine time, not as
generation; the benchmarks run at the default `group_baseline`."""

from __future__ import annotations

import types

import pytest

from trl_agentic.bench import async_vs_sync, overhead


def test_model_generate_is_timed_alone_and_only_inside_the_loop():
    clock = [0.0]

    class Model:
        def generate(self, seconds):
            clock[0] += seconds
            return "ids"

    model = Model()
    timer = overhead.ModelGenerateClock(model, clock=lambda: clock[0])

    def loop():  # our generation path: 0.5 s of bookkeeping around 2 s of model.generate
        clock[0] += 0.5
        return model.generate(2.0)

    assert model.generate(7.0) == "ids"  # outside the loop: not counted
    assert timer.around(loop)() == "ids"
    assert (timer.seconds, timer.calls, timer.active) == (2.0, 1, False)


def test_bookkeeping_around_generate_counts_as_engine_overhead():
    # Loop 10 s: our generation path 6 s, of which model.generate 5 s; tools 1 s. The engine is 10 - 5 - 1 = 4 s
    # (the old split, loop - our generation - tools, said 3 s and hid the 1 s of cache work in generation).
    split = overhead.overhead_split(loop=10.0, generate=6.0, model_generate=5.0, tools=1.0)
    assert split == {"engine_s": 4.0, "engine_ratio": 0.4, "around_generate_s": 1.0}


def test_benchmarks_run_at_the_default_group_baseline(monkeypatch):
    assert "group_baseline" not in async_vs_sync.FEATURES
    seen = {}

    def config(cls, out, steps, **extra):
        seen.update(extra)
        raise RuntimeError("stop")

    task = types.SimpleNamespace(reward_funcs=[], train_dataset=None, environment_factory=None)
    monkeypatch.setattr(overhead, "_warm_started_policy", lambda out, quick: (None, None, task))
    monkeypatch.setattr(overhead, "_config", config)
    with pytest.raises(RuntimeError, match="stop"):
        overhead.rollout_overhead(quick=True)
    assert seen["enable_tool_rollback"] and "group_baseline" not in seen
