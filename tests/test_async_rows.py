"""`trl_agentic.async_grpo.rows`: a group's rows (regular, negative, snapshot) get the synchronous trainer's rewards
and advantages. The oracle assembles the rewards and the baseline with a plain loop from the rules as documented
(`BatchAugmenter`), then calls the synchronous trainer's own `group_advantages`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_agentic.advantages import group_advantages
from trl_agentic.async_grpo.rows import group_row_advantages, row_from_tokens, sequences_from_loop
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
)
def test_group_rows_follow_the_synchronous_rules(
    rewards, extra, baseline, snapshot_advantage, cap, scale, floor, order
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
    got = group_row_advantages(rewards, conversation, kinds, errors, args)

    # Plain loop: the rules as documented.
    keep, row_rewards, in_baseline, row_kinds, row_conv, negatives = [], [], [], [], [], 0
    for conv, kind, types in zip(conversation, kinds, errors):
        if kind == RowKind.NEGATIVE:
            ok = negatives < cap
            negatives += ok
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
