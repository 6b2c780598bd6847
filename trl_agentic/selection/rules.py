"""The selection rules of `row_selection`, pure functions of the rewards (no model, no trainer).

- `random_rows`: a uniformly random `ceil(fraction * n)` of the scorable rows: the control of a learned row filter at
  its keep rate (TracIn keeps the rows whose influence score is positive).
- `max_variance_rows`: from each group of `n` rollouts, the `m` whose rewards have the largest variance (PODS,
  Xu et al. 2025, "Not All Rollouts are Useful: Down-Sampling Rollouts in LLM Reinforcement Learning",
  arXiv 2504.13818): roll out more than is trained on, and train on the rollouts with the most contrast.
- `successful_rows`: the rollouts whose reward reaches a threshold: rejection sampling for self-training on the
  policy's own successes (RFT, Yuan et al. 2023, arXiv 2308.01825; STaR, Zelikman et al. 2022, arXiv 2203.14465).

A NaN reward (an unscorable rollout) is never selected.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

SELECTION_MODES = ("none", "random", "max_variance", "successful")


def _scorable(rewards: Sequence[float]) -> list[bool]:
    return [not math.isnan(r) for r in rewards]


def random_rows(rewards: Sequence[float], fraction: float, seed: int) -> list[bool]:
    """
    Keep a uniformly random `ceil(fraction * n)` of the `n` scorable rows (at least one when there is one).

    Args:
        rewards (`Sequence[float]`): One reward per row (NaN: unscorable, never kept).
        fraction (`float`): Share of the scorable rows kept, in (0, 1].
        seed (`int`): Seed of the draw: the same seed keeps the same rows.

    Returns:
        `list[bool]`: The kept rows.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"`fraction` must be in (0, 1], got {fraction}.")
    candidates = [k for k, ok in enumerate(_scorable(rewards)) if ok]
    count = min(len(candidates), max(1, math.ceil(fraction * len(candidates) - 1e-9))) if candidates else 0
    chosen = set(random.Random(seed).sample(candidates, count))
    return [k in chosen for k in range(len(rewards))]


def _variance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def max_variance_subset(rewards: Sequence[float], m: int) -> list[int]:
    """
    The indices of the `m` rewards of largest variance (PODS' max-variance down-sampling).

    A subset of maximal variance is made of the `i` lowest and the `m - i` highest rewards for some `i` (shown in the
    PODS paper; the tests check it against every subset), so only the `m + 1` splits of the sorted rewards are
    compared. Rewards are sorted by value, equal
    ones by index, and among splits of equal variance the one with the most rewards from the top of that order wins:
    the choice is deterministic.
    NaN rewards are never chosen; with `m` or fewer scorable rewards, all of them are.

    Args:
        rewards (`Sequence[float]`): The rewards of one group.
        m (`int`): How many to keep (at least 1).

    Returns:
        `list[int]`: The chosen indices, ascending.
    """
    if m < 1:
        raise ValueError(f"`m` must be at least 1, got {m}.")
    order = sorted((k for k, ok in enumerate(_scorable(rewards)) if ok), key=lambda k: (rewards[k], k))
    if len(order) <= m:
        return sorted(order)
    best, best_variance = None, -1.0
    # Ties within rounding, relative to the rewards' scale (an absolute 1e-12 called rewards of 1e-6 all tied).
    tolerance = 1e-12 * max(abs(rewards[k]) for k in order) ** 2
    for low in range(m + 1):  # the `low` lowest and the `m - low` highest
        chosen = order[:low] + order[len(order) - (m - low) :]
        variance = _variance([rewards[k] for k in chosen])
        if variance > best_variance + tolerance or best is None:
            best, best_variance = chosen, variance
    return sorted(best)


def max_variance_rows(rewards: Sequence[float], group_ids: Sequence[int], m: int) -> list[bool]:
    """
    [`max_variance_subset`] in every group: the `m` rows of each group (rows sharing a group id, in any order) whose
    rewards have the largest variance.

    Returns:
        `list[bool]`: The kept rows.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"`rewards` and `group_ids` differ in length: {len(rewards)} and {len(group_ids)}.")
    members: dict[int, list[int]] = {}
    for k, group in enumerate(group_ids):
        members.setdefault(int(group), []).append(k)
    kept = [False] * len(rewards)
    for rows in members.values():
        for j in max_variance_subset([rewards[k] for k in rows], m):
            kept[rows[j]] = True
    return kept


def successful_rows(rewards: Sequence[float], threshold: float) -> list[bool]:
    """
    The rows whose reward is at least `threshold` (the accepted samples of rejection sampling).

    Returns:
        `list[bool]`: The kept rows.
    """
    return [ok and r >= threshold for r, ok in zip(rewards, _scorable(rewards), strict=True)]
