"""`trl_agentic.async_grpo.rows`: a group's rows (regular, negative, snapshot) get the synchronous trainer's rewards
and advantages. The oracle assembles the rewards and the baseline with a plain loop from the rules as documented
(`BatchAugmenter`), then calls the synchronous trainer's own `group_advantages`."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_helpers import call

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
            in_baseline.append(
                kind == RowKind.REGULAR
                or (kind == RowKind.NEGATIVE and baseline == "all_rows")
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
    truncated=st.lists(st.booleans(), min_size=4, max_size=4),
    mask=st.booleans(),
)
def test_pushed_rows_are_the_rows_the_synchronous_trainer_trains(status, extra, regular_tokens, cap, truncated, mask):
    """`score_group_rows` (what the async worker pushes) against the synchronous trainer's own `_untrained_rows`: a
    rollout lost to infrastructure has its regular and snapshot rows untrained and its negative rows trained (their
    own turn, their own penalty); an unscorable one (reward functions gave None) is trained; a negative beyond the cap
    is dropped before either; a row without a trained token is not pushed. With `mask_truncated_completions` TRL
    zeroes a truncated conversation's completion mask in the synchronous batch (its regular row keeps no trained
    token, so it is not pushed) and the synchronous trainer does not train its snapshot rows; its reward stays in
    the statistics."""
    from trl_agentic.batch import BatchAugmenter

    n = len(status)
    extra = [(c % n, kind, tokens) for c, kind, tokens in extra]
    lost = [s == "lost" for s in status]
    layout = [(c, int(RowKind.REGULAR), regular_tokens[c]) for c in range(n)] + extra
    rows = [
        _sequence(kind, tokens, lost=kind == RowKind.REGULAR and lost[c], errors=["ValueError"] * (kind == 1))
        for c, kind, tokens in layout
    ]
    for c in range(n):
        rows[c].truncated = truncated[c]
    value = {"ok": 1.0, "failed": 0.0, "unscorable": math.nan, "lost": 0.0}  # TRL scores a lost one too
    scored, got = score_group_rows(
        rows,
        [c for c, _, _ in layout],
        [value[status[c]] for c, _, _ in layout],
        n,
        _args(max_negative_samples_per_group=cap),
        mask_truncated=mask,
    )

    # The synchronous trainer's rule, on its own layout: the regular rows, then the kept extra rows with their parents.
    kept_extras = [k for k in range(n, len(layout)) if scored.keep[k]]
    trainer = SimpleNamespace(
        args=SimpleNamespace(mask_truncated_completions=mask, snapshot_reward_func=None),
        accelerator=SimpleNamespace(device="cpu"),
    )
    parents = [
        ExtraRow(RowKind(layout[k][1]), layout[k][0], prompt_ids=[], completion_ids=[], tool_mask=[], logprobs=None)
        for k in kept_extras
    ]
    # TRL's completion mask of the regular rows (attention over the completion): zeroed where TRL found it truncated.
    output = {"completion_mask": torch.tensor([[0 if truncated[c] else 1, 0] for c in range(n)])}
    untrained = BatchAugmenter(trainer)._untrained_rows(output, lost, parents).tolist()
    sync_trained = {k for k in range(n) if not untrained[k]} | {
        k for e, k in enumerate(kept_extras) if not untrained[n + e]
    }
    # A row has a trained token unless it had none, or it is a regular row whose mask TRL zeroed.
    has_token = [tokens and not (kind == RowKind.REGULAR and mask and truncated[c]) for c, kind, tokens in layout]
    assert [k for k, _ in got] == [k for k in range(len(layout)) if k in sync_trained and has_token[k]]
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
    from trl_agentic.estimators import grpo_estimator

    rows = [_sequence(0, True), _sequence(0, True), _sequence(0, False), _sequence(0, True, lost=True)]
    rows.append(_sequence(int(RowKind.NEGATIVE), True, errors=["ValueError"]))
    conversation = [0, 1, 2, 3, 3]
    args = _args()
    scored, trained = score_group_rows(rows, conversation, [1.0, 0.0, 0.0, 0.0, 0.0], 4, args)
    assert trained == [(0, 0), (1, 1), (4, 4)]
    seen = []
    stage, trainer, inner = _stage(args, seen, grpo_estimator)
    _push_group(inner, rows, conversation, scored, trained, group_id=5)
    # The stage passes a group's rows on in a random order (tests/test_async_row_order.py): read them by episode.
    out = sorted((stage.get(timeout=1) for _ in range(3)), key=lambda s: (s.episode, s.row_kind))
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


@pytest.mark.parametrize(
    "returned, message",
    [
        ("parent -1", r"parent must be a local row index in \[0, 3\), got parent -1"),
        ("two rows", r"returned \(2,\); it must return \(3,\) or \(3, T\)"),
        ("wide", r"token-level advantages must have width 2"),
    ],
)
def test_a_trainer_side_estimators_bad_result_is_refused_as_in_the_synchronous_trainer(returned, message):
    """What the estimator returns is checked as `batch.check_estimate` checks it in the synchronous trainer: an added
    row whose parent is -1 would otherwise be another row's child (Python's negative index), a result of the wrong
    length or width silently cut."""
    from trl_agentic.async_grpo.stage import estimate_group
    from trl_agentic.estimators import EstimatorResult

    rows = [_sequence(0, True), _sequence(0, True), _sequence(0, True)]
    conversation = [0, 1, 2]
    args = _args()
    scored, trained = score_group_rows(rows, conversation, [1.0, 0.0, 0.0], 3, args)
    inner_rows = []
    stage, trainer, inner = _stage(args, [], lambda batch, t: None)
    _push_group(inner, rows, conversation, scored, trained, group_id=1)
    while not inner.empty():
        inner_rows.append(inner.get())

    def estimator(batch, host):
        if returned == "parent -1":
            extra = ExtraRow(RowKind.EXPANSION, -1, [1], [2], [1], None)
            return EstimatorResult(torch.zeros(3), [extra], torch.zeros(1))
        return torch.zeros(2) if returned == "two rows" else torch.zeros(3, 5)

    with pytest.raises(ValueError, match=message):
        estimate_group(inner_rows, estimator, stage._host)


def _stage(args, seen: list, estimator):
    """The trainer-side estimator stage on a queue of its own, with a trainer holding what the stage reads."""
    import queue
    from collections import defaultdict

    from trl_agentic.async_grpo.stage import AgenticRolloutQueue

    def recording(batch, trainer):
        seen.append(batch)
        return estimator(batch, trainer)

    trainer = SimpleNamespace(
        args=SimpleNamespace(**vars(args), temperature=1.0, chat_template_kwargs=None, max_staleness=4),
        processing_class=None,
        _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m),
        model=torch.nn.Linear(1, 1).eval(),  # eval mode, as a full model before the first training step
        model_version=0,
        _observed_rows=[],
        _trained_groups=set(),  # TRL's set of groups trained (or consumed)
    )
    inner = queue.Queue()
    return AgenticRolloutQueue(trainer, inner, estimator=recording), trainer, inner


def _push_group(inner, rows, conversation, scored, trained, group_id: int) -> None:
    """What the worker pushes for a scored group when an estimator runs on the trainer side (`pushed_rows`)."""
    import numpy as np

    from trl_agentic.async_grpo.worker import AgenticRolloutSample

    pushed = pushed_rows(scored.keep, trained, untrained=True)
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
                group_id=group_id,
                metrics={},
                row_kind=int(row.kind),
                reward=float(scored.rewards[j]),
                episode=conversation[k],
                group_rows=len(pushed),
                trained=is_trained,
            )
        )


def test_a_group_with_no_trained_row_reaches_the_estimator_and_nothing_of_it_is_trained():
    """Two groups one after the other through the estimator stage: the first has no trained row (both rollouts lost
    to infrastructure), the second has fractional rewards. The estimator runs on both, as the synchronous trainer's
    runs on its whole batch; nothing of the first is passed on (and `get` does not stop at it), the second's rows
    come out with the advantages of the synchronous rule over 0.3, 0.7, 0.55 (checked by hand)."""
    from trl_agentic.estimators import grpo_estimator

    args, seen = _args(), []
    stage, trainer, inner = _stage(args, seen, grpo_estimator)
    lost = [_sequence(0, True, lost=True), _sequence(0, True, lost=True)]
    scored, trained = score_group_rows(lost, [0, 1], [0.0, 0.0], 2, args)
    assert trained == []
    _push_group(inner, lost, [0, 1], scored, trained, group_id=1)
    rows = [_sequence(0, True), _sequence(0, True), _sequence(0, True)]
    scored, trained = score_group_rows(rows, [0, 1, 2], [0.3, 0.7, 0.55], 3, args)
    _push_group(inner, rows, [0, 1, 2], scored, trained, group_id=2)
    # The stage passes a group's rows on in a random order (tests/test_async_row_order.py): read them by episode.
    out = sorted((stage.get(timeout=1) for _ in range(3)), key=lambda s: (s.episode, s.row_kind))
    assert inner.empty() and stage.qsize() == 0
    assert [s.group_id for s in out] == [2, 2, 2] and [s.group_rows for s in out] == [3, 3, 3]
    first, second = seen
    assert first.loss_mask.sum().item() == 0 and torch.isnan(first.rewards).all()
    values = torch.tensor([0.3, 0.7, 0.55])
    expected = (values - values.mean()) / (values.std() + 1e-4)
    torch.testing.assert_close(torch.tensor([s.advantage for s in out]), expected, atol=1e-5, rtol=0)
    assert second.loss_mask.sum(dim=1).tolist() == [1, 1, 1]
    assert trainer._trained_groups == {1}  # consumed (TRL's collator adds group 2 when it packs its rows)


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


def _scoring_worker(agentic: dict | None, mask_truncated: bool, rewards: list[float]):
    """An `AgenticAsyncRolloutLoop` with only what TRL's `_score_group` and ours read (no server, no child process):
    one reward function returning `rewards`, TRL's own scoring code, then ours."""
    from collections import defaultdict

    from accelerate import PartialState

    from trl_agentic.async_grpo.worker import AgenticAsyncRolloutLoop

    PartialState()  # TRL's scoring logs through accelerate's logger
    worker = object.__new__(AgenticAsyncRolloutLoop)
    worker.reward_funcs = [lambda completions, **kw: list(rewards)]
    worker.reward_func_names = ["fixed"]
    worker._env_reward_types, worker._provides_rollout_reward = [], False
    worker._agentic, worker._mask_truncated = agentic, mask_truncated
    worker.eos_token_ids, worker.tokenizer = [9], SimpleNamespace(pad_token_id=0)
    worker._counters = defaultdict(float)
    if agentic is not None:
        worker._adv_args, worker._segment_reward = _args(**agentic["advantage"]), None
        worker._stop_event = SimpleNamespace(is_set=lambda: False)
    return worker


