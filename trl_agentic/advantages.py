"""GRPO advantages over groups of any size, and the rewards given to negative samples.

`group_advantages` generalises the advantage computation of TRL 1.16's `GRPOTrainer` (fixed-size groups laid out as
`rewards.view(-1, num_generations)`) to groups of varying size identified by arbitrary ids, with NaN (unscorable)
rewards and an optional baseline mask. It is fully vectorised (no Python loop over groups): the rows are scattered into
a NaN-padded `(groups, largest group)` table and reduced with TRL's own operations (`torch.nanmean` and TRL's `nanstd`
lines), so that TRL's layout gives TRL's advantages bit for bit for every group size.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_advantages", "negative_sample_rewards", "tied_rows", "without_reward_spread"]

_SCALES = ("group", "batch", "none")
# Default smallest divisor of an outside row's reward difference (see `AgenticGRPOConfig.advantage_std_floor`).
DEFAULT_STD_FLOOR = 0.1
# Same epsilon as TRL's GRPOTrainer, so that full fixed-size groups reproduce its advantages.
_EPS = 1e-4


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    scale: str = "group",
    baseline_mask: Tensor | None = None,
    anchors: Tensor | None = None,
    std_floor: float = DEFAULT_STD_FLOOR,
) -> Tensor:
    """
    Compute GRPO advantages for rows grouped by arbitrary ids.

    Each row's advantage is its reward minus the mean reward of its group, optionally divided by a standard deviation
    plus `1e-4`, following TRL 1.16's `GRPOTrainer`. The group statistics (mean and unbiased std) are taken over the
    group's *statistics rows* (the *baseline*): the rows whose reward is not NaN and, when `baseline_mask` is given,
    whose mask is set. Baseline rows get exactly TRL's `A = (r - mean) / d`, with `d = std + 1e-4` (`scale="group"`),
    the batch's std + `1e-4` (`"batch"`) or `d = 1` (`"none"`).

    A row outside the baseline (a non-NaN reward, mask unset) is measured from an *anchor*: its entry of `anchors` when
    that is a baseline row of the same group (the trainer passes the row's episode, i.e. the rollout a negative sample
    or a snapshot segment comes from), the group mean otherwise (anchor advantage 0). Unless `scale="none"`:

        A = clip(A_anchor + (r - r_anchor) / max(d, std_floor), -C, C)

    with `C` the larger of `(m - 1) / sqrt(m)` (`m` = the group's baseline rows; no standardised baseline row can
    exceed it) and the largest `|A|` of the group's baseline rows. So, in every group, ties included:

    - an outside row is continuous in its reward: `|A(r + eps) - A(r)| <= eps / std_floor` (`K = 1 / std_floor`;
      `K = 1` with `scale="none"`, where nothing is divided or clipped);
    - an outside row whose reward equals its anchor's gets exactly its anchor's advantage (a snapshot segment scored
      with its episode's reward gets its episode's), and where `d >= std_floor` the rule is TRL's `(r - mean) / d`;
    - it never exceeds what a baseline row of its group can reach (`C`).

    Bounds (for rewards in `[-1, 1]`): every advantage is finite, and `|A| <= (m - 1) / sqrt(m)` with
    `scale="group"`, `|A| <= sqrt((m - 1) (N - 1) / m)` with `scale="batch"` (`N` = statistics rows of the batch),
    `|A| <= 2` with `scale="none"`.

    Special cases:
        - A row with a NaN reward (unscorable) gets advantage 0.
        - A group with fewer than two statistics rows has no usable spread, so all its rows get advantage 0 (TRL gets
          the same result implicitly, as its `nanstd` of a single value is NaN and later zeroed by `nan_to_num`).

    For TRL's layout (contiguous fixed-size groups in increasing id order, with or without NaN rows, no mask) this is
    TRL's `rewards.view(-1, G)` computation bit for bit, for every `G` (float32: the same tensor, the same operations;
    tested for G = 2-9 and 16 in `tests/test_advantages.py`). With every feature off the trainer goes further and keeps
    TRL's own advantages (`BatchAugmenter`).

    Args:
        rewards (`Tensor`):
            Floating-point tensor of shape `(N,)` with one reward per row; NaN marks an unscorable row.
        group_ids (`Tensor`):
            Integer tensor of shape `(N,)`. Rows sharing an id form a group. Ids need not be contiguous, sorted or
            non-negative.
        scale (`str`, *optional*, defaults to `"group"`):
            How to scale the centred rewards:
            - `"group"`: divide by the unbiased std of the row's group statistics rows plus `1e-4`.
            - `"batch"`: divide by the unbiased std of all statistics rows of the batch plus `1e-4` (TRL's
              `nanstd(rewards)` over the whole batch).
            - `"none"`: no division.
        baseline_mask (`Tensor`, *optional*):
            Boolean tensor of shape `(N,)`. When given, only rows where it is `True` (and the reward is not NaN) enter
            the group mean and std, and the batch std for `scale="batch"`.
        anchors (`Tensor`, *optional*):
            Integer tensor of shape `(N,)`: for a row outside the baseline, the index of the row it is measured from.
            Ignored for baseline rows and where the anchor is not a baseline row of the same group.
        std_floor (`float`, *optional*, defaults to `0.1`):
            Smallest divisor of an outside row's reward difference (`AgenticGRPOConfig.advantage_std_floor`, where the
            default is justified). Must be positive.

    Returns:
        `Tensor`: Advantages of shape `(N,)`, with the dtype and device of `rewards`. The inputs are not modified.

    Raises:
        ValueError: If `scale` is not one of `"group"`, `"batch"`, `"none"`, if `std_floor` is not positive, or if the
            shapes or dtypes are invalid.
    """
    if scale not in _SCALES:
        raise ValueError(f"Invalid `scale`: {scale!r}. Must be one of {', '.join(repr(s) for s in _SCALES)}.")
    if rewards.dim() != 1:
        raise ValueError(f"`rewards` must be 1-D, got shape {tuple(rewards.shape)}.")
    if not rewards.is_floating_point():
        raise ValueError(f"`rewards` must be a floating-point tensor, got {rewards.dtype}.")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"`group_ids` must have shape {tuple(rewards.shape)}, got {tuple(group_ids.shape)}.")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"`group_ids` must be an integer tensor, got {group_ids.dtype}.")
    if baseline_mask is not None:
        if baseline_mask.shape != rewards.shape:
            raise ValueError(
                f"`baseline_mask` must have shape {tuple(rewards.shape)}, got {tuple(baseline_mask.shape)}."
            )
        if baseline_mask.dtype != torch.bool:
            raise ValueError(f"`baseline_mask` must be a boolean tensor, got {baseline_mask.dtype}.")
    if anchors is not None and (anchors.shape != rewards.shape or anchors.is_floating_point()):
        raise ValueError(f"`anchors` must be an integer tensor of shape {tuple(rewards.shape)}.")
    if not std_floor > 0:
        raise ValueError(f"`std_floor` must be positive, got {std_floor}.")

    if rewards.numel() == 0:
        return torch.empty_like(rewards)

    device, dtype = rewards.device, rewards.dtype
    # Dense group index 0..G-1 (sorted ids), whatever the original ids look like.
    uniques, inverse = torch.unique(group_ids.to(device), return_inverse=True)
    num_groups = uniques.numel()

    valid = ~torch.isnan(rewards)
    stats = valid if baseline_mask is None else valid & baseline_mask.to(device)
    # The statistics rows laid out as a (groups, largest group) table, NaN elsewhere, each group's rows in row order.
    # For TRL's layout (contiguous groups of G in id order) the table *is* TRL's `rewards.view(-1, G)`, and the
    # statistics below are TRL's operations on it, so the advantages are TRL's bit for bit for every G.
    table = _group_table(torch.where(stats, rewards, torch.full_like(rewards, torch.nan)), inverse, num_groups)
    counts = (~torch.isnan(table)).sum(dim=1)
    means = torch.nanmean(table, dim=1)
    # A group without statistics rows has a NaN mean; its rows are zeroed at the end.
    advantages = rewards - means[inverse]
    if scale == "group":
        divisor = _nanstd(table, dim=1)[inverse] + _EPS
    elif scale == "batch":
        divisor = (_nanstd(torch.where(stats, rewards, torch.nan)) + _EPS).expand_as(rewards)
    if scale != "none":
        advantages = advantages / divisor

    outside = valid & ~stats
    if scale != "none" and bool(outside.any()):
        # Rows outside the baseline: their anchor's advantage plus their reward difference over a divisor floored at
        # `std_floor` (continuous in the reward even when the baseline has no spread and `d` is 1e-4), clipped to the
        # largest magnitude a baseline row of their group can reach: `(m - 1) / sqrt(m)` for `m` baseline rows (the
        # extreme of a sample standardised by its own unbiased std), or the group's largest baseline advantage if that
        # is larger (`scale="batch"`).
        anchor_reward, anchor_advantage = means[inverse], torch.zeros_like(advantages)
        if anchors is not None:
            a = anchors.to(device=device, dtype=torch.long).clamp(0, rewards.numel() - 1)
            usable = (anchors.to(device) >= 0) & (anchors.to(device) < rewards.numel()) & stats[a]
            usable &= inverse[a] == inverse
            anchor_reward = torch.where(usable, rewards[a], anchor_reward)
            anchor_advantage = torch.where(usable, advantages[a], anchor_advantage)
        floored = torch.clamp(divisor, min=std_floor)
        scored = anchor_advantage + (rewards - anchor_reward) / floored
        m = counts.to(dtype)
        bound = (m - 1) / torch.sqrt(m.clamp(min=1))
        in_baseline = torch.where(stats, advantages.abs(), torch.zeros_like(advantages))
        largest = torch.zeros(num_groups, dtype=dtype, device=device).scatter_reduce_(
            0, inverse, in_baseline, reduce="amax"
        )
        bound = torch.maximum(bound, largest)[inverse]
        advantages = torch.where(outside, torch.maximum(torch.minimum(scored, bound), -bound), advantages)

    # NaN rows and groups with fewer than two statistics rows carry no learning signal.
    keep = valid & (counts[inverse] >= 2)
    return torch.where(keep, advantages, torch.zeros_like(advantages))


def without_reward_spread(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """
    Which rows belong to a group whose rewards are all equal (NaN rewards ignored): a group without reward spread.

    Every GRPO advantage of such a group is 0 in exact arithmetic, but not always in floating point: TRL's float32
    mean of equal rewards need not equal them (six rewards of 0.3 give every row 3.0e-4 once divided by `std + 1e-4`,
    eight of 1.2 give 1.2e-3), so the computed advantages are rounding noise of one sign. Consumers that must tell "no signal" from
    a small signal (TracIn's validation direction) decide it here, from the rewards, not from the advantages.

    Args:
        rewards (`Tensor`):
            `(N,)` floating-point rewards; NaN marks an unscorable row.
        group_ids (`Tensor`):
            `(N,)` integer group ids (any values).

    Returns:
        `Tensor`: `(N,)` bool; True for every row of a group whose non-NaN rewards span nothing (one or no scorable
        row included: such a group's advantages are exactly 0 already).
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"`rewards` and `group_ids` must be 1-D of one shape, got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}."
        )
    return ~(group_reward_range(rewards, group_ids, ~torch.isnan(rewards)) > 0)


def group_reward_range(rewards: Tensor, group_ids: Tensor, included: Tensor) -> Tensor:
    """Per row, the range (max - min) of the `included` rewards of its group: `-inf` for a group without an included
    row, 0 for one with a single included reward. `(N,)` in, `(N,)` out, in `rewards`' dtype."""
    if rewards.numel() == 0:
        return rewards.new_empty(0)
    _, inverse = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    num_groups = int(inverse.max()) + 1
    included = included.to(rewards.device)
    high = rewards.new_full((num_groups,), -torch.inf).scatter_reduce(
        0, inverse, torch.where(included, rewards, -torch.inf), "amax"
    )
    low = rewards.new_full((num_groups,), torch.inf).scatter_reduce(
        0, inverse, torch.where(included, rewards, torch.inf), "amin"
    )
    return (high - low)[inverse]


def _group_table(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """`values` scattered into a `(num_groups, largest group)` table, NaN-filled, each group's rows in row order."""
    sizes = torch.bincount(inverse, minlength=num_groups)
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(sizes, 0) - sizes
    position = torch.empty_like(inverse)
    position[order] = torch.arange(inverse.numel(), device=inverse.device) - starts[inverse[order]]
    table = values.new_full((num_groups, int(sizes.max())), torch.nan)
    table[inverse, position] = values
    return table


def _nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """TRL 1.16's `trl.trainer.utils.nanstd` (same operations in the same order, NaN below two values), except that
    Bessel's correction is computed in `x`'s dtype (TRL's is float32 whatever the input: exact for float32)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = count.to(x.dtype) / (count - 1).to(x.dtype)
    correction = torch.where(count > 1, correction, torch.full_like(correction, torch.nan))
    variance *= correction
    std = torch.sqrt(variance)
    return std.squeeze() if dim is None else std.squeeze(dim)


def negative_sample_rewards(
    error_types: list[list[str]], default: float, per_error: dict[str, float] | None = None
) -> list[float]:
    """
    Compute the reward of each negative sample from the error types it triggered.

    A negative sample's reward is the most negative (minimum) of the `per_error` rewards of those of its error types
    that appear in `per_error`; when none does (or `per_error` is `None` or the sample has no error type), it is
    `default`. Taking the minimum means that a sample combining several errors is penalised for its worst one.

    Example:
        `negative_sample_rewards([["SyntaxError"], ["KeyError", "TimeoutError"], []], -0.5, {"TimeoutError": -1.0})`
        returns `[-0.5, -1.0, -0.5]`.

    Args:
        error_types (`list[list[str]]`):
            For each negative sample, the names of its error types (e.g. `["SyntaxError"]`).
        default (`float`):
            Reward of a sample none of whose error types has an entry in `per_error`.
        per_error (`dict[str, float]`, *optional*):
            Reward for each error type name.

    Returns:
        `list[float]`: One reward per negative sample, in the order of `error_types`.
    """
    per_error = per_error or {}
    rewards = []
    for types in error_types:
        matched = [float(per_error[name]) for name in types if name in per_error]
        rewards.append(min(matched) if matched else float(default))
    return rewards


def tied_rows(rewards: Tensor, group_ids: Tensor, baseline_mask: Tensor) -> Tensor:
    """
    Rows whose (episode) advantage is 0 in exact arithmetic although it may not be in float32: the one tie rule of
    RLVCR's episode advantages and TracIn's validation batches (sync and async).

    A group is tied when the finite rewards of its baseline rows are all equal (`without_reward_spread` over the
    baseline: a row outside it, such as a negative sample, is not in the group statistics). Its baseline rows then
    have advantage 0, and so does a row outside the baseline whose reward is that same value (a snapshot segment
    scored with its episode's reward: its anchor's advantage, 0). A row outside the baseline with another reward (a
    negative sample at -1) keeps its anchored advantage.

    Args:
        rewards (`Tensor`): `(N,)` rewards of every row (NaN: unscorable).
        group_ids (`Tensor`): `(N,)` group ids.
        baseline_mask (`Tensor`): `(N,)` bool, the rows in their group's statistics (`batch.baseline_mask`).

    Returns:
        `Tensor` of shape `(N,)`, bool.
    """
    rewards = rewards.double()
    group_ids = group_ids.to(rewards.device)
    baseline = baseline_mask.to(rewards.device).bool() & ~torch.isnan(rewards)
    tied = without_reward_spread(torch.where(baseline, rewards, torch.nan), group_ids)
    # The group's baseline reward on every row (-inf for a group without a baseline row: its advantages are 0).
    _, inverse = torch.unique(group_ids, return_inverse=True)
    value = rewards.new_full((int(inverse.max()) + 1 if inverse.numel() else 0,), -torch.inf)
    value = value.scatter_reduce(0, inverse, torch.where(baseline, rewards, -torch.inf), "amax")[inverse]
    return tied & (baseline | (rewards == value) | (value == -torch.inf))
