"""`make ablation`'s harness (issue 18): the statistics, and one complete resumable run on the tiny model."""

import json
import math
import random

import pytest

from trl_agentic import ablation


def test_bootstrap_interval_of_constant_values_is_the_value():
    assert ablation.bootstrap_interval([[1.0, 1.0], [1.0]]) == (1.0, 1.0, 1.0)
    assert ablation.bootstrap_interval([[0.0] * 5]) == (0.0, 0.0, 0.0)


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
    ]  # fmt: skip
    assert ablation.main(argv) == 0
    cells = {arm: json.loads((out / "rollback" / "seed0" / f"{arm}.json").read_text()) for arm in ablation.ARMS}
    for arm, cell in cells.items():
        assert cell["arm"] == arm and cell["num_eval"] == 4
        assert len(cell["success"]) == 4 and set(cell["success"]) <= {0.0, 1.0}
    # The control is TRL's own trainer; the feature arm ours; the SFT arm trained at least one step.
    assert cells["trl"]["trainer"] == "GRPOTrainer" and cells["agentic"]["trainer"] == "AgenticGRPOTrainer"
    assert cells["sft"]["sft_steps"] >= 1
    assert len(cells["warmstart"]["warmstart_losses"]) == 1
    assert sorted(p.name for p in (out / "rollback" / "seed0").iterdir()) == sorted(f"{a}.json" for a in ablation.ARMS)
    assert (work / "rollback" / "seed0" / "warmstart-adapter" / "adapter_config.json").exists()
    text = doc.read_text()
    for label in ablation.ARM_LABELS.values():
        assert f"| rollback | {label} | 1 | 4 |" in text
    assert doc.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resume: finished cells are read back, nothing is trained again.
    def fail(*args, **kwargs):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr(ablation, "_train_grpo", fail)
    monkeypatch.setattr(ablation, "_evaluate", fail)
    assert ablation.main(argv) == 0


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
    adapter = work / "rollback" / "seed0" / "warmstart-adapter"
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
