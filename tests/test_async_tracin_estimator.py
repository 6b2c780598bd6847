"""The asynchronous TracIn filter's validation rows under a trainer-side advantage estimator (`advantage_estimator !=
"grpo"`): the estimator runs on each validation group as on a training group, its token-level advantages and added
rows reach V, and ties are zeroed by the synchronous trainer's rule. Trajectories are scripted
(`test_async_tracin_validation._script`); the estimator here is a plain function whose output is written out, and V
is checked against autograd of the token-level loss by hand (`_brute_force_direction`). RLVCR itself: `tests/rlvcr/test_async_validation.py`."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from async_tracin_helpers import lora_model
from test_async_tracin_validation import _brute_force_direction, _flat, _pool, _row, _script, _tracin, _trainer

from trl_agentic.estimators import EstimatorResult
from trl_agentic.rollout.types import ExtraRow, RowKind

EXTRA = ExtraRow(
    kind=RowKind.EXPANSION, parent=0, prompt_ids=[11, 12, 13], completion_ids=[21, 22, 23, 24], tool_mask=[1, 1, 0, 1],
    logprobs=None,
)  # fmt: skip


def _estimator(seen):
    """A token-level estimator: advantage `reward * (t + 1) / 10` at completion position t where the loss mask is 1
    (0 for a NaN reward), plus `EXTRA` (parent row 0) with advantages `-0.5 * (t + 1)`. `seen` collects the batches."""

    def estimate(batch, trainer):
        seen.append(batch)
        trainer._metrics["train"]["custom/calls"].append(1.0)  # validation's must not reach training's metrics
        positions = torch.arange(1, batch.completion_ids.size(1) + 1, dtype=torch.float32)
        rewards = torch.nan_to_num(batch.rewards[batch.local_index], nan=0.0)
        advantages = rewards[:, None] * positions[None] / 10 * batch.loss_mask
        extra = -0.5 * torch.arange(1, len(EXTRA.completion_ids) + 1, dtype=torch.float32)
        return EstimatorResult(advantages, [EXTRA], extra[None])

    return estimate


def _expected_advantage(ids, mask, reward):
    """`_estimator`'s advantage of a row laid out over its `input_ids`: 0 on the prompt (before the first trained
    token), `reward * (t + 1) / 10` at completion position t where the row's mask is 1."""
    start = mask.index(1)
    out = np.zeros(len(ids))
    for t, m in enumerate(mask[start:]):
        out[start + t] = reward * (t + 1) / 10 * m
    return out


