"""Row selection from TracIn influence scores."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

SELECTION_MODES = ("positive", "top_fraction", "threshold")


def _top_valid(scores: Tensor, candidates: Tensor, k: int) -> Tensor:
    """Mask of the k best candidates by score, ties broken by the lower index."""
    selected = torch.zeros_like(candidates)
    index = candidates.nonzero().squeeze(1)
    if k <= 0 or index.numel() == 0:
        return selected
    # A stable ascending sort of -score keeps index order among equal scores.
    order = torch.sort(-scores[index], stable=True).indices
    selected[index[order[:k]]] = True
    return selected


def select_rows(
    scores: Tensor,
    valid: Tensor,
    *,
    mode: str,
    fraction: float = 0.5,
    threshold: float = 0.0,
    min_selected: int = 1,
) -> Tensor:
    """Choose the rows to train on from their influence scores.

    Pure and deterministic: given the same (e.g. globally gathered) scores, every rank computes the same mask and can
    keep its own slice.

    Modes:
        - "positive": rows with `score > 0` (a step on them lowers the validation loss, to first order).
        - "threshold": rows with `score > threshold`.
        - "top_fraction": the `ceil(fraction * n_valid)` highest-scoring valid rows.

    Rows with `valid == False` (padding) and rows with a NaN score are never selected. If fewer than `min_selected`
    rows are selected, the selection is replaced by the `min_selected` highest-scoring rows (all of them if fewer are
    eligible); this is a superset of the original selection, since every mode selects the top-scoring rows. Equal
    scores are ranked by row index (lower first).

    Args:
        scores: (N,) influence scores.
        valid: (N,) bool, True for real rows.
        mode: One of "positive", "top_fraction", "threshold".
        fraction: Fraction of valid rows kept by "top_fraction", in (0, 1].
        threshold: Score threshold of "threshold".
        min_selected: Minimum number of selected rows (0 disables the fallback).

    Returns:
        (N,) bool mask of selected rows, on `scores.device`.

    Raises:
        ValueError: On an unknown `mode`, mismatched shapes, `fraction` outside (0, 1] or negative `min_selected`.
    """
    if mode not in SELECTION_MODES:
        raise ValueError(f"Unknown selection mode={mode!r}; expected one of {SELECTION_MODES}.")
    if scores.dim() != 1 or valid.shape != scores.shape:
        raise ValueError(
            f"`scores` and `valid` must both be 1-D of the same shape, got {scores.shape}, {valid.shape}."
        )
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"`fraction` must be in (0, 1], got {fraction}.")
    if min_selected < 0:
        raise ValueError(f"`min_selected` must be >= 0, got {min_selected}.")
    valid = valid.to(device=scores.device, dtype=torch.bool)
    eligible = valid & ~torch.isnan(scores)

    if mode == "positive":
        selected = eligible & (scores > 0)
    elif mode == "threshold":
        selected = eligible & (scores > threshold)
    else:
        n_valid = int(valid.sum())
        # Less 1e-9, as `selection.rules.random_rows` (the random control at the same fraction): 0.14 * 50 is
        # 7.000000000000001 in floating point, and kept 8 rows.
        selected = _top_valid(scores, eligible, math.ceil(fraction * n_valid - 1e-9))

    if int(selected.sum()) < min_selected:
        selected = _top_valid(scores, eligible, min_selected)
    return selected


def warn_uninformative_direction(step: int, num_generations: int, rows_lost: bool = False) -> None:
    """Say that V is exactly 0 at a refresh, so the filter keeps every row until the next one.

    Not an error (docs/tracin.md: no information, so no selection), but silent it turns TracIn into "fewer steps of
    plain GRPO": a strong policy solves every validation prompt, and the validation compute buys nothing.
    `rows_lost`: V is 0 because no validation token was left to train (every validation rollout lost to the
    infrastructure or masked), not for want of a reward spread; the remedy differs.
    """
    if rows_lost:
        why = (
            "no validation token was left to train: every validation rollout was lost to the infrastructure or masked "
            "(truncated, under `mask_truncated_completions`)"
        )
        remedy = (
            "look at the rollouts' errors (`tracin/val_reward` is NaN when all were lost) or the completion budget"
        )
    else:
        why = f"no validation group of {num_generations} completions had both a reward spread and a token to train"
        remedy = (
            "the validation rollouts buy nothing: raise `tracin_val_batch_size` or `tracin_val_num_generations`, or "
            "use harder validation prompts"
        )
    warnings.warn(
        f"TracIn: the validation gradient is exactly 0 at step {step} ({why}), so every row is trained on, "
        f"unfiltered, until the next refresh. If this repeats (`tracin/val_grad_norm` 0), {remedy}.",
        UserWarning,
        stacklevel=3,
    )


def warn_kl_only_direction(step: int, num_generations: int, beta: float) -> None:
    """Say that V carries no reward at a refresh: every validation advantage is 0, and with `beta` > 0 V is the
    gradient of the KL term alone, so the filter keeps the rows that move the policy back toward the reference."""
    warnings.warn(
        f"TracIn: no validation group of {num_generations} completions had a reward spread at step {step}, so the "
        f"validation gradient is the KL term's alone (beta={beta:g}): rows are selected by how much they move the "
        "policy back toward the reference model, not by reward, until the next refresh. If this repeats, raise "
        "`tracin_val_batch_size` or `tracin_val_num_generations`, or use harder validation prompts.",
        UserWarning,
        stacklevel=2,
    )
