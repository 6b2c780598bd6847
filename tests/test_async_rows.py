"""`trl_agentic.async_grpo.rows`: a group's rows (regular, negative, snapshot) get the synchronous trainer's rewards
and advantages. The oracle assembles the rewards and the baseline with a plain loop from the rules as documented
(`BatchAugmenter`), then calls the synchronous trainer's own `group_advantages`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_agentic.advantages import group_advantages
from trl_agentic.async_grpo.rows import (
    AgenticSequence,
    group_row_advantages,
    pushed_rows,
    row_from_tokens,
    score_group_rows,
    sequences_from_loop,
)
from trl_agentic.rollout.types import ExtraRow, RowKind

ERRORS = ["ValueError", "ZeroDivisionError", "TypeError"]


def _args(**kw):
    values = dict(
        negative_sample_reward=-1.0,
        negative_reward_by_error={"TypeError": -2.0},
        max_negative_samples_per_group=2,
        group_baseline="all_rows",
        snapshot_advantage="episode",
        snapshot_reward_func=None,
        scale_rewards="group",
        advantage_std_floor=0.1,
    )
    values.update(kw)
    return SimpleNamespace(**values)


rows_strategy = st.lists(
    st.tuples(
        st.integers(0, 3),  # conversation
        st.sampled_from([int(RowKind.NEGATIVE), int(RowKind.SNAPSHOT)]),
        st.lists(st.sampled_from(ERRORS), min_size=1, max_size=2),
    ),
    max_size=6,
)


@settings(max_examples=60)
@given(
    rewards=st.lists(st.one_of(st.sampled_from([0.0, 0.1, 1.0, math.nan]), st.floats(-1, 1)), min_size=4, max_size=4),
    extra=rows_strategy,
    baseline=st.sampled_from(["all_rows", "episodes"]),
    snapshot_advantage=st.sampled_from(["episode", "row"]),
    cap=st.integers(0, 3),
    scale=st.sampled_from(["group", "none"]),
    floor=st.sampled_from([0.1, 0.5]),
    order=st.randoms(use_true_random=False),
    iterations=st.lists(st.integers(0, 2), min_size=10, max_size=10),
)
def test_group_rows_follow_the_synchronous_rules(
    rewards, extra, baseline, snapshot_advantage, cap, scale, floor, order, iterations
):
    args = _args(
        group_baseline=baseline,
        snapshot_advantage=snapshot_advantage,
        max_negative_samples_per_group=cap,
        scale_rewards=scale,
        advantage_std_floor=floor,
    )
    rows = [(c, int(RowKind.REGULAR), []) for c in range(4)] + list(extra)
    order.shuffle(rows)  # a group's rows in any order: regular rows need not come first
    conversation = [c for c, _, _ in rows]
    kinds = [k for _, k, _ in rows]
    errors = [e for _, _, e in rows]
    # The cap keeps the negatives saved in the earliest loop iterations (ties: row order).
    got = group_row_advantages(rewards, conversation, kinds, errors, args, cap_order=iterations[: len(rows)])
    negatives = [k for k in range(len(rows)) if kinds[k] == RowKind.NEGATIVE]
    capped = {
        k
        for k in negatives
        if sum(iterations[m] < iterations[k] or (iterations[m] == iterations[k] and m < k) for m in negatives) < cap
    }

    # Plain loop: the rules as documented.
    keep, row_rewards, in_baseline, row_kinds, row_conv = [], [], [], [], []
    for k, (conv, kind, types) in enumerate(zip(conversation, kinds, errors)):
        if kind == RowKind.NEGATIVE:
            ok = k in capped
            matched = [args.negative_reward_by_error[t] for t in types if t in args.negative_reward_by_error]
            reward = min(matched) if matched else args.negative_sample_reward
        else:
            ok, reward = True, rewards[conv]
        keep.append(ok)
        if ok:
            row_rewards.append(reward)
            row_kinds.append(kind)
            row_conv.append(conv)
            if baseline == "episodes":
                in_baseline.append(kind == RowKind.REGULAR)
            else:
                in_baseline.append(
                    kind in (RowKind.REGULAR, RowKind.NEGATIVE)
                    or (kind == RowKind.SNAPSHOT and snapshot_advantage == "row")
                )
    # An extra row is measured from its own rollout's regular row (its position among the kept rows).
    position = {c: k for k, (c, kind) in enumerate(zip(row_conv, row_kinds)) if kind == RowKind.REGULAR}
    expected = group_advantages(
        torch.tensor(row_rewards, dtype=torch.float32),
        torch.zeros(len(row_rewards), dtype=torch.long),
        scale=scale,
        baseline_mask=torch.tensor(in_baseline),
        anchors=torch.tensor([position[c] for c in row_conv]),
        std_floor=floor,
    )
    expected = [min(a, 0.0) if k == RowKind.NEGATIVE else a for a, k in zip(expected.tolist(), row_kinds)]
    assert got.keep == keep
    torch.testing.assert_close(got.rewards, torch.tensor(row_rewards, dtype=torch.float32), equal_nan=True)
    assert got.baseline.tolist() == in_baseline
    torch.testing.assert_close(got.advantages, torch.tensor(expected, dtype=torch.float32))


def test_row_layout_and_sequences():
    ids, mask, lps = row_from_tokens([1, 2], [3, 4, 5], [1, 0, 1], [-0.5, -9.0, float("nan")])
    assert ids == [1, 2, 3, 4, 5] and mask == [0, 0, 1, 0, 1]
    assert lps == [0.0, 0.0, -0.5, 0.0, 0.0]  # environment tokens and vLLM's NaN log-probs are zero-filled
    negative = ExtraRow(
        kind=RowKind.NEGATIVE,
        parent=0,
        prompt_ids=[1, 2, 3],
        completion_ids=[6, 7],
        tool_mask=[1, 0],
        logprobs=[-1.0, 0.0],
        error_types=["ValueError"],
    )
    rows = sequences_from_loop([1, 2], [3, 4], [1, 1], [-0.1, -0.2], [negative], "r", last_segment=1)
    assert [r.kind for r in rows] == [RowKind.REGULAR, RowKind.NEGATIVE]
    assert rows[0].segment_index == 1 and rows[1].error_types == ["ValueError"]
    assert rows[1].input_ids == [1, 2, 3, 6, 7] and rows[1].completion_mask == [0, 0, 0, 1, 0]


def _sequence(kind: int, trained: bool, lost: bool = False, errors=()):
    return AgenticSequence(
        [1, 2, 3], [0, int(trained), 0], [0.0] * 3, "r", kind=kind, error_types=list(errors), lost=lost
    )


@settings(max_examples=80)
@given(
    status=st.lists(st.sampled_from(["ok", "failed", "unscorable", "lost"]), min_size=1, max_size=4),
    extra=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([int(RowKind.NEGATIVE), int(RowKind.SNAPSHOT)]), st.booleans()),
        max_size=6,
    ),
    regular_tokens=st.lists(st.booleans(), min_size=4, max_size=4),
    cap=st.integers(0, 3),
)
def test_pushed_rows_are_the_rows_the_synchronous_trainer_trains(status, extra, regular_tokens, cap):
    """`score_group_rows` (what the async worker pushes) against the synchronous trainer's own `_untrained_rows`: a
    rollout lost to infrastructure has its regular and snapshot rows untrained and its negative rows trained (their
    own turn, their own penalty); an unscorable one (reward functions gave None) is trained; a negative beyond the cap
    is dropped before either; a row without a trained token is not pushed."""
    from trl_agentic.batch import BatchAugmenter

    n = len(status)
    extra = [(c % n, kind, tokens) for c, kind, tokens in extra]
    lost = [s == "lost" for s in status]
    layout = [(c, int(RowKind.REGULAR), regular_tokens[c]) for c in range(n)] + extra
    rows = [
        _sequence(kind, tokens, lost=kind == RowKind.REGULAR and lost[c], errors=["ValueError"] * (kind == 1))
        for c, kind, tokens in layout
    ]
    value = {"ok": 1.0, "failed": 0.0, "unscorable": math.nan, "lost": 0.0}  # TRL scores a lost one too
    scored, got = score_group_rows(
        rows,
        [c for c, _, _ in layout],
        [value[status[c]] for c, _, _ in layout],
        n,
        _args(max_negative_samples_per_group=cap),
    )

    # The synchronous trainer's rule, on its own layout: the regular rows, then the kept extra rows with their parents.
    kept_extras = [k for k in range(n, len(layout)) if scored.keep[k]]
    trainer = SimpleNamespace(
        args=SimpleNamespace(mask_truncated_completions=False, snapshot_reward_func=None),
        accelerator=SimpleNamespace(device="cpu"),
    )
    parents = [
        ExtraRow(RowKind(layout[k][1]), layout[k][0], prompt_ids=[], completion_ids=[], tool_mask=[], logprobs=None)
        for k in kept_extras
    ]
    untrained = BatchAugmenter(trainer)._untrained_rows({}, lost, parents).tolist()
    sync_trained = {k for k in range(n) if not untrained[k]} | {
        k for e, k in enumerate(kept_extras) if not untrained[n + e]
    }
    assert [k for k, _ in got] == [k for k in range(len(layout)) if k in sync_trained and layout[k][2]]
    kept_all = range(len(layout))
    # For an estimator on the trainer side every kept row is pushed, flagged whether it is trained: the rows the
    # synchronous trainer's estimator sees (its whole batch), and among them the ones it trains.
    pushed = pushed_rows(scored.keep, got, untrained=True)
    assert [(k, j) for k, j, _ in pushed] == [(k, j) for j, k in enumerate(k for k in kept_all if scored.keep[k])]
    assert [k for k, _, trained in pushed if trained] == [k for k, _ in got]
    assert pushed_rows(scored.keep, got, untrained=False) == [(k, j, True) for k, j in got]
    # Positions index the kept rows (the advantages' order); a lost rollout's reward is outside the statistics.
    kept = [k for k in range(len(layout)) if scored.keep[k]]
    assert all(kept[j] == k for k, j in got)
    for k, j in zip(kept, range(len(kept))):
        c, kind = layout[k][0], layout[k][1]
        if kind == RowKind.REGULAR and status[c] in ("lost", "unscorable"):
            assert math.isnan(float(scored.rewards[j])) and float(scored.advantages[j]) == 0.0


def test_a_lost_rollouts_negative_row_is_pushed_with_its_penalty_and_stays_in_the_baseline():
    """A rollout saved a failed attempt, then was lost to infrastructure: its negative row is trained with its penalty
    and is in the baseline of the three scored episodes (rewards 1, 0, 0, penalty -1). A fifth, unscorable rollout
    (NaN) is trained at advantage 0 and stays outside the statistics."""
    rows = [_sequence(0, True), _sequence(0, True), _sequence(0, True), _sequence(0, True, lost=True)]
    rows += [_sequence(int(RowKind.NEGATIVE), True, errors=["ValueError"]), _sequence(0, True)]
    scored, got = score_group_rows(rows, [0, 1, 2, 3, 3, 4], [1.0, 0.0, 0.0, 0.0, 0.0, math.nan], 5, _args())
    assert got == [(0, 0), (1, 1), (2, 2), (4, 4), (5, 5)]
    values = torch.tensor([1.0, 0.0, 0.0, -1.0])
    expected = (values - values.mean()) / values.std()
    torch.testing.assert_close(scored.advantages[[0, 1, 2]], expected[:3], atol=1e-3, rtol=0)  # TRL's std + 1e-4
    assert float(scored.advantages[4]) == pytest.approx(min(float(expected[3]), 0.0), abs=1e-3)
    assert float(scored.advantages[5]) == 0.0 and math.isnan(float(scored.rewards[5]))


def test_a_trainer_side_estimator_sees_the_group_the_synchronous_trainer_would_and_only_trained_rows_go_on():
    """An estimator on the trainer side (`advantage_estimator != "grpo"`) gets the group as the worker scored it.

    Conversations with rewards 1, 0, 0 and a fourth lost to infrastructure after saving a failed attempt (penalty -1).
    The third conversation's row has no trained token. As in the synchronous trainer's batch, the estimator sees all
    five rows: the tokenless row in the statistics, the lost row with its NaN reward as the negative row's anchor (not
    -1), both untrained rows with a zero loss mask. Here the estimator is GRPO itself, so its result must be the
    worker's own advantages (checked by hand: mean 0 and unbiased std over 1, 0, 0, -1); only the three trained rows
    are passed on. Without the tokenless row the baseline would be 0 over 1, 0, -1 with another std."""
    import queue
    from collections import defaultdict

    import numpy as np

    from trl_agentic.async_grpo.stage import AgenticRolloutQueue
    from trl_agentic.async_grpo.worker import AgenticRolloutSample
    from trl_agentic.estimators import grpo_estimator

    rows = [_sequence(0, True), _sequence(0, True), _sequence(0, False), _sequence(0, True, lost=True)]
    rows.append(_sequence(int(RowKind.NEGATIVE), True, errors=["ValueError"]))
    conversation = [0, 1, 2, 3, 3]
    args = _args()
    scored, trained = score_group_rows(rows, conversation, [1.0, 0.0, 0.0, 0.0, 0.0], 4, args)
    assert trained == [(0, 0), (1, 1), (4, 4)]
    pushed = pushed_rows(scored.keep, trained, untrained=True)
    inner = queue.Queue()
    for k, j, is_trained in pushed:
        row = rows[k]
        inner.put(
            AgenticRolloutSample(
                prompt=[],
                completion=[],
                input_ids=np.asarray(row.input_ids),
                completion_mask=np.asarray(row.completion_mask),
                old_log_probs=np.zeros(len(row.input_ids), dtype=np.float32),
                advantage=float(scored.advantages[j]),
                model_version=0,
                group_id=5,
                metrics={},
                row_kind=int(row.kind),
                reward=float(scored.rewards[j]),
                episode=conversation[k],
                group_rows=len(pushed),
                trained=is_trained,
            )
        )
    seen = []

    def estimator(batch, trainer):
        seen.append(batch)
        return grpo_estimator(batch, trainer)

    trainer = SimpleNamespace(
        args=SimpleNamespace(**vars(args), temperature=1.0, chat_template_kwargs=None, max_staleness=4),
        processing_class=None,
        _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m),
        model=torch.nn.Linear(1, 1).eval(),  # eval mode, as a full model before the first training step
        model_version=0,
        _observed_rows=[],
    )
    stage = AgenticRolloutQueue(trainer, inner, estimator=estimator)
    out = [stage.get(timeout=1) for _ in range(3)]
    assert inner.empty() and stage.qsize() == 0 and trainer.model.training
    (batch,) = seen
    torch.testing.assert_close(batch.rewards, torch.tensor([1.0, 0.0, 0.0, math.nan, -1.0]), equal_nan=True)
    assert batch.episode_ids.tolist() == [0, 1, 2, 3, 3]
    assert batch.loss_mask.sum(dim=1).tolist() == [1, 1, 0, 0, 1]
    assert [s.episode for s in out] == [0, 1, 3] and [s.row_kind for s in out] == [0, 0, int(RowKind.NEGATIVE)]
    assert [s.group_rows for s in out] == [3, 3, 3]
    values = torch.tensor([1.0, 0.0, 0.0, -1.0])
    expected = (values - values.mean()) / (values.std() + 1e-4)  # the synchronous rule over the four scored rows
    torch.testing.assert_close(torch.tensor([s.advantage for s in out]), expected[[0, 1, 3]], atol=1e-5, rtol=0)
    torch.testing.assert_close(scored.advantages[[0, 1, 4]], expected[[0, 1, 3]], atol=1e-5, rtol=0)


def test_the_negative_cap_keeps_the_earliest_failures_as_the_synchronous_loop_does(tiny_tokenizer):
    """Cap 1, two rollouts of one group: rollout 0 fails at its second turn (iteration 1), rollout 1 at its first
    (iteration 0). The synchronous loop keeps rollout 1's failure (its quota is spent when rollout 0 fails). In the
    asynchronous worker each trajectory runs a loop of its own (both save their failure) and rollout 0 finishes first;
    the group's cap must still keep rollout 1's, not the first in row order."""
    from rollout_helpers import LedgerEnv, ScriptBackend, call, run_loop

    from trl_agentic.config import DEFAULT_INFRA_ERROR_TYPES, DEFAULT_ROLLBACK_ON_ERRORS
    from trl_agentic.rollout.loop import LoopConfig

    config = LoopConfig(
        rollback_on_errors=list(DEFAULT_ROLLBACK_ON_ERRORS),
        infra_error_types=list(DEFAULT_INFRA_ERROR_TYPES),
        enable_tool_rollback=True,
        save_negative_samples=True,
        max_negative_samples_per_group=1,
    )
    good1, bad, good2, final = call("add", n=1), call("add", n="x"), call("add", n=2), "Done.<|im_end|>"
    # Synchronous: one loop, both rollouts stepped together.
    b = ScriptBackend(tiny_tokenizer, [[bad, good2], [good2, final], [final]])
    *_, sync = run_loop(b, [good1, bad], [LedgerEnv(), LedgerEnv()], config, group_ids=[7, 7])
    (kept,) = [e for e in sync.extra_rows if e.kind == RowKind.NEGATIVE]
    assert kept.parent == 1 and kept.iteration == 0

    # Asynchronous: one loop per trajectory; rollout 0 finished first, so its rows come first.
    group = []
    for first, script, rollout_id in (
        (good1, [[bad], [good2], [final]], "b7"),
        (bad, [[good2], [final]], "a3"),
    ):
        b = ScriptBackend(tiny_tokenizer, script)
        _, prompt_ids, (tool_mask, _, completion_ids, logprobs, *_), result = run_loop(
            b, [first], [LedgerEnv()], config, group_ids=[7]
        )
        group.append(
            sequences_from_loop(
                prompt_ids[0], completion_ids[0], tool_mask[0], logprobs[0], result.extra_rows, rollout_id
            )
        )
    assert [r.iteration for r in group[0][1:]] == [1] and [r.iteration for r in group[1][1:]] == [0]
    rows = [r for conv in group for r in conv]
    conversation = [c for c, conv in enumerate(group) for _ in conv]
    scored, _ = score_group_rows(rows, conversation, [1.0] * len(rows), 2, _args(max_negative_samples_per_group=1))
    assert scored.keep == [True, False, True, True]  # rollout 1's negative (its failed first turn) is kept
    in_row_order = group_row_advantages(
        [1.0, 1.0],
        conversation,
        [r.kind for r in rows],
        [r.error_types for r in rows],
        _args(max_negative_samples_per_group=1),
    )
    assert in_row_order.keep == [True, True, True, False]  # what the earlier first-in-row-order rule kept


def test_a_segment_reward_gets_what_the_synchronous_trainer_gives_it():
    """`snapshot_reward_func` is called with the same `segment_info` by both trainers for the same snapshot row: its
    tokens, its segment, the tokens freed, and the dataset row (its prompt included: TRL's asynchronous worker keeps
    the other columns only)."""
    from trl_agentic.async_grpo.worker import AgenticAsyncRolloutLoop
    from trl_agentic.batch import BatchAugmenter

    prompt = [{"role": "user", "content": "q"}]
    calls = []

    def record(info):
        calls.append(info)
        return 0.5

    sync = BatchAugmenter(SimpleNamespace(args=SimpleNamespace(snapshot_reward_func=None)))
    sync.segment_reward = record
    extra = ExtraRow(
        RowKind.SNAPSHOT, 1, prompt_ids=[1, 2], completion_ids=[3, 4, 5], tool_mask=[1, 0, 1], logprobs=None
    )
    extra.segment_index, extra.tokens_freed = 1, 7
    inputs = [{"prompt": [{"role": "user", "content": "other"}], "answer": 2}, {"prompt": prompt, "answer": 3}]
    assert sync._segment_term(extra, inputs) == 0.5
    row = AgenticSequence(
        [1, 2, 3, 4, 5], [0, 0, 1, 0, 1], [0.0] * 5, "r", kind=int(RowKind.SNAPSHOT), segment_index=1, tokens_freed=7
    )
    group = SimpleNamespace(reward_kwargs={"answer": [2, 3]}, prompts=[inputs[0]["prompt"], prompt])
    worker = SimpleNamespace(_segment_reward=record)
    assert AgenticAsyncRolloutLoop._segment_term(worker, row, group, 1) == 0.5
    assert AgenticAsyncRolloutLoop._segment_term(worker, _sequence(0, True), group, 1) == 0.0
    expected, got = calls
    assert {k: list(v) if k != "row" else v for k, v in got.items() if k not in ("segment_index", "tokens_freed")} == {
        k: v for k, v in expected.items() if k not in ("segment_index", "tokens_freed")
    }
    assert (
        (got["segment_index"], got["tokens_freed"]) == (expected["segment_index"], expected["tokens_freed"]) == (1, 7)
    )