def _group(sequences: list[list], completions_ids: list[list[int]]):
    from trl_agentic.async_grpo.compat import worker_module

    n = len(sequences)
    return worker_module().RolloutGroup(
        prompts=[[{"role": "user", "content": "q"}]] * n,
        reward_kwargs={},
        completions=[[{"role": "assistant", "content": "a"}]] * n,
        completions_ids=completions_ids,
        completions_sequences=sequences,
        tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n,
        model_version=0,
        group_id=3,
        env_rewards=[None] * n,
        rollout_rewards=[None] * n,
    )


@pytest.mark.parametrize("mask", [True, False])
def test_mask_truncated_completions_with_every_feature_off_drops_the_truncated_conversations_rows(mask):
    """Every feature off: TRL's own rows and advantages; with `mask_truncated_completions` a conversation whose
    completion ends with neither EOS (9) nor pad (0) is not trained (`GRPOTrainer` masks it): none of the rows TRL
    made of it (here two: a TRL fork) is pushed, and its reward stays in TRL's statistics (the others' advantages do
    not change)."""
    import asyncio

    from trl_agentic.async_grpo.compat import worker_module

    seq = worker_module().TrainingSequence
    rows = [
        [seq([1, 2, 9], [0, 1, 1], [0.0] * 3, "a")],
        [seq([1, 3], [0, 1], [0.0] * 2, "b"), seq([1, 3, 4, 5], [0, 0, 0, 1], [0.0] * 4, "b")],
        [seq([1, 6, 0], [0, 1, 1], [0.0] * 3, "c")],
    ]
    rewards = [1.0, 0.0, 0.5]
    samples = asyncio.run(_scoring_worker(None, mask, rewards)._score_group(_group(rows, [[2, 9], [3, 5], [6, 0]])))
    values = torch.tensor(rewards, dtype=torch.float64)
    expected = ((values - values.mean()) / (values.std(unbiased=False) + 1e-8)).tolist()  # TRL's rule, all three
    conversations = [0, 2] if mask else [0, 1, 1, 2]
    assert [int(s.input_ids[1]) for s in samples] == [[2, 3, 6][c] for c in conversations]  # whose rows they are
    assert [s.metrics["reward"] for s in samples] == [rewards[c] for c in conversations]
    assert [s.advantage for s in samples] == pytest.approx([expected[c] for c in conversations])
    assert all(s.completion_mask.any() for s in samples)


