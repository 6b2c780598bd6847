"""`python -m trl_agentic.bench --only tracin-e2e` (trl_agentic/bench/tracin.py `end_to_end`) with stub trainers and a
fake clock: the per-part times (validation rollouts, V) count every measured step of every trainer, and the goals
table only calls a run "validation rollouts included" when its window had them."""

from __future__ import annotations

from collections import defaultdict

import pytest

from trl_agentic.bench import __main__ as bench_main
from trl_agentic.bench import tracin as T


class _Stub:
    """A trainer whose validation rollouts and V each take 1 fake second, every `rollout_every` / `v_every` steps
    (step 0 = the warm-up step), like TracIn at a schedule; 0 = never (plain GRPO)."""

    def __init__(self, rollout_every, v_every, clock):
        self.rollout_every, self.v_every, self.clock, self.step = rollout_every, v_every, clock, 0
        self.args = type(
            "Args",
            (),
            {
                "tracin_val_batch_size": 2,
                "tracin_val_num_generations": 4,
                "tracin_val_rollout_steps": rollout_every,
                "tracin_val_refresh_steps": v_every,
            },
        )()

    def _tracin_rollout_validation(self):
        self.clock[0] += 1.0

    def _tracin_validation_gradient(self):
        self.clock[0] += 1.0


def _one_step(trainer):
    start = trainer.clock[0]
    if trainer.rollout_every and trainer.step % trainer.rollout_every == 0:
        trainer._tracin_rollout_validation()
    if trainer.v_every and trainer.step % trainer.v_every == 0:
        trainer._tracin_validation_gradient()
    trainer.clock[0] += 1.0
    trainer.step += 1
    return trainer.clock[0] - start, trainer.clock[0] - start


@pytest.fixture
def stubbed(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])

    def trainer(kind, settings, output_dir, **tracin):
        if tracin:  # the former defaults: rollouts and V every step
            return _Stub(1, 1, clock)
        return _Stub(8, 4, clock) if kind == "tracin" else _Stub(0, 0, clock)

    monkeypatch.setattr(T, "_e2e_trainer", trainer)
    monkeypatch.setattr(T, "_one_step", _one_step)


def _expected_parts(rollout_every, v_every, steps):
    """Seconds of rollouts and V over measured steps 1..steps, from the schedule alone."""
    return (
        sum(1.0 for s in range(1, steps + 1) if s % rollout_every == 0),
        sum(1.0 for s in range(1, steps + 1) if s % v_every == 0),
    )


def test_part_times_count_every_measured_step_of_every_trainer(stubbed):
    settings = T.EndToEndSettings(steps=8, old_default_steps=2)
    result = T.end_to_end(settings, "unused", log=lambda message: None)
    parts = {name: defaultdict(float, bucket) for name, bucket in result["parts"].items()}
    for name, (rollout_every, v_every, steps) in {"tracin": (8, 4, 8), "tracin_old": (1, 1, 2)}.items():
        assert len(result["times"][name]["wall"]) == steps
        rollouts, v = _expected_parts(rollout_every, v_every, steps)
        assert parts[name]["_tracin_rollout_validation"] == rollouts, name
        assert parts[name]["_tracin_validation_gradient"] == v, name
        # The step times hold the parts: their sum is steps × 1 s plus the parts.
        assert sum(result["times"][name]["wall"]) == steps + rollouts + v, name


def test_quick_run_is_not_labelled_as_the_goal_measurement(stubbed):
    summary = []
    text = bench_main._e2e_section(quick=True, summary=summary)
    ((label, value, goal, met),) = summary
    assert "one whole cycle" not in text and "not comparable with the goal" in text
    # --quick measures 2 steps: TracIn's window has neither V (every 4) nor validation rollouts (every 8).
    assert _expected_parts(8, 4, 2) == (0.0, 0.0)
    assert "validation rollouts included" not in label and "--quick" in label
    assert met is None
    summary = []
    bench_main._e2e_section(quick=False, summary=summary)
    ((label, value, goal, met),) = summary
    assert label == "TracIn step at defaults, validation rollouts included / plain GRPO step"
    assert met == ((8 + 2 + 1) / 8 <= 1.3)  # rollouts once and V twice in the 8 measured steps, plain 1 s a step


def test_header_states_the_schedule_the_trainer_ran(stubbed, monkeypatch):
    """The header's schedule comes from the TracIn trainer's args (it was a fixed string: "2 prompts × 4 generations
    rolled out every 8 steps, V recomputed every 4 steps" whatever the trainer ran)."""
    settings = T.EndToEndSettings(steps=8, old_default_steps=0)
    text = T.render_end_to_end(settings, T.end_to_end(settings, "unused", log=lambda m: None), "cmd")
    assert (
        "8 validation rows (2 prompts × 4 generations) rolled out every 8 steps, V recomputed at the current weights "
        "every 4 steps, fused step" in text
    )
    clock = [0.0]
    monkeypatch.setattr(T.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(
        T, "_e2e_trainer", lambda kind, *a, **k: _Stub(16, 2, clock) if kind == "tracin" else _Stub(0, 0, clock)
    )
    result = T.end_to_end(settings, "unused", log=lambda m: None)
    assert result["schedule"]["tracin"]["val_rollout_steps"] == 16
    text = T.render_end_to_end(settings, result, "cmd")
    assert "rolled out every 16 steps, V recomputed at the current weights every 2 steps" in text
    assert "every 8 steps" not in text


def test_seed_hooks_exist_only_during_the_seed_mode(monkeypatch):
    """`time_modes` registered the seed's forward and backward hooks once for all modes: plain, fused, two-pass and
    val paid BackwardHook nodes they do not have in training. Now they exist only around the seed's own step."""
    live, seen = [0], []

    class Ghost:
        def __init__(self, trainer):
            live[0] += 1

        def remove(self):
            live[0] -= 1

    def run_mode(mode, trainer, batch, val_batch, seed):
        seen.append((mode, live[0], seed is not None))

    monkeypatch.setattr(T, "SeedGhost", Ghost)
    monkeypatch.setattr(T, "run_mode", run_mode)
    monkeypatch.setattr(T, "_setup", lambda *a: (None, None, None))
    monkeypatch.setattr(T, "val_refresh", lambda *a: None)
    result = T.time_modes(T.BenchSettings(repeats=1), 2, 8, "unused")
    assert set(result["wall"]) == set(T.MODES)
    assert {mode for mode, _, _ in seen} == set(T.MODES)
    for mode, hooks, given in seen:
        assert (hooks, given) == ((1, True) if mode == "seed" else (0, False)), mode
    assert live[0] == 0
