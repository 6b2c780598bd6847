"""Tests for `trl_agentic.advantages`: variable-size GRPO advantages and negative-sample rewards."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.utils import nanstd

from trl_agentic.advantages import group_advantages, negative_sample_rewards, without_reward_spread

NAN = float("nan")


def reference_advantages(rewards, group_ids, scale, baseline_mask=None, anchors=None, std_floor=0.1):
    """Plain per-group Python loop, written independently of the vectorised implementation."""
    n = len(rewards)
    in_stats = [not math.isnan(rewards[i]) and (baseline_mask is None or bool(baseline_mask[i])) for i in range(n)]
    batch_values = [rewards[i] for i in range(n) if in_stats[i]]
    batch_std = statistics.stdev(batch_values) if len(batch_values) >= 2 else None
    members = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    out = [0.0] * n
    for rows in members.values():
        values = [rewards[i] for i in rows if in_stats[i]]
        if len(values) < 2:
            continue
        mean = statistics.fmean(values)
        divisor = {"group": statistics.stdev(values) + 1e-4, "batch": (batch_std or 0.0) + 1e-4, "none": 1.0}[scale]
        for i in rows:
            if in_stats[i]:
                out[i] = (rewards[i] - mean) / divisor
        m = len(values)
        bound = max([(m - 1) / math.sqrt(m)] + [abs(out[i]) for i in rows if in_stats[i]])
        for i in rows:
            if in_stats[i] or math.isnan(rewards[i]):
                continue
            if scale == "none":
                out[i] = rewards[i] - mean
                continue
            # Rows outside the baseline: from their anchor (a baseline row of the group) or the mean, floored divisor.
            a = anchors[i] if anchors is not None else -1
            if 0 <= a < n and in_stats[a] and a in rows:
                base_reward, base_advantage = rewards[a], out[a]
            else:
                base_reward, base_advantage = mean, 0.0
            value = base_advantage + (rewards[i] - base_reward) / max(divisor, std_floor)
            out[i] = max(-bound, min(bound, value))
    return out


def trl_fixed_size_advantages(rewards, num_generations, scale):
    """TRL 1.16 GRPOTrainer's `sum_then_normalize` branch, copied for a reward vector in which NaN marks unscorable."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale == "batch":
        if rewards.numel() > 1:
            std_rewards = nanstd(rewards).expand_as(rewards)
        else:
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


SEED_EPISODES = [1.0, 0.8, 0.9, 1.0, 0.7, 0.9, 0.8, 1.0]
SEED_NEGATIVE = -0.5


def _hand_mean_std(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, std


def test_seed_example_all_rows_baseline():
    rewards = torch.tensor(SEED_EPISODES + [SEED_NEGATIVE], dtype=torch.float64)
    adv = group_advantages(rewards, torch.zeros(9, dtype=torch.long))

    # Hand computation: mean = 6.6 / 9, unbiased std over the nine rows.
    mean, std = _hand_mean_std(SEED_EPISODES + [SEED_NEGATIVE])
    assert mean == pytest.approx(6.6 / 9)
    expected_negative = (SEED_NEGATIVE - mean) / (std + 1e-4)
    assert abs(adv[-1].item() - (-2.63)) < 0.05
    assert adv[-1].item() == pytest.approx(expected_negative, rel=1e-12)
    assert adv[-1].item() == pytest.approx(-2.5995469, abs=1e-6)
    expected_episodes = [(r - mean) / (std + 1e-4) for r in SEED_EPISODES]
    assert adv[:-1].tolist() == pytest.approx(expected_episodes, rel=1e-12)


def test_seed_example_episode_baseline():
    rewards = torch.tensor(SEED_EPISODES + [SEED_NEGATIVE], dtype=torch.float64)
    mask = torch.tensor([True] * 8 + [False])
    adv = group_advantages(rewards, torch.zeros(9, dtype=torch.long), baseline_mask=mask)

    mean8, std8 = _hand_mean_std(SEED_EPISODES)
    assert mean8 == pytest.approx(0.8875)
    # Unclipped, the negative would get (-0.5 - 0.8875) / 0.113 = -12.3, far beyond any episode: it is clipped to
    # the largest magnitude a standardised episode of 8 can reach, 7 / sqrt(8).
    assert (SEED_NEGATIVE - mean8) / (std8 + 1e-4) < -12.0
    assert adv[-1].item() == pytest.approx(-7 / math.sqrt(8), rel=1e-12)
    # The excluded negative does not shift the episodes' baseline.
    assert adv[:-1].tolist() == pytest.approx([(r - mean8) / (std8 + 1e-4) for r in SEED_EPISODES], rel=1e-12)


def test_outside_row_of_a_baseline_without_spread_is_bounded():
    """The review's case: four successes in the baseline, one negative outside it. Was (-0.5 - 1) / 1e-4 = -15000."""
    adv = group_advantages(
        torch.tensor([1, 1, 1, 1, -0.5]),
        torch.zeros(5, dtype=torch.long),
        baseline_mask=torch.tensor([1, 1, 1, 1, 0]).bool(),
    )
    assert adv.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, -3 / 2], abs=1e-6)  # -(m - 1) / sqrt(m), m = 4


