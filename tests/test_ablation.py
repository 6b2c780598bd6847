"""`make ablation`'s harness (issue 18): the statistics, and one complete resumable run on the tiny model."""

import json
import math
import random

import pytest

from trl_agentic import ablation


def test_bootstrap_interval_of_constant_values_is_the_value():
    assert ablation.bootstrap_interval([[1.0, 1.0], [1.0, 1.0]]) == (1.0, 1.0, 1.0)
    assert ablation.bootstrap_interval([[0.0] * 5]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same problems"):
        ablation.bootstrap_interval([[1.0, 1.0], [1.0]])


def test_seeds_that_agree_on_every_problem_add_no_information():
    """Problems are shared by the seeds: three identical seeds are one seed's evidence, not three times as much (a
    per-seed problem resample would shrink the interval by about sqrt(3))."""
    rng = random.Random(2)
    values = [float(rng.random() < 0.4) for _ in range(128)]
    _, low_1, high_1 = ablation.bootstrap_interval([values], samples=4000)
    _, low_3, high_3 = ablation.bootstrap_interval([values] * 3, samples=4000)
    assert high_3 - low_3 == pytest.approx(high_1 - low_1, rel=0.1)


def test_a_paired_difference_finds_what_separate_intervals_cannot():
    """Arm A solves what arm B solves plus 8 more of 128 problems, in every seed: the separate intervals overlap, the
    paired interval of A - B is all above 0 (and is exactly 8/128 wide of nothing else)."""
    rng = random.Random(3)
    b = [[float(rng.random() < 0.5) for _ in range(128)] for _ in range(3)]
    flipped = [k for k in range(128) if b[0][k] == 0.0 and b[1][k] == 0.0 and b[2][k] == 0.0][:8]
    a = [[1.0 if k in flipped else v for k, v in enumerate(seed)] for seed in b]
    _, low_a, _ = ablation.bootstrap_interval(a)
    _, _, high_b = ablation.bootstrap_interval(b)
    assert low_a < high_b  # separately: no difference visible
    mean, low, high = ablation.paired_difference(a, b)
    assert mean == pytest.approx(8 / 128) and 0 < low <= mean <= high
    with pytest.raises(ValueError):
        ablation.paired_difference(a, b[:2])


def test_bootstrap_interval_matches_the_normal_approximation_for_one_large_seed():
    rng = random.Random(1)
    values = [float(rng.random() < 0.3) for _ in range(2000)]
    p = sum(values) / len(values)
    mean, low, high = ablation.bootstrap_interval([values], samples=2000)
    half = 1.96 * math.sqrt(p * (1 - p) / len(values))
    assert mean == pytest.approx(p)
    assert low == pytest.approx(p - half, abs=0.006) and high == pytest.approx(p + half, abs=0.006)


def test_bootstrap_interval_widens_with_disagreeing_seeds():
    # Same pooled values, but split into seeds that disagree: resampling seeds must show that spread.
    agree = [[0.0, 1.0] * 50, [0.0, 1.0] * 50]
    disagree = [[0.0] * 100, [1.0] * 100]
    _, low_a, high_a = ablation.bootstrap_interval(agree)
    mean_d, low_d, high_d = ablation.bootstrap_interval(disagree)
    assert mean_d == 0.5 and high_d - low_d > 2 * (high_a - low_a)


def test_a_run_writes_every_cell_resumes_and_renders(tiny_model_dir, tmp_path, monkeypatch):
    work, out, doc = tmp_path / "work", tmp_path / "cells", tmp_path / "ablation.md"
    argv = [
        "run", "--features", "rollback", "--seeds", "0", "--steps", "1", "--num_eval", "4",
        "--out", str(work), "--cells", str(out), "--doc", str(doc),
        "--set", f"model_name_or_path={tiny_model_dir}", "warmstart_steps=1", "warmstart_batch_size=2",
        "gradient_accumulation_steps=1", "per_device_train_batch_size=4", "max_completion_length=24",
        "learning_rate=1e-4",  # the GRPO arms' rate, below the warm start's 3e-4 (YAML 1.1 reads it as a string)
    ]  # fmt: skip
    from trl_agentic import warmstart

    schedules = []

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        schedules.append([h["learning_rate"] for h in result.log_history if "learning_rate" in h])
        return result

    real = warmstart.run_task_warmstart
    monkeypatch.setattr(warmstart, "run_task_warmstart", spy)
    (tmp_path / "ablation-findings.md").write_text("## Findings\n\nWritten by hand.\n")
    assert ablation.main(argv) == 0
    monkeypatch.setattr(warmstart, "run_task_warmstart", real)
    # The warm start decays from its peak; the SFT arm, stopped by time, trains at the GRPO arms' rate, constant.
    warm_rates, sft_rates = schedules[0], schedules[-1]
    assert len(schedules) == 2 and warm_rates[0] == 3e-4 and sft_rates == [1e-4] * len(sft_rates)
    cells = {arm: json.loads((out / "rollback" / "seed0" / f"{arm}.json").read_text()) for arm in ablation.ARMS}
    for arm, cell in cells.items():
        assert cell["arm"] == arm and cell["num_eval"] == 4
        assert len(cell["success"]) == 4 and set(cell["success"]) <= {0.0, 1.0}
    # The control is TRL's own trainer; the feature arm ours; the SFT arm trained at least one step.
    assert cells["trl"]["trainer"] == "GRPOTrainer" and cells["agentic"]["trainer"] == "AgenticGRPOTrainer"
    assert cells["sft"]["sft_steps"] >= 1 and cells["sft"]["sft_learning_rate"] == 1e-4
    assert len(cells["warmstart"]["warmstart_losses"]) == 1
    assert sorted(p.name for p in (out / "rollback" / "seed0").iterdir()) == sorted(f"{a}.json" for a in ablation.ARMS)
    [adapter] = (work / "rollback" / "seed0").glob("warmstart-adapter-*/adapter_config.json")
    assert adapter.parent.name == f"warmstart-adapter-{cells['warmstart']['settings_hash']}"
    assert len({c["settings_hash"] for c in cells.values()}) == 1 and cells["sft"]["sft_budget"]["train_seconds"] > 0
    text = doc.read_text()
    for label in ablation.ARM_LABELS.values():
        assert f"| rollback | {label} | 1 | 4 |" in text
    for a, b in ablation.PAIRS:
        assert f"| rollback | {a} − {b} | 1 |" in text
    assert "All 4 cells." in text
    # What each arm trained on: 1 step × 4 rollouts for the GRPO arms; the warm start's 1 step × 2 traces.
    regenerated = cells["agentic"]["fired"]["rollback/attempts"]
    assert "| 2 traces | - |" in text and "| 4 rollouts | - |" in text
    assert f"| 4 rollouts{f' + {regenerated:.0f} regenerated turns' if regenerated else ''} |" in text
    assert f"| {2 * cells['sft']['sft_steps']} traces | - |" in text
    assert (
        f"Cells recorded {min(c['date'] for c in cells.values())} to {max(c['date'] for c in cells.values())}" in text
    )
    assert text.endswith("## Findings\n\nWritten by hand.\n")  # the hand-written part is kept on every render
    partial, _ = ablation.render(out, ["rollback"], [0, 1], "cmd")
    assert "**Partial: 4 of 8 cells** (missing: rollback seed 1 warmstart, rollback seed 1 trl," in partial
    assert doc.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resume: finished cells are read back, nothing is trained again.
    def fail(*args, **kwargs):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr(ablation, "_train_grpo", fail)
    monkeypatch.setattr(ablation, "_evaluate", fail)
    assert ablation.main(argv) == 0
    # An SFT cell trained at another rate (recorded, or from before the rate was recorded: the warm start's) is refused.
    sft_path = out / "rollback" / "seed0" / "sft.json"
    recorded = json.loads(sft_path.read_text())
    for stale in (
        {**recorded, "sft_learning_rate": 3e-4},
        {k: v for k, v in recorded.items() if k != "sft_learning_rate"},
    ):
        sft_path.write_text(json.dumps(stale))
        with pytest.raises(RuntimeError, match="learning rate 0.0003, not the GRPO arms' 0.0001"):
            ablation.main(argv)
    sft_path.write_text(json.dumps(recorded))
    # Cells of other settings are never mixed in: a run with 2 steps refuses the 1-step cells.
    with pytest.raises(RuntimeError, match="other settings"):
        ablation.main([("2" if a == "1" and argv[k - 1] == "--steps" else a) for k, a in enumerate(argv)])


def test_a_new_machine_trains_the_warm_start_again_and_checks_it_is_the_recorded_one(tiny_model_dir, tmp_path):
    """Cells are committed, adapters are not: a cell run where the adapter is missing recreates it first, and refuses to
    go on when the recreated warm start is not the recorded one (the arms would not share a starting point)."""
    work, cells = tmp_path / "work", tmp_path / "cells"
    kwargs = dict(
        steps=1,
        num_eval=2,
        cells=cells,
        overrides={
            "model_name_or_path": str(tiny_model_dir),
            "warmstart_steps": 2,
            "warmstart_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "per_device_train_batch_size": 4,
            "max_completion_length": 16,
        },
    )
    warm = ablation.run_cell("rollback", 0, "warmstart", work, **kwargs)
    adapter = work / "rollback" / "seed0" / f"warmstart-adapter-{warm['settings_hash']}"
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    import shutil

    shutil.rmtree(work)  # a new machine: the committed cells only
    trl = ablation.run_cell("rollback", 0, "trl", work, **kwargs)
    assert trl["arm"] == "trl" and len(trl["success"]) == 2
    assert (adapter / "adapter_model.safetensors").read_bytes() == weights

    shutil.rmtree(work)
    path = cells / "rollback" / "seed0" / "warmstart.json"
    path.write_text(json.dumps({**warm, "warmstart_losses": [x + 0.5 for x in warm["warmstart_losses"]]}))
    (cells / "rollback" / "seed0" / "trl.json").unlink()
    with pytest.raises(RuntimeError, match="not the recorded"):
        ablation.run_cell("rollback", 0, "trl", work, **kwargs)


def test_held_out_problems_are_removed_from_every_training_set():
    """Generators of different seeds can draw the same expression: the ablation trains on none of the held-out ones
    (warm start, GRPO, the SFT arm's fresh traces), counted independently here."""
    from trl_agentic.tasks import TaskArguments, build_task

    args = TaskArguments(task="calculator", task_difficulty="easy", num_train_tasks=256, num_eval_tasks=128)
    task = build_task(args)
    held_out = {row["expression"] for row in task.eval_dataset}
    shared = [row for row in task.train_dataset if row["expression"] in held_out]
    assert shared  # the easy generator does repeat itself across seeds
    kept = ablation._without_problems(task, {ablation._problem_key(r) for r in task.eval_dataset})
    assert len(kept.train_dataset) == len(task.train_dataset) - len(shared)
    assert not {row["expression"] for row in kept.train_dataset} & held_out
    assert not {row["expression"] for row in kept.warmstart_dataset} & held_out
    assert ablation._problem_key({"task_seed": 7, "prompt": [{"content": "x"}]}) == "task_seed=7"


def test_only_the_agentic_arm_is_charged_with_tracin_validation_rollouts():
    # Every arm of a feature shares its config; TRL's control ignores the TracIn fields and rolls out no validation.
    settings = {
        "use_cpu": True, "bf16": False, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
        "num_generations": 4, "tracin_enabled": True,
        "tracin_val_batch_size": 2, "tracin_val_num_generations": 4, "tracin_val_refresh_steps": 1,
        "tracin_val_rollout_steps": 3,
    }  # fmt: skip
    cell = {"steps": 8, "settings": settings, "fired": {"rollback/attempts": 0}}
    assert ablation._trained_on([{**cell, "arm": "trl"}]) == "32 rollouts"
    # Validation rollouts at steps 0, 3 and 6: 3 x 2 prompts x 4 completions.
    assert ablation._trained_on([{**cell, "arm": "agentic"}]) == "32 rollouts + 24 TracIn validation rollouts"
    # Rollouts only at a refresh of V: refreshes at 0, 4 (the default every 4 steps); rollouts due every 3 steps.
    default = {k: v for k, v in settings.items() if k != "tracin_val_refresh_steps"}
    assert ablation._trained_on([{**cell, "settings": default, "arm": "agentic"}]) == (
        "32 rollouts + 16 TracIn validation rollouts"
    )
    # The config's defaults for both (refresh every 4, roll out every 8): only at step 0 within 8 steps.
    default = {k: v for k, v in default.items() if k != "tracin_val_rollout_steps"}
    assert ablation._trained_on([{**cell, "settings": default, "arm": "agentic"}]) == (
        "32 rollouts + 8 TracIn validation rollouts"
    )


def test_rollouts_are_counted_per_generation_window():
    # TRL generates one generation batch every steps_per_generation x num_iterations micro-steps.
    settings = {"use_cpu": True, "bf16": False, "per_device_train_batch_size": 4, "num_generations": 4}
    cell = {"steps": 8, "arm": "trl", "fired": {}}
    # 8 steps of 1 micro-step, a batch of 8 every 2: 4 batches.
    spread = {**settings, "generation_batch_size": 8}
    assert ablation._trained_on([{**cell, "settings": spread}]) == "32 rollouts"
    # Each batch trained on twice: 2 batches of 4 in 8 steps.
    reused = {**settings, "num_iterations": 2}
    assert ablation._trained_on([{**cell, "settings": reused}]) == "16 rollouts"
    # 2 micro-steps per optimizer step, a batch of 8 per step: 8 batches.
    accumulated = {**settings, "gradient_accumulation_steps": 2}
    assert ablation._trained_on([{**cell, "settings": accumulated}]) == "64 rollouts"
    # 3 steps with each batch trained on twice: the second batch is rolled out at step 2.
    assert ablation._trained_on([{**cell, "steps": 3, "settings": reused}]) == "8 rollouts"