def test_a_trainer_side_estimator_makes_the_validation_rows_and_their_token_advantages(tiny_model_dir, tmp_path):
    """One group of three rollouts: a success, a failure and a rollout lost to the infrastructure. The estimator sees
    all three kept rows (the lost one with NaN reward and a zero loss mask, as the synchronous trainer shows it), and
    V's rows are the two trained ones plus the row it adds, each with the estimator's token advantages over its
    `input_ids` (not the worker's group advantages), the added row's on its completion only. V against autograd of
    the token-level loss. The rows survive a checkpoint: the resumed refresh recomputes the same V bit for bit."""
    model = lora_model(tiny_model_dir)
    pool = _pool()
    trainer = _trainer(model, tracin_val_rollout_steps=4)
    seen = []
    trainer.advantage_estimator = _estimator(seen)
    tracin = _tracin(trainer, ["p"])
    plans = [("1.0", [_row(*pool[0])]), ("0.5", [_row(*pool[1])]), ("1.0", [_row(*pool[2], lost=True)])]
    _script(tracin, lambda prompt, k: plans[k])
    tracin.refresh()

    (batch,) = seen
    assert batch.rewards[:2].tolist() == [1.0, 0.5] and torch.isnan(batch.rewards[2])
    assert batch.loss_mask[2].sum() == 0 and batch.loss_mask[:2].sum() > 0  # the lost row: seen, not trained
    assert [r["kind"] for r in tracin.val_rows] == [RowKind.REGULAR, RowKind.REGULAR, RowKind.EXPANSION]
    assert [r["input_ids"].tolist() for r in tracin.val_rows] == [pool[0][0], pool[1][0], extra_ids()]
    for row, (ids, mask), reward in zip(tracin.val_rows[:2], pool[:2], [1.0, 0.5]):
        np.testing.assert_allclose(row["advantage"], _expected_advantage(ids, mask, reward), rtol=1e-6)
    np.testing.assert_allclose(tracin.val_rows[2]["advantage"], [0, 0, 0, -0.5, -1.0, -1.5, -2.0])
    assert tracin.val_rows[2]["completion_mask"].tolist() == [0, 0, 0, 1, 1, 0, 1]
    assert not trainer._metrics["train"].keys() - {"tracin/val_reward", "perf/tracin_val_rollout_s",
                                                   "tracin/val_grad_norm", "perf/tracin_refresh_s"}  # fmt: skip
    want = _brute_force_direction(model, tracin.val_rows, trainer.temperature)
    scale = float(want.abs().max())
    assert scale > 0
    torch.testing.assert_close(_flat(tracin.direction), want, rtol=1e-4, atol=1e-5 * scale)

    tracin.save(str(tmp_path))
    resumed = _tracin(trainer, ["p"])
    resumed.load(str(tmp_path))
    _script(resumed, lambda prompt, k: pytest.fail("the resumed run rolled out"))
    resumed.refresh()
    for a, b in zip(resumed.val_rows, tracin.val_rows):
        assert isinstance(a["advantage"], np.ndarray) and np.array_equal(a["advantage"], b["advantage"])
    assert torch.equal(_flat(resumed.direction), _flat(tracin.direction))