def test_outside_row_equal_to_a_baseline_row_gets_its_advantage_exactly():
    """A snapshot segment scored with its episode's reward ('episode' mode) gets its episode's advantage, bit for bit."""
    for scale in ("group", "batch"):
        rewards = torch.tensor([0.0, 1.0, 1.0, 0.3, 0.0, 0.3, 7.0, 7.5])
        mask = torch.tensor([True, True, True, True, False, False, True, True])
        ids = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
        adv = group_advantages(rewards, ids, scale=scale, baseline_mask=mask)
        assert adv[4].item() == adv[0].item() and adv[5].item() == adv[3].item()


_reward_values = st.one_of(
    st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, allow_infinity=False),
    # Repeated values give zero-std groups; NaN gives unscorable rows.
    st.sampled_from([0.0, 1.0, -0.5, NAN]),
)


@st.composite
def _batches(draw):
    n = draw(st.integers(min_value=0, max_value=60))
    rewards = draw(st.lists(_reward_values, min_size=n, max_size=n))
    id_pool = draw(st.lists(st.integers(min_value=-(2**40), max_value=2**40), min_size=1, max_size=6, unique=True))
    group_ids = draw(st.lists(st.sampled_from(id_pool), min_size=n, max_size=n))
    mask = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    scale = draw(st.sampled_from(["group", "batch", "none"]))
    anchors = draw(st.one_of(st.none(), st.lists(st.integers(min_value=-1, max_value=n), min_size=n, max_size=n)))
    floor = draw(st.sampled_from([0.1, 0.5, 1e-3]))
    return rewards, group_ids, mask, scale, anchors, floor


