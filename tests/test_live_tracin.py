"""TracIn live on a tool task (issue 18): `configs/tracin.yaml` through `trl-agentic train`, on the embedded model.

After the calculator warm start, the GRPO rollouts call the tool, the validation prompts are held-out problems that
the run neither evaluates nor trains on, and over the run TracIn both keeps and rejects training rows. The test asserts that the filter
fires, not that it helps.
"""

from pathlib import Path

import pytest
from live_helpers import precision_overrides

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tracin.yaml"


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a warm start and TracIn-filtered GRPO steps on SmolLM2; generous for a loaded machine
def test_tracin_keeps_and_rejects_rows_of_tool_rollouts(tmp_path):
    from trl_agentic.cli import _tracin_validation, make_parser, train
    from trl_agentic.tasks import build_task

    task_args, training_args, model_args = make_parser().parse_args_and_config(
        args=["--config", str(CONFIG), "--output_dir", str(tmp_path), *precision_overrides()]
    )
    trainer = train(task_args, training_args, model_args)

    # The validation prompts are held-out problems that the run neither evaluates nor trains on (task_seed + 10).
    task = build_task(task_args)
    validation = [r["expression"] for r in trainer._tracin.dataset]
    assert validation == [r["expression"] for r in _tracin_validation(task, task_args)] and validation
    assert not set(validation) & {r["expression"] for r in (*task.eval_dataset, *task.train_dataset)}

    steps = [h for h in trainer.state.log_history if "tracin/selected_ratio" in h]
    assert len(steps) == training_args.max_steps
    for h in steps:
        print({k: v for k, v in h.items() if k.startswith(("tracin/", "tools/", "reward"))})
    kept = sum(h["tracin/num_selected"] for h in steps)
    # selected_ratio = selected / valid rows, so the rejected rows of a step are selected / ratio - selected.
    rejected = sum(
        round(h["tracin/num_selected"] / h["tracin/selected_ratio"]) - h["tracin/num_selected"] for h in steps
    )
    assert kept > 0 and rejected > 0, steps
    assert any(h["tracin/val_grad_norm"] > 0 for h in steps)  # a non-zero validation direction did the selecting
    assert all(h["tools/call_frequency"] > 0 for h in steps)