@pytest.mark.parametrize("mask", [True, False])
def test_mask_truncated_completions_with_features_on_trains_as_the_synchronous_trainer(mask):
    """With a feature on: conversation 1 was cut by the budget after a `delete_context` (a snapshot row) and a
    rollback (a negative row). With the flag its regular and snapshot rows are not trained (not pushed) while its
    reward (0) stays in the group statistics; its negative row keeps its loss and its penalty; conversation 0 is
    untouched. Advantages by hand: mean and unbiased std over 1, 0, -1 (`group_baseline="all_rows"`), the same with
    and without the flag."""
    import asyncio

    rows = [
        AgenticSequence([1, 2, 9], [0, 1, 1], [0.0] * 3, "a"),
        AgenticSequence([1, 3, 4], [0, 1, 1], [0.0] * 3, "b", truncated=True),
        AgenticSequence([1, 5], [0, 1], [0.0] * 2, "b", kind=int(RowKind.SNAPSHOT)),
        AgenticSequence([1, 6], [0, 1], [0.0] * 2, "b", kind=int(RowKind.NEGATIVE), error_types=["ValueError"]),
    ]
    advantage = {"group_baseline": "all_rows", "max_negative_samples_per_group": 2}
    worker = _scoring_worker({"advantage": advantage}, mask, [1.0, 0.0])
    samples = asyncio.run(worker._score_group(_group([rows[:1], rows[1:]], [[2, 9], [3, 4]])))
    values = torch.tensor([1.0, 0.0, -1.0])
    expected = ((values - values.mean()) / (values.std() + 1e-4)).tolist()
    pushed = [0, 3] if mask else [0, 1, 2, 3]  # input rows
    assert [s.row_kind for s in samples] == [int(rows[k].kind) for k in pushed]
    assert [s.completion_mask.tolist() for s in samples] == [rows[k].completion_mask for k in pushed]
    advantage_of = [expected[0], expected[1], expected[1], min(expected[2], 0.0)]  # the snapshot: its episode's
    assert [s.advantage for s in samples] == pytest.approx([advantage_of[k] for k in pushed], abs=1e-5)
    assert [s.reward for s in samples] == [[1.0, 0.0, 0.0, -1.0][k] for k in pushed]
    assert {s.baseline_rows for s in samples} == {4} and {s.group_rows for s in samples} == {len(pushed)}