@settings(max_examples=300, deadline=None)
@given(_batches())
def test_matches_python_loop(batch):
    rewards, group_ids, mask, scale, anchors, floor = batch
    rewards_t = torch.tensor(rewards, dtype=torch.float64)
    ids_t = torch.tensor(group_ids, dtype=torch.long)
    mask_t = None if mask is None else torch.tensor(mask, dtype=torch.bool)
    anchors_t = None if anchors is None else torch.tensor(anchors, dtype=torch.long)
    rewards_before, ids_before = rewards_t.clone(), ids_t.clone()

    adv = group_advantages(rewards_t, ids_t, scale=scale, baseline_mask=mask_t, anchors=anchors_t, std_floor=floor)

    expected = torch.tensor(reference_advantages(rewards, group_ids, scale, mask, anchors, floor), dtype=torch.float64)
    assert adv.shape == (len(rewards),)
    assert adv.dtype == torch.float64
    assert not torch.isnan(adv).any()
    torch.testing.assert_close(adv, expected, rtol=1e-9, atol=1e-9)
    # Inputs untouched (NaN-aware comparison).
    torch.testing.assert_close(rewards_t, rewards_before, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(ids_t, ids_before)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("num_generations", [1, 2, 4, 8])
def test_matches_trl_fixed_size_groups(scale, num_generations):
    gen = torch.Generator().manual_seed(1234 + num_generations)
    num_groups = 16
    rewards = torch.rand(num_groups * num_generations, generator=gen, dtype=torch.float32) * 3 - 1
    # A zero-std group exercises the epsilon path.
    rewards[:num_generations] = 0.25
    group_ids = torch.arange(num_groups).repeat_interleave(num_generations)

    adv = group_advantages(rewards, group_ids, scale=scale)
    expected = trl_fixed_size_advantages(rewards, num_generations, scale)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)
    if num_generations > 1:
        assert adv.abs().max() > 0.1  # not trivially all zeros


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("num_generations", [2, 3, 4, 5, 6, 7, 8, 9, 16])
def test_bit_identical_to_trl_for_every_group_size(scale, num_generations):
    """TRL's layout (contiguous groups of G) gives TRL's advantages bit for bit, whatever G (issue 36: with
    `index_add` sums, G = 5, 6, 7, 9-16 differed by up to 7e-7, `scale="none"` too). Non-integer rewards, so that the
    summation order matters; a tenth of them unscorable."""
    gen = torch.Generator().manual_seed(99 + num_generations)
    rewards = torch.rand(32 * num_generations, generator=gen, dtype=torch.float32) * 2 - 0.5
    rewards[torch.rand(rewards.shape, generator=gen) < 0.1] = NAN
    group_ids = torch.arange(32).repeat_interleave(num_generations)
    adv = group_advantages(rewards, group_ids, scale=scale)
    assert torch.equal(adv, trl_fixed_size_advantages(rewards, num_generations, scale))
    assert adv.abs().max() > 0.1


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_trl_fixed_size_groups_with_nan(scale):
    gen = torch.Generator().manual_seed(7)
    num_groups, num_generations = 12, 4
    rewards = torch.randn(num_groups * num_generations, generator=gen, dtype=torch.float32)
    rewards[torch.rand(rewards.shape, generator=gen) < 0.25] = NAN
    rewards[0:4] = NAN  # an all-NaN group
    rewards[4:8] = torch.tensor([NAN, 0.3, NAN, NAN])  # a single scorable row
    rewards[8:12] = torch.tensor([NAN, 0.3, -1.2, 0.7])  # a partial group
    group_ids = torch.arange(num_groups).repeat_interleave(num_generations)

    adv = group_advantages(rewards, group_ids, scale=scale)
    expected = trl_fixed_size_advantages(rewards, num_generations, scale)
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)
    assert torch.all(adv[0:8] == 0)
    assert adv[8] == 0 and adv[9:12].ne(0).all()


def test_single_row_group_is_zero():
    rewards = torch.tensor([5.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    adv = group_advantages(rewards, torch.tensor([9, 1, 1, 1]))
    assert adv[0].item() == 0.0
    mean, std = _hand_mean_std([1.0, 2.0, 3.0])
    assert adv[1:].tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in [1.0, 2.0, 3.0]], rel=1e-12)


def test_all_nan_group_is_zero():
    rewards = torch.tensor([NAN, NAN, 0.0, 1.0])
    adv = group_advantages(rewards, torch.tensor([0, 0, 1, 1]), scale="none")
    assert adv.tolist() == [0.0, 0.0, -0.5, 0.5]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_whose_only_baseline_row_is_nan(scale):
    rewards = torch.tensor([NAN, 0.4, -0.6, 1.0, 3.0])
    mask = torch.tensor([True, False, False, True, True])
    adv = group_advantages(rewards, torch.tensor([2, 2, 2, 5, 5]), scale=scale, baseline_mask=mask)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3].item() < 0 < adv[4].item()


