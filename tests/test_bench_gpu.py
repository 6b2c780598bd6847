"""`make bench-gpu` (trl_agentic/bench/gpu.py) as the GPU machine runs it: TRL from the wheel in third_party/, the
import stand-ins for datasets/pandas/pyarrow (forced here with BENCH_GPU_LIKE_DEVICE=1, although this venv has the
real packages), every section, on the tiny CPU shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_runs_every_section_with_only_the_carried_files(tmp_path):
    env = {**os.environ, "BENCH_GPU_LIKE_DEVICE": "1", "PYTHONPATH": ""}
    run = subprocess.run(
        # Budgets scaled up: a busy CI machine must not turn this into a test of the time limits.
        [
            sys.executable,
            "trl_agentic/bench/gpu.py",
            "--tiny",
            "--out",
            str(tmp_path),
            "--budget-scale",
            "10",
            "--total-budget",
            "6000",
            "--profile",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    notes = report["environment"]["notes"]
    assert "third_party/wheels/trl-1.16.0" in notes and "stand-ins for datasets, pandas, pyarrow" in notes
    results = report["results"]
    assert set(results) == {"features_off", "tracin_memory", "prefix_reuse", "tracin_step"}
    assert not [name for name, r in results.items() if "error" in r], results
    assert results["features_off"]["ratio"] > 0 and results["tracin_step"]["ratio"] > 0
    _check_features_off_breakdown(results["features_off"])
    assert results["tracin_memory"]["step_ratio"] > 0
    reuse = results["prefix_reuse"]
    assert reuse["reused_tokens"] > 0 and reuse["same_turns"] == reuse["compared_turns"]  # float32: exact tokens
    assert "### Prefix reuse across turns" in (tmp_path / "bench_gpu.md").read_text()


def _check_features_off_breakdown(r):
    """Phases of every measured step, tokens and `--profile` output, for both trainers: present and consistent."""
    for name in ("trl", "ours"):
        assert len(r["phases"][name]) == len(r["steps"][name]) == len(r["tokens"][name])
        for step_s, phases, tokens in zip(r["steps"][name], r["phases"][name], r["tokens"][name], strict=True):
            parts = ("prepare_inputs", "loss_forward", "backward", "optimizer")
            timed = (*parts, "generate_and_score", "generate", "model_generate", "rewards")
            assert all(phases[k] >= 0 for k in timed), phases
            assert phases["step"] == step_s
            # Sequential, non-overlapping parts: their sum is the step less what no wrapper times.
            assert sum(phases[k] for k in parts) <= step_s + 1e-3, phases
            assert phases["generate"] <= phases["generate_and_score"] + 1e-3 <= phases["prepare_inputs"] + 2e-3
            assert phases["step_rest"] >= -1e-3 and phases["score_rest"] >= -1e-3
            assert tokens["completion_tokens"] > 0 and tokens["generate_calls"] >= 1
        assert set(r["phase_median_s"][name]) >= {"step", "prepare_inputs", "generate", "loss_forward", "optimizer"}
        profile = r["profile"][name]
        assert profile["top"] and profile["self_cpu_total_ms"] > 0
        assert set(profile["syncs"]) == {
            "aten::_local_scalar_dense",
            "aten::item",
            "cudaStreamSynchronize",
            "cudaDeviceSynchronize",
            "cudaMemcpyAsync",
        }
    assert len(r["profile_diff"]) == 15


def test_aggregate_events_matches_key_averages():
    """The raw-event aggregation `--profile` uses (not `key_averages`: too slow at full size) agrees with torch's."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trl_agentic.bench.gpu import aggregate_events

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(5):
            loss = model(torch.randn(4, 8)).sum()
            loss.backward()
            loss.item()
    ops = aggregate_events(prof.profiler.kineto_results.events())
    expected = {e.key: (e.count, e.self_cpu_time_total / 1000) for e in prof.key_averages()}
    assert set(ops) == set(expected)
    for name, (calls, self_cpu_ms) in expected.items():
        assert ops[name][0] == calls, name
        assert ops[name][1] == pytest.approx(self_cpu_ms, rel=1e-6, abs=1e-6), name


class _StubStepper:
    """Stand-ins for `make_trainer` / `one_step`: plain 1 s a step; TracIn 1 s, +1 s at steps 4 and 8 (V) and +4 s at
    step 8 (validation rollouts), the default schedule's cycle; optionally the section's alarm fires in TracIn's step 8."""

    def __init__(self, stop_at=None):
        self.stop_at, self.step = stop_at, {}

    def make_trainer(self, kind, *args, **kwargs):
        self.step[kind] = 0
        return kind

    def one_step(self, kind):
        from trl_agentic.bench import gpu

        step = self.step[kind]
        self.step[kind] += 1
        if kind == "tracin" and step == self.stop_at:
            raise gpu.SectionTimeout("over its budget of 170 s")
        return 1.0 + (kind == "tracin") * ((step in (4, 8)) * 1.0 + (step == 8) * 4.0)


def _tracin_step_text(monkeypatch, stop_at):
    from trl_agentic.bench import gpu

    stub = _StubStepper(stop_at)
    monkeypatch.setattr(gpu, "make_trainer", stub.make_trainer)
    monkeypatch.setattr(gpu, "one_step", stub.one_step)
    monkeypatch.setattr(gpu, "yield_point", lambda: None)
    settings, out = gpu.Settings.full(), {}
    try:
        gpu.tracin_step(settings, out, "unused", None)
    except gpu.SectionTimeout as error:
        out.update(error=f"SectionTimeout: {error}", section_s=170)
    environment = dict(device="stub", torch="", transformers="", trl="", peft="", notes="")
    text = gpu.render({"environment": environment, "settings": gpu.asdict(settings), "results": {"tracin_step": out}})
    return out, text[text.index("### TracIn step") :]