def test_is_truncated_is_trls_rule():
    """The test `GRPOTrainer.mask_truncated_completions` applies: the last token is neither an EOS nor the pad."""
    from trl_agentic.async_grpo.rows import is_truncated

    stops = {9, 0}
    assert [is_truncated(ids, stops) for ids in ([1, 9], [1, 0], [9, 1], [1], [])] == [False, False, True, True, False]


def _trajectory_worker(tokenizer, turns: list[str], max_tokens: int, **loop):
    """An `AgenticAsyncRolloutLoop` whose vLLM server is a script (`turns`, one per request, cut at the request's
    `max_tokens` as vLLM cuts), with an event loop in a thread of its own, as TRL's worker runs it. TRL's own
    `_generate_one_turn` builds each request; `_run_trajectory` runs unchanged. Returns `(worker, event loop, the
    requests' payloads)`."""
    import asyncio
    import threading
    from collections import defaultdict

    from trl.chat_template_utils import add_response_schema

    from trl_agentic.async_grpo.worker import AgenticAsyncRolloutLoop
    from trl_agentic.config import DEFAULT_INFRA_ERROR_TYPES, DEFAULT_ROLLBACK_ON_ERRORS
    from trl_agentic.rollout.loop import LoopConfig
    from trl_agentic.rollout.rendering import ChatRenderer

    tokenizer = add_response_schema(copy.deepcopy(tokenizer))  # as TRL's worker prepares its tokenizer
    worker = object.__new__(AgenticAsyncRolloutLoop)
    worker.tokenizer, worker.max_tokens, worker.max_tool_calling_iterations = tokenizer, max_tokens, 4
    worker.eos_token_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    worker._agentic, worker._model_version_value = {"max_model_len": 100_000}, SimpleNamespace(value=1)
    worker.lora_name, worker.model_name, worker.request_timeout, worker.min_p = None, "policy", 10, None
    worker.temperature, worker.top_p, worker.top_k, worker.repetition_penalty = 1.0, 1.0, -1, 1.0
    worker._counters = defaultdict(float)
    worker._stop_event = threading.Event()
    worker._renderer = ChatRenderer(tokenizer)
    config = dict(
        rollback_on_errors=list(DEFAULT_ROLLBACK_ON_ERRORS), infra_error_types=list(DEFAULT_INFRA_ERROR_TYPES)
    )
    worker._loop_config = LoopConfig(**{**config, **loop})
    script, payloads = list(turns), []

    async def post(path, payload, timeout):
        payloads.append(payload)
        ids = tokenizer.encode(script.pop(0), add_special_tokens=False)[: payload["max_tokens"]]
        return {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.1] * len(ids)}}]}

    worker._post = post
    event_loop = asyncio.new_event_loop()
    threading.Thread(target=event_loop.run_forever, daemon=True).start()
    return worker, event_loop, payloads


