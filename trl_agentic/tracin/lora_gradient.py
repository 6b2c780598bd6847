"""Per-layer LoRA gradients (the validation direction V, or selected-row gradients) and their cross-rank reduction."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor


class LoraGradient(NamedTuple):
    """Gradient of one LoRA layer, shaped like its weights.

    Args:
        A: Gradient w.r.t. `lora_A.weight`, shape (r, d_in).
        B: Gradient w.r.t. `lora_B.weight`, shape (d_out, r).
    """

    A: Tensor
    B: Tensor


LoraGradients = dict[str, LoraGradient]
"""Layer name (as in `find_lora_layers`) -> `LoraGradient`."""


def lora_gradient_dot(left: LoraGradients, right: LoraGradients) -> Tensor:
    """Inner product of two per-layer LoRA gradients, summed over layers present in both.

    Args:
        left: First gradient set.
        right: Second gradient set.

    Returns:
        A 0-dim tensor.
    """
    terms = [(left[k].A * right[k].A).sum() + (left[k].B * right[k].B).sum() for k in left if k in right]
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()


def norm(grads: LoraGradients) -> float:
    """Euclidean norm over every layer's A and B, accumulated in float64 (`tracin/val_grad_norm`)."""
    return math.sqrt(sum(float(g.A.double().square().sum() + g.B.double().square().sum()) for g in grads.values()))


def is_zero(grads: LoraGradients) -> bool:
    """Whether every layer's gradient is exactly zero (a validation direction V without information: no validation
    group had both a reward spread and a token to train, so every trained advantage, and V, is 0)."""
    return all(not grad.A.any() and not grad.B.any() for grad in grads.values())


def all_reduce_(
    grads: LoraGradients, op: Literal["sum", "mean"] = "sum", group: torch.distributed.ProcessGroup | None = None
) -> LoraGradients:
    """All-reduce per-layer LoRA gradients in place, in a single collective.

    Every rank must hold the same layer names in the same order (true for replicas of one model). Each rank's local
    validation gradient only reflects its own validation shard; without this reduction, ranks would filter their rows
    against different directions. "sum" gives the gradient of the summed per-rank validation losses, "mean" the
    gradient of their average; the two differ by the positive factor world_size, so the sign of every score (and any
    ranking) is the same.

    Args:
        grads: The gradients to reduce; tensors are overwritten with the reduced values.
        op: "sum" or "mean" over ranks.
        group: Process group; defaults to the world.

    Returns:
        `grads` (for chaining). A no-op when `torch.distributed` is not initialised.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"Unknown op {op!r}; expected 'sum' or 'mean'.")
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or not grads:
        return grads
    tensors = [t for grad in grads.values() for t in grad]
    # One flat buffer: one collective instead of two per layer.
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if op == "mean":
        flat /= dist.get_world_size(group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return grads