def test_single_baseline_row_zeroes_the_whole_group():
    rewards = torch.tensor([1.0, 0.2, -0.3])
    adv = group_advantages(rewards, torch.zeros(3, dtype=torch.long), baseline_mask=torch.tensor([True, False, False]))
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_batch_scale_uses_batch_std_of_statistics_rows():
    rewards = torch.tensor([1.0, 3.0, 10.0, 20.0, -100.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, True, False])
    adv = group_advantages(rewards, torch.tensor([0, 0, 1, 1, 1]), scale="batch", baseline_mask=mask)
    _, batch_std = _hand_mean_std([1.0, 3.0, 10.0, 20.0])  # -100 is not a statistics row
    expected = [-1.0, 1.0, -5.0, 5.0]
    assert adv[:4].tolist() == pytest.approx([e / (batch_std + 1e-4) for e in expected], rel=1e-12)
    # -115 / std is clipped to (2 - 1) / sqrt(2), larger than the group's largest baseline magnitude 5 / std.
    assert 5.0 / batch_std < 1 / math.sqrt(2)
    assert adv[4].item() == pytest.approx(-1 / math.sqrt(2), rel=1e-12)


_bounded_rewards = st.one_of(
    st.floats(min_value=-1.0, max_value=1.0, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1.0, -1.0, -0.5, 1.0 - 1e-7]),  # repeated values: baselines without spread
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(_bounded_rewards, st.booleans(), st.integers(0, 3)), min_size=0, max_size=40),
    st.sampled_from(["group", "batch", "none"]),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_advantages_are_finite_and_bounded(rows, scale, dtype):
    """For rewards in [-1, 1] and any baseline mask, every advantage is finite and within the documented bound."""
    rewards = torch.tensor([r for r, _, _ in rows], dtype=dtype)
    mask = torch.tensor([b for _, b, _ in rows], dtype=torch.bool)
    ids = torch.tensor([g for _, _, g in rows], dtype=torch.long)
    adv = group_advantages(rewards, ids, scale=scale, baseline_mask=mask)
    assert torch.isfinite(adv).all()
    total = int(mask.sum())  # N: statistics rows of the batch
    for g in set(ids.tolist()):
        m = int((mask & (ids == g)).sum())
        if scale == "group":
            bound = (m - 1) / math.sqrt(m) if m else 0.0
        elif scale == "batch":
            bound = math.sqrt((m - 1) * (total - 1) / m) if m else 0.0
        else:
            bound = 2.0
        assert adv[ids == g].abs().max().item() <= bound * (1 + 1e-5) + 1e-6


def test_permutation_and_relabelling_equivariance():
    gen = torch.Generator().manual_seed(0)
    n = 40
    rewards = torch.randn(n, generator=gen, dtype=torch.float64)
    rewards[::7] = NAN
    dense_ids = torch.randint(0, 5, (n,), generator=gen)
    mask = torch.rand(n, generator=gen) < 0.7
    for scale in ["group", "batch", "none"]:
        base = group_advantages(rewards, dense_ids, scale=scale, baseline_mask=mask)
        perm = torch.randperm(n, generator=gen)
        # An injective, order-scrambling relabelling to negative and very large ids.
        relabel = torch.tensor([10**15, -3, 77, -(10**12), 4])
        shuffled = group_advantages(rewards[perm], relabel[dense_ids][perm], scale=scale, baseline_mask=mask[perm])
        torch.testing.assert_close(shuffled, base[perm], rtol=1e-12, atol=1e-12)
        assert base.abs().sum() > 0


def test_empty_input():
    adv = group_advantages(torch.empty(0, dtype=torch.float32), torch.empty(0, dtype=torch.long))
    assert adv.shape == (0,) and adv.dtype == torch.float32


def test_preserves_dtype_and_does_not_modify_inputs():
    rewards = torch.tensor([0.0, 1.0, NAN, 2.0], dtype=torch.float32)
    ids = torch.tensor([3, 3, 3, 3], dtype=torch.int32)
    mask = torch.tensor([True, True, True, False])
    snapshot = (rewards.clone(), ids.clone(), mask.clone())
    adv = group_advantages(rewards, ids, baseline_mask=mask)
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(
        # The outside row (1.5 / std unclipped) is clipped to (2 - 1) / sqrt(2).
        [-0.5 / (math.sqrt(0.5) + 1e-4), 0.5 / (math.sqrt(0.5) + 1e-4), 0.0, 1 / math.sqrt(2)],
        rel=1e-6,
    )
    assert torch.equal(rewards.isnan(), snapshot[0].isnan())
    assert torch.equal(rewards.nan_to_num(), snapshot[0].nan_to_num())
    assert torch.equal(ids, snapshot[1]) and torch.equal(mask, snapshot[2])