def _run_one(worker, event_loop, tools: dict):
    """`_run_trajectory` for one prompt: `(rows, completion messages, counters)`."""
    try:
        (completion, _, rows, *_), stats = worker._run_trajectory(
            [{"role": "user", "content": "add 1"}], tools, list(tools.values()), 0, event_loop, 0
        )
    finally:
        event_loop.call_soon_threadsafe(event_loop.stop)
    return rows, completion, stats


@pytest.mark.parametrize(
    ("turns", "truncated"),
    [
        (["The answer is 3.<|im_end|>"], False),
        (["The answer is"], True),  # the first turn used the budget up
        ([call("add", n=1), "Done.<|im_end|>"], False),
        ([call("add", n=1), "Still thinking about"], True),  # cut at its second turn
    ],
)
def test_a_trajectory_records_whether_the_budget_cut_it(tiny_tokenizer, turns, truncated):
    """`_run_trajectory` (the worker's path, scripted vLLM turns) marks the regular row `truncated` by TRL's rule on
    the trajectory's completion (model and tool tokens, as the synchronous trainer's row): what
    `mask_truncated_completions` reads."""
    from rollout_helpers import LedgerEnv

    worker, event_loop, _ = _trajectory_worker(tiny_tokenizer, turns, max_tokens=4096)
    env = LedgerEnv()
    rows, _, _ = _run_one(worker, event_loop, {"add": env.add})
    assert rows[0].kind == RowKind.REGULAR and rows[0].truncated is truncated
    assert env.total == (1 if len(turns) == 2 else 0)


def _prompt_length(row) -> int:
    return next(k for k, m in enumerate(row.completion_mask) if m)