def test_tracin_step_ratio_is_published_only_for_a_whole_cycle(monkeypatch):
    # Whole cycle (8 measured steps each): the ratio is TracIn's mean over plain's, (8 + 2 V + 4 rollouts) / 8.
    out, text = _tracin_step_text(monkeypatch, stop_at=None)
    assert out["ratio"] == pytest.approx((8 + 2 + 4) / 8)
    assert f"Ratio: **{(8 + 2 + 4) / 8:.2f}** (goal ≤ 1.3)" in text and "means of 8 steps" in text
    # Stopped by the budget inside step 8 (the rollouts): 8 plain and 7 TracIn steps measured, no rollouts in them.
    out, text = _tracin_step_text(monkeypatch, stop_at=8)
    assert (len(out["steps"]["plain"]), len(out["steps"]["tracin"])) == (8, 7)
    assert "Ratio: **" not in text and "goal ≤ 1.3)" not in text
    assert "incomplete cycle (7 of 8 steps)" in text
    assert "means of 8 (`GRPOTrainer`) and 7 (TracIn) steps" in text
    assert f"{(7 + 1) / 7:.2f}" in text  # TracIn's mean over what it did measure, 1 V and no rollouts


@pytest.mark.parametrize("run", [1, 2, 3])
def test_recorded_gpu_runs_render_as_recorded(run):
    """The recorded H200 runs (whole cycles) render to the markdown kept beside them."""
    from trl_agentic.bench import gpu

    stem = ROOT / "docs" / "bench-gpu" / f"2026-11-27-h200-run{run}"
    report = json.loads(stem.with_suffix(".json").read_text())
    assert gpu.render(report).strip() == stem.with_suffix(".md").read_text().strip()


def test_the_schedule_cycle_is_the_configs():
    """The cycle the ratio is judged over is the least common multiple of TracIn's default schedule's periods."""
    import math

    from trl_agentic import AgenticGRPOConfig
    from trl_agentic.bench import gpu

    args = AgenticGRPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True)
    assert gpu.SCHEDULE_CYCLE == math.lcm(args.tracin_val_refresh_steps, args.tracin_val_rollout_steps)


def test_a_tiny_run_is_not_compared_with_the_goal(monkeypatch):
    """`--tiny` measures 4 steps a trainer: half a cycle, without validation rollouts; no ratio against the goal."""
    from trl_agentic.bench import gpu

    stub = _StubStepper()
    monkeypatch.setattr(gpu, "make_trainer", stub.make_trainer)
    monkeypatch.setattr(gpu, "one_step", stub.one_step)
    monkeypatch.setattr(gpu, "yield_point", lambda: None)
    settings, out = gpu.Settings.tiny(), {}
    gpu.tracin_step(settings, out, "unused", None)
    environment = dict(device="stub", torch="", transformers="", trl="", peft="", notes="")
    text = gpu.render({"environment": environment, "settings": gpu.asdict(settings), "results": {"tracin_step": out}})
    assert (len(out["steps"]["plain"]), len(out["steps"]["tracin"])) == (4, 4)
    assert "Ratio: **" not in text and "incomplete cycle (4 of 8 steps)" in text


def test_prefix_reuse_warms_each_arm_up_and_records_per_turn_times(monkeypatch):
    """One untimed call per arm at turn 0's shapes before turn 0 (the plain arm used to pay the first call at each
    shape), the cache emptied after it (turn 0 of the cached arm reuses nothing), and every turn's times in the JSON."""
    import types

    from trl import GRPOTrainer

    from trl_agentic.bench import gpu

    clock, calls = [0.0], []

    class Cache:
        def __init__(self):
            self.stats = types.SimpleNamespace(reused_tokens=0, context_tokens=1)
            self.entries = 0

        def clear(self):
            calls.append("clear")
            self.entries = 0

        def reset_stats(self):
            calls.append("reset_stats")

    class Trainer:
        _prefix_cache = Cache()
        model = types.SimpleNamespace(eval=lambda: None)

        def _generate_single_turn(self, batch, *rest):
            calls.append(("reuse", clock[0]))
            clock[0] += 1.0
            return [[1, 2] for _ in batch], None

    def plain(self, batch, *rest):
        calls.append(("plain", clock[0]))
        clock[0] += 3.0
        return [[1, 2] for _ in batch], None

    settings = gpu.Settings.tiny()
    settings.reuse_conversations, settings.reuse_turns, settings.reuse_tool_tokens = 2, 2, 4
    monkeypatch.setattr(gpu, "make_trainer", lambda *a, **k: Trainer())
    monkeypatch.setattr(gpu, "prompts", lambda settings, n, chars, seed=0: [{"prompt": "p"}] * n)
    monkeypatch.setattr(gpu.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", plain)
    tok = types.SimpleNamespace(apply_chat_template=lambda *a, **k: [5, 6, 7])
    out = {}
    gpu.prefix_reuse(settings, out, "unused", tok)
    arms = [c[0] if isinstance(c, tuple) else c for c in calls]
    assert arms[:4] == ["plain", "reuse", "clear", "reset_stats"]  # warm-ups, then an empty cache
    assert arms[4:] == ["plain", "reuse", "reuse", "plain"]  # turns alternate who goes first
    assert out["warmup_calls_per_arm"] == 1
    assert [t["seconds"] for t in out["turns"]] == [{"plain": 3.0, "reuse": 1.0}] * 2
    assert out["generation_s"] == {"plain": 6.0, "reuse": 2.0}  # the warm-ups are not timed