@pytest.mark.parametrize("estimator", ["custom", "grpo_callable"])
def test_a_tied_validation_group_is_zeroed_by_the_synchronous_trainers_rule(tiny_model_dir, estimator):
    """Every rollout rewarded 0.3 (no spread). A custom estimator keeps what it returns (it can carry signal without a
    reward spread): V is its direction, not zero. GRPO's estimator passed as a callable is GRPO: rows 0, V = 0."""
    from trl_agentic.estimators import grpo_estimator

    model = lora_model(tiny_model_dir)
    pool = _pool()
    trainer = _trainer(model, tracin_val_num_generations=6)
    trainer.advantage_estimator = _estimator([]) if estimator == "custom" else grpo_estimator
    tracin = _tracin(trainer, ["p"])
    _script(tracin, lambda prompt, k: ("0.3", [_row(*pool[k])]))
    tracin.refresh()
    if estimator == "custom":
        assert len(tracin.val_rows) == 7 and not tracin.direction_is_zero
        np.testing.assert_allclose(tracin.val_rows[1]["advantage"], _expected_advantage(*pool[1], 0.3), rtol=1e-6)
        want = _brute_force_direction(model, copy.deepcopy(tracin.val_rows), trainer.temperature)
        torch.testing.assert_close(_flat(tracin.direction), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    else:
        assert [r["advantage"] for r in tracin.val_rows] == [0.0] * 6 and tracin.direction_is_zero


def test_the_estimator_sees_every_row_kind_of_a_validation_group_as_in_training():
    """A group of three conversations: a regular row with a negative row (a rolled-back attempt) and a snapshot
    segment; a rollout lost to the infrastructure; a truncated rollout with a snapshot segment under
    `mask_truncated_completions`. The estimator's batch, written out from the rules (not from the worker's
    functions): every kept row in the group's order, rewards (the negative's `negative_sample_reward`, a segment its
    episode's, NaN for the lost rollout), the baseline (`all_rows`: regular and negative rows; segments scored
    against it), each row anchored to its conversation's regular row, and a loss mask only on the rows training
    trains (not the lost rollout's, not the masked conversation's regular row and segment; the negative row is its
    own complete turn). V's rows are exactly the trained ones plus the row the estimator adds."""
    pool = _pool(n=6)
    trainer = _trainer(
        torch.nn.Linear(1, 1), save_negative_samples=True, enable_tool_rollback=True, enable_context_snapshots=True,
        mask_truncated_completions=True, tracin_val_num_generations=3, group_baseline="all_rows",
    )  # fmt: skip
    seen = []
    trainer.advantage_estimator = _estimator(seen)
    tracin = _tracin(trainer, ["p"])
    plans = [
        ("0.3", [_row(*pool[0]), _row(*pool[1], kind=RowKind.NEGATIVE, error_types=["ValueError"]),
                 _row(*pool[2], kind=RowKind.SNAPSHOT)]),
        ("1.0", [_row(*pool[3], lost=True)]),
        ("0.8", [_row(*pool[4], truncated=True), _row(*pool[5], kind=RowKind.SNAPSHOT)]),
    ]  # fmt: skip
    _script(tracin, lambda prompt, k: plans[k])
    rows, rewards = tracin.validation.run([{"prompt": "p"}], seed=0)

    (batch,) = seen
    negative = trainer.args.negative_sample_reward
    assert batch.row_kind.tolist() == [0, 1, 2, 0, 0, 2]
    np.testing.assert_array_equal(
        batch.rewards.numpy(), np.array([0.3, negative, 0.3, np.nan, 0.8, 0.8], dtype=np.float32)
    )
    assert batch.baseline_mask.tolist() == [True, True, False, True, True, False]
    assert batch.episode_ids.tolist() == [0, 0, 0, 3, 4, 4]
    assert [bool(m.any()) for m in batch.loss_mask] == [True, True, True, False, False, False]
    for k, m in zip(range(3), batch.loss_mask[:3]):  # the trained rows' masks are their completion masks
        assert m[: len(pool[k][1]) - 4].tolist() == pool[k][1][4:]
    assert [r["input_ids"].tolist() for r in rows] == [pool[0][0], pool[1][0], pool[2][0], extra_ids()]
    assert [r["kind"] for r in rows] == [RowKind.REGULAR, RowKind.NEGATIVE, RowKind.SNAPSHOT, RowKind.EXPANSION]
    # The negative row's advantage is clamped at 0 (negative_sample_reward < 0 gives a negative value anyway).
    assert (rows[1]["advantage"] <= 0).all()
    assert np.isnan(rewards[1]) and rewards[::2] == [0.3, 0.8]


def extra_ids():
    return EXTRA.prompt_ids + EXTRA.completion_ids


def test_an_estimators_requests_in_validation_are_seeded_by_the_refresh():
    """An estimator that generates (RLVCR's alternative thinking) asks the server through its host during a refresh:
    the requests' sampling seeds come from the refresh's seed, one stream per group, not from the global `random`
    module, so the same refresh asks for the same samples and the global random state (which training's estimator
    requests draw from) is left as it was."""
    import random

    trainer = _trainer(torch.nn.Linear(1, 1), tracin_val_batch_size=2, tracin_val_num_generations=2)

    def estimator(batch, host):
        host._generate_single_turn([[1, 2, 3]])
        return torch.zeros(len(batch.local_index))

    trainer.advantage_estimator = estimator
    tracin = _tracin(trainer, ["a", "b"])
    _script(tracin, lambda prompt, k: ("1.0" if k % 2 else "0.0", [_row(*_pool()[k % 6])]))
    seeds = []
    tracin.validation._estimator_host._post = lambda payload: (
        seeds.append(payload["seed"]) or {"token_ids": [5], "logprobs": {"token_logprobs": [0.0]}}
    )
    prompts = [{"prompt": "a"}, {"prompt": "b"}]
    runs = {}
    for key, seed in [("first", 7), ("again", 7), ("other", 8)]:
        seeds.clear()
        state = random.getstate()
        tracin.validation.run(prompts, seed=seed)
        assert random.getstate() == state
        runs[key] = list(seeds)
    assert len(runs["first"]) == 2 and runs["first"][0] != runs["first"][1]
    assert runs["again"] == runs["first"] and runs["other"] != runs["first"]
