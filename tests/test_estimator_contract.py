"""What a custom advantage estimator returns is checked before the synchronisation point that ends the estimator stage
(`BatchAugmenter._estimate`, `trl_agentic.rank_errors`), so that a bad result raises on every process there instead of
failing later on one process (after the extra rows' forward passes, which other processes have left), or silently
joining an extra row to the wrong group."""

import pytest
import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.batch import check_estimate
from trl_agentic.estimators import EstimatorResult, grpo_estimator
from trl_agentic.rollout.types import ExtraRow, RowKind

BAD = {}


def reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def _row(parent, length=3):
    return ExtraRow(
        kind=RowKind.EXPANSION,
        parent=parent,
        prompt_ids=[1, 2],
        completion_ids=[3] * length,
        tool_mask=[1] * length,
        logprobs=None,
    )


def estimator_with_a_bad_extra_row(batch, trainer):
    """GRPO plus one extra row whose parent or advantages break the contract (`BAD`)."""
    advantages = grpo_estimator(batch, trainer)
    row = _row(BAD["parent"], BAD.get("length", 3))
    extra = BAD.get("extra", torch.zeros(1))
    return EstimatorResult(advantages=advantages, extra_rows=[row], extra_advantages=extra)


@pytest.mark.parametrize(
    "parent,extra,message",
    [
        (-1, torch.zeros(1), "parent"),  # 009b255 / r35: silently the last row's group and episode
        (4, torch.zeros(1), "parent"),  # r35: IndexError after the synchronisation point, on this process only
        (0, torch.zeros(1, 9), "width"),  # wider than the row it belongs to: torch.cat fails after the sync point
        (0, torch.zeros(1, 2, 2), "shape"),
    ],
)
def test_bad_extra_rows_are_refused_at_the_estimator_stage(parent, extra, message):
    advantages = torch.zeros(4)
    result = EstimatorResult(advantages=advantages, extra_rows=[_row(parent)], extra_advantages=extra)
    with pytest.raises(ValueError, match=message):
        check_estimate(result, num_rows=4, width=5)


def test_good_extra_rows_pass_the_check():
    """The limits are the contract's: parents 0..B-1, advantages (K,) or (K, T') with T' up to the widest of the
    batch and the extra rows (token-level ones are re-padded with the batch)."""
    rows = [_row(0), _row(3, length=7)]
    for extra in (torch.zeros(2), torch.zeros(2, 7), torch.zeros(2, 5), torch.zeros(2, 1)):
        result = EstimatorResult(advantages=torch.zeros(4), extra_rows=rows, extra_advantages=extra)
        advantages, got_rows, got_extra = check_estimate(result, num_rows=4, width=5)
        assert got_rows == rows and got_extra is extra


def test_a_bad_parent_stops_at_the_estimator_stage_of_the_trainer(tiny_model_dir, tmp_path):
    """Through the trainer: the error is raised by the estimator stage's synchronisation point (`rank_errors` marks
    it), i.e. where every process raises together, and names the parent."""
    BAD.clear()
    BAD.update(parent=8)
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        save_strategy="no",
        advantage_estimator="test_estimator_contract:estimator_with_a_bad_extra_row",
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Say hi."}]] * 4})
    trainer = AgenticGRPOTrainer(model=tiny_model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.model.train()
    with pytest.raises(ValueError, match="parent 8") as info:
        trainer._generate_and_score_completions(list(dataset))
    assert "_estimate" in [frame.name for frame in info.traceback]
    assert "_append_estimator_rows" not in [frame.name for frame in info.traceback]


def test_an_estimator_passed_to_the_trainer_counts_as_one_named_in_the_config(tiny_model_dir, tmp_path):
    """`advantage_estimator=fn` takes precedence over the config, and is treated like `advantage_estimator="pkg:fn"`:
    refused with GDPO's `normalize_then_sum` (which keeps TRL's advantages: the callable was silently never called)
    and with `row_selection`, and `bnpo` weighs tokens equally (its rows may be added: with TRL's per-micro-batch
    normaliser a sparse micro-batch's tokens weighed twice)."""
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Say hi."}]] * 4})

    def args(**overrides):
        base = dict(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4
        )
        return AgenticGRPOConfig(**{**base, "num_generations": 4, "max_completion_length": 8, **overrides})

    def build(config, **kwargs):
        return AgenticGRPOTrainer(
            model=tiny_model_dir, reward_funcs=[reward, reward], args=config, train_dataset=dataset, **kwargs
        )

    gdpo = args(multi_objective_aggregation="normalize_then_sum")
    build(gdpo)  # GDPO alone is TRL's
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        build(gdpo, advantage_estimator=grpo_like)
    with pytest.raises(ValueError, match="row_selection"):
        build(args(row_selection="random"), advantage_estimator=grpo_like)
    assert build(args(loss_type="bnpo"), advantage_estimator=grpo_like)._equal_token_weights
    assert not build(args(loss_type="bnpo"))._equal_token_weights  # TRL's batch, TRL's normaliser


def grpo_like(batch, trainer):
    return grpo_estimator(batch, trainer)