@pytest.mark.parametrize("cap", [None, 60])
def test_each_vllm_request_asks_for_what_the_trajectory_can_keep(tiny_tokenizer, cap):
    """A request for a later turn asks vLLM for what is left of the trajectory's budget (and at most
    `max_turn_tokens`), not for the whole `max_completion_length` as TRL's worker does: tokens past it would be cut
    anyway (the synchronous rule). Without a cap the first request is TRL's own (`max_completion_length`)."""
    from rollout_helpers import LedgerEnv

    turns = [call("add", n=1), "Done.<|im_end|>"]
    worker, event_loop, payloads = _trajectory_worker(tiny_tokenizer, turns, max_tokens=300, max_turn_tokens=cap)
    env = LedgerEnv()
    rows, _, stats = _run_one(worker, event_loop, {"add": env.add})
    second = len(tiny_tokenizer.encode(turns[1], add_special_tokens=False))
    used = len(rows[0].input_ids) - _prompt_length(rows[0]) - second  # first turn and the tool result
    limit = cap if cap is not None else 10**9
    assert [p["max_tokens"] for p in payloads] == [min(300, limit), min(300 - used, limit)]
    assert 0 < used < 300 - 60 and env.total == 1 and not rows[0].truncated
    assert stats["tools/turn_cap_truncations_total"] == 0


def test_a_turn_longer_than_max_turn_tokens_is_cut_by_the_request(tiny_tokenizer):
    """`max_turn_tokens` in the asynchronous worker: vLLM is asked for 8 tokens, the turn is cut there (counted as a
    cut by the per-turn cap, as in the synchronous trainer) and the conversation ends, truncated."""
    worker, event_loop, payloads = _trajectory_worker(
        tiny_tokenizer, ["The answer is three, I am sure.<|im_end|>"], max_tokens=300, max_turn_tokens=8
    )
    rows, _, stats = _run_one(worker, event_loop, {})
    assert [p["max_tokens"] for p in payloads] == [8]
    assert len(rows[0].input_ids) - _prompt_length(rows[0]) == 8 and rows[0].truncated
    assert stats["tools/turn_cap_truncations_total"] == 1 and stats["tools/truncated_turns_total"] == 1


class _EchoEnv:
    def reset(self, **kwargs):
        pass

    def echo(self, n: int) -> str:
        """
        Repeat a letter.

        Args:
            n: How many times.
        """
        return "x" * n


@pytest.mark.parametrize("on", [True, False])
def test_malformed_call_feedback_and_long_tool_outputs_in_the_worker(tiny_tokenizer, on):
    """`malformed_tool_call_feedback` and `max_tool_output_chars` reach the loop in the asynchronous worker: a
    malformed call is answered with the parser's error (without the feedback the conversation ends there, as in
    TRL), a 500-character tool output is cut to 64 characters, its marker included; both are counted."""
    bad = "<tool_call>{not json</tool_call><|im_end|>"
    turns = [bad, call("echo", n=500), "Done.<|im_end|>"] if on else [bad]
    loop = {"malformed_tool_call_feedback": True, "max_tool_output_chars": 64} if on else {}
    worker, event_loop, payloads = _trajectory_worker(tiny_tokenizer, turns, max_tokens=2000, **loop)
    env = _EchoEnv()
    _, completion, stats = _run_one(worker, event_loop, {"echo": env.echo})
    tool_messages = [m["content"] for m in completion if m["role"] == "tool"]
    if on:
        assert len(payloads) == 3 and len(tool_messages) == 2
        assert tool_messages[0].startswith("{'error': 'invalid JSON in <tool_call> block")
        kept, cut = tool_messages[1].split("\n...[truncated ")
        assert len(tool_messages[1]) == 64 and kept == "x" * len(kept) and cut == f"{500 - len(kept)} chars]"
        assert stats["tools/malformed_calls_total"] == 1 and stats["tools/truncated_outputs_total"] == 1
    else:
        assert len(payloads) == 1 and tool_messages == []
        assert stats["tools/malformed_calls_total"] == 0 and stats["tools/truncated_outputs_total"] == 0