def test_invalid_scale_raises():
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), scale="std")
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), scale=True)


def test_invalid_shapes_and_dtypes_raise():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="baseline_mask"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), baseline_mask=torch.ones(2))
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))


def test_negative_sample_rewards():
    per_error = {"SyntaxError": -0.8, "TimeoutError": -1.0, "KeyError": -0.3}
    result = negative_sample_rewards(
        [["SyntaxError"], ["KeyError", "TimeoutError"], ["NameError"], [], ["NameError", "KeyError"]],
        default=-0.5,
        per_error=per_error,
    )
    assert result == [-0.8, -1.0, -0.5, -0.5, -0.3]
    # A listed penalty milder than the default still wins over the default.
    assert negative_sample_rewards([["KeyError"]], default=-0.5, per_error=per_error) == [-0.3]
    assert negative_sample_rewards([["SyntaxError"], []], default=-0.25) == [-0.25, -0.25]
    assert negative_sample_rewards([], default=-0.5, per_error=per_error) == []
    assert all(isinstance(r, float) for r in negative_sample_rewards([["X"]], default=-1))


# -- rows outside the baseline: continuous in their reward (issue 35, item 1) ------------------------------------------


def test_a_tiny_reward_difference_gives_a_tiny_advantage_in_a_tied_group():
    """Issue 35: a snapshot row 0.001 above its episode moved by +1.5 in a tied group (clipped to (m - 1) / sqrt(m))
    but by +0.0017 in a group with spread. Now 0.001 / max(d, 0.1) in both (hand-computed)."""
    ids = torch.zeros(5, dtype=torch.long)
    mask = torch.tensor([True, True, True, True, False])
    tied_rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.001], dtype=torch.float64)
    # Measured from the group mean (no anchors, as a custom estimator calls it): d = 1e-4 < floor 0.1.
    plain = group_advantages(tied_rewards, ids, baseline_mask=mask)
    assert plain[:4].tolist() == [0.0] * 4
    assert plain[4].item() == pytest.approx(0.001 / 0.1, rel=1e-9)
    # Measured from its episode (the trainer's path): the episode's advantage (0) plus the same difference.
    anchors = torch.tensor([0, 1, 2, 3, 1])
    tied = group_advantages(tied_rewards, ids, baseline_mask=mask, anchors=anchors)
    assert tied[4].item() == pytest.approx(0.01, rel=1e-9)
    # A group with spread (d >= floor): the episode's advantage plus 0.001 / d, i.e. TRL's (r - mean) / d.
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.001], dtype=torch.float64)
    spread = group_advantages(rewards, ids, baseline_mask=mask, anchors=anchors)
    _, std = _hand_mean_std([0.0, 1.0, 1.0, 0.0])
    assert spread[4].item() == pytest.approx(spread[1].item() + 0.001 / (std + 1e-4), rel=1e-9)
    assert spread[4].item() == pytest.approx((1.001 - 0.5) / (std + 1e-4), rel=1e-9)