def test_a_trajectory_whose_tool_result_fills_the_budget_is_truncated_as_in_the_synchronous_trainer(tiny_tokenizer):
    """The budget is exactly the first turn plus its tool result: the next turn has no room and the trajectory ends on
    an environment token. Both trainers test the row's whole completion, so it is truncated (what TRL's `GRPOTrainer`
    sees in the synchronous batch: a completion that does not end with EOS)."""
    from rollout_helpers import LedgerEnv

    turns = [call("add", n=1), "Done.<|im_end|>"]
    worker, event_loop, _ = _trajectory_worker(tiny_tokenizer, turns, max_tokens=300)
    rows, _, _ = _run_one(worker, event_loop, {"add": LedgerEnv().add})
    second = len(tiny_tokenizer.encode(turns[1], add_special_tokens=False))
    used = len(rows[0].input_ids) - _prompt_length(rows[0]) - second
    worker, event_loop, payloads = _trajectory_worker(tiny_tokenizer, turns, max_tokens=used)
    env = LedgerEnv()
    rows, _, stats = _run_one(worker, event_loop, {"add": env.add})
    assert env.total == 1 and len(rows[0].input_ids) - _prompt_length(rows[0]) == used
    assert rows[0].completion_mask[-1] == 0 and rows[0].truncated  # ends on the tool result's tokens
    assert [p["max_tokens"] for p in payloads] == [used]  # no request for a turn that could keep no token


def test_the_agentic_loop_replaces_trls_own_loop_only():
    """The worker's class is replaced only where it is TRL's own `_AsyncRolloutLoop` (or already ours): a worker that
    runs a loop of its own (TRL's OpenEnv harness) gets a clear error naming it, not a child that fails to start."""
    from trl_agentic.async_grpo.compat import worker_module
    from trl_agentic.async_grpo.trainer import _use_agentic_loop
    from trl_agentic.async_grpo.worker import AgenticAsyncRolloutLoop

    worker = SimpleNamespace(_loop_cls=worker_module()._AsyncRolloutLoop)
    _use_agentic_loop(worker, "x")
    assert worker._loop_cls is AgenticAsyncRolloutLoop
    _use_agentic_loop(worker, "x")
    assert worker._loop_cls is AgenticAsyncRolloutLoop

    class HarnessLoop(worker_module()._AsyncRolloutLoop):
        pass

    other = SimpleNamespace(_loop_cls=HarnessLoop)
    with pytest.raises(ValueError, match="HarnessLoop"):
        _use_agentic_loop(other, "`mask_truncated_completions`")
    assert other._loop_cls is HarnessLoop


def test_a_snapshot_segment_gets_the_split_the_synchronous_trainer_gives_its_reward_function():
    """A segment whose completion begins with environment tokens (a rollback hint before its first turn): the worker
    split it at its first trained token, so `snapshot_reward_func` saw the hint in the prompt, where the synchronous
    trainer (`BatchAugmenter._segment_term`) passes the segment's own prompt and completion."""
    from trl_agentic.async_grpo.rows import segment_info, sequences_from_loop
    from trl_agentic.rollout.types import ExtraRow, RowKind

    hint, turn = [7, 8], [20, 21, 22]
    snapshot = ExtraRow(
        kind=RowKind.SNAPSHOT, parent=0, prompt_ids=[101, 102, 103], completion_ids=hint + turn,
        tool_mask=[0, 0, 1, 1, 1], logprobs=[0.0, 0.0, -0.1, -0.2, -0.3], segment_index=0, tokens_freed=5,
    )  # fmt: skip
    rows = sequences_from_loop([201, 202], [30, 31], [1, 1], [-0.1, -0.1], [snapshot], "r", last_segment=1)
    info = segment_info(rows[1], {"x": 1})
    assert info["prompt_ids"] == snapshot.prompt_ids  # what the synchronous trainer passes
    assert info["completion_ids"] == snapshot.completion_ids and info["tool_mask"] == snapshot.tool_mask
    assert (info["segment_index"], info["tokens_freed"], info["row"]) == (0, 5, {"x": 1})
    regular = segment_info(rows[0], {})
    assert regular["prompt_ids"] == [201, 202] and regular["completion_ids"] == [30, 31]