def test_an_outside_row_with_its_episodes_reward_gets_its_episodes_advantage_in_every_group():
    """A snapshot segment in 'episode' mode (reward = its episode's) gets its episode's advantage exactly, even in a
    group whose spread is below the floor."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.99, 0.99, 1.0], dtype=torch.float32)
    mask = torch.tensor([True, True, True, True, False, False])
    anchors = torch.tensor([0, 1, 2, 3, 3, 0])
    adv = group_advantages(rewards, torch.zeros(6, dtype=torch.long), baseline_mask=mask, anchors=anchors)
    assert adv[4].item() == adv[3].item() and adv[5].item() == adv[0].item()
    assert abs(adv[3].item()) > 1.0  # d = 0.005 + 1e-4: the episodes themselves are far apart


_group_rewards = st.lists(
    st.one_of(st.floats(-1.0, 1.0, allow_nan=False), st.sampled_from([0.0, 1.0, 1.0, 0.5])), min_size=2, max_size=8
)


@settings(max_examples=400, deadline=None)
@given(
    _group_rewards,
    st.floats(-1.0, 1.0, allow_nan=False),
    st.floats(1e-9, 0.5, allow_nan=False),
    st.sampled_from(["group", "batch", "none"]),
    st.sampled_from([0.1, 0.3, 1.0]),
    st.one_of(st.none(), st.integers(0, 7)),
    st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=0, max_size=6),
)
def test_outside_rows_are_lipschitz_in_their_reward(baseline, r, eps, scale, floor, anchor, other_group):
    """For any group (ties included): |A(r + eps) - A(r)| <= K * eps with K = 1 / std_floor (K = 1 for scale "none"),
    and the documented bound holds for rewards in [-1, 1]."""
    m = len(baseline)
    rows = baseline + other_group
    ids = [0] * m + [1] * len(other_group) + [0]
    mask = torch.tensor([True] * len(rows) + [False])
    anchors = None if anchor is None else torch.tensor(list(range(len(rows))) + [min(anchor, m - 1)])

    def outside_advantage(reward):
        rewards = torch.tensor(rows + [reward], dtype=torch.float64)
        adv = group_advantages(
            rewards, torch.tensor(ids), scale=scale, baseline_mask=mask, anchors=anchors, std_floor=floor
        )
        return adv[-1].item(), adv

    before, adv = outside_advantage(r)
    after, _ = outside_advantage(r + eps)
    k = 1.0 if scale == "none" else 1.0 / floor
    assert abs(after - before) <= k * eps * (1 + 1e-9) + 1e-12
    total = len(rows)
    if scale == "group":
        bound = (m - 1) / math.sqrt(m)
    elif scale == "batch":
        bound = math.sqrt((m - 1) * (total - 1) / m)
    else:
        bound = 2.0
    assert adv[:m].abs().max().item() <= bound * (1 + 1e-9) + 1e-12
    assert abs(before) <= bound * (1 + 1e-9) + 1e-12


def test_std_floor_must_be_positive():
    with pytest.raises(ValueError, match="std_floor"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), std_floor=0.0)


@settings(max_examples=300, deadline=None)
@given(_batches())
def test_without_reward_spread_matches_a_python_loop(batch):
    rewards, group_ids = batch[0], batch[1]
    members = {}
    for r, g in zip(rewards, group_ids):
        members.setdefault(g, []).append(r)
    expected = [len({r for r in members[g] if not math.isnan(r)}) <= 1 for g in group_ids]
    got = without_reward_spread(torch.tensor(rewards, dtype=torch.float64), torch.tensor(group_ids, dtype=torch.long))
    assert got.dtype == torch.bool and got.tolist() == expected


@pytest.mark.parametrize("size", [6, 8, 16])
def test_equal_rewards_give_rounding_noise_that_without_reward_spread_names(size):
    """Why consumers decide "no spread" from the rewards: TRL's float32 statistics of equal rewards (0.3, a reward
    that is not a dyadic fraction) are not exact, so the advantages of a tied group are not all 0; a tiny real spread
    gives advantages of the same size. `without_reward_spread` tells them apart; the advantages cannot."""
    tied = torch.full((size,), 0.3, dtype=torch.float32)
    noise = group_advantages(tied, torch.zeros(size, dtype=torch.long))
    assert bool((noise != 0).any()) and noise.abs().max() < 2e-3
    assert without_reward_spread(tied, torch.zeros(size, dtype=torch.long)).all()
    spread = tied.clone()
    spread[0] = torch.nextafter(spread[0], torch.tensor(1.0))  # one float32 step apart
    assert not without_reward_spread(spread, torch.zeros(size, dtype=torch.long)).any()
    # 0/1 rewards are exact at every size: a tie gives exact zeros.
    assert torch.equal(group_advantages(torch.ones(size), torch.zeros(size, dtype=torch.long)), torch.zeros(size))


def test_without_reward_spread_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="one shape"):
        without_reward_spread(torch.zeros(3), torch.zeros(2, dtype=torch.long))
