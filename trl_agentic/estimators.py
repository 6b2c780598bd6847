"""Pluggable advantage estimators: the contract, the default GRPO estimator and name resolution.

An estimator is a callable `estimator(batch: AdvantageBatch, trainer) -> Tensor | EstimatorResult` returning the
advantages of this process's rows, shape `(B,)` or `(B, T)` (token-level), optionally with extra rows. `batch` carries the group statistics inputs for the whole
generation batch (all processes, gathered) and the local token tensors. Select one with
`AgenticGRPOConfig.advantage_estimator` (`"grpo"`, an import path `"package.module:function"`) or pass a callable
to the trainer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from .advantages import DEFAULT_STD_FLOOR, group_advantages


@dataclass
class AdvantageBatch:
    """Inputs of an advantage estimator.

    Attributes:
        rewards: `(N,)` reward of every row of the generation batch on all processes (NaN = unscorable).
        group_ids: `(N,)` prompt-group id of every row (unique across processes).
        baseline_mask: `(N,)` rows that enter the group statistics (`group_baseline`, snapshot policy).
        row_kind: `(N,)` `RowKind` of every row.
        episode_ids: `(N,)` index of the rollout each row belongs to (snapshots and negatives share their parent's).
        local_index: `(B,)` positions of this process's rows in the `(N,)` arrays, in local row order.
        prompt_ids: `(B, P)` local prompt tokens (left-padded) and `prompt_mask` their attention mask.
        completion_ids: `(B, T)` local completion tokens (right-padded) and `completion_mask` their attention mask.
        tool_mask: `(B, T)` 1 on model-generated tokens, 0 on environment tokens (tool results, hints).
        loss_mask: `(B, T)` local trainable-token mask (`completion_mask * tool_mask`, zero for lost rollouts).
        scale: TRL's `scale_rewards` (`"group"`, `"batch"` or `"none"`).
        std_floor: `advantage_std_floor`, the smallest divisor of an outside-baseline row's reward difference.
    """

    rewards: Tensor
    group_ids: Tensor
    baseline_mask: Tensor
    row_kind: Tensor
    episode_ids: Tensor
    local_index: Tensor
    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    tool_mask: Tensor
    loss_mask: Tensor
    scale: str
    std_floor: float = DEFAULT_STD_FLOOR


@dataclass
class EstimatorResult:
    """What an estimator returns when it also adds rows (e.g. RLVCR's alternative thinking levels).

    Attributes:
        advantages: `(B,)` or `(B, T)` advantages of this process's existing rows.
        extra_rows: New rows (`trl_agentic.rollout.types.ExtraRow`, `parent` = local row index) appended to the batch
            as members of their parent's group.
        extra_advantages: Their advantages, `(K,)` or `(K, T')`; token-level ones are re-padded with the batch.
    """

    advantages: Tensor
    extra_rows: list = field(default_factory=list)
    extra_advantages: Tensor | None = None


Estimator = Callable[[AdvantageBatch, object], "Tensor | EstimatorResult"]


def grpo_estimator(batch: AdvantageBatch, trainer=None) -> Tensor:
    """GRPO over variable-size groups: `group_advantages` on the gathered rewards (a row outside the baseline measured
    from its episode), then this process's rows."""
    advantages = group_advantages(
        batch.rewards,
        batch.group_ids,
        scale=batch.scale,
        baseline_mask=batch.baseline_mask,
        anchors=batch.episode_ids,
        std_floor=batch.std_floor,
    )
    return advantages[batch.local_index]


BUILTIN_ESTIMATORS: dict[str, Estimator | str] = {
    "grpo": grpo_estimator,
    "rlvcr": "trl_agentic.rlvcr.estimator:rlvcr_estimator",  # imported on first use
}


def resolve_estimator(spec: str | Callable) -> Estimator:
    """Turn `"grpo"`, `"package.module:function"` or a callable into an estimator callable.

    Raises:
        ValueError: Unknown name or import path that does not resolve to a callable.
    """
    if callable(spec):
        return spec
    if spec in BUILTIN_ESTIMATORS:
        spec = BUILTIN_ESTIMATORS[spec]
        if callable(spec):
            return spec
    if isinstance(spec, str) and ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"`advantage_estimator`: cannot import {spec!r} ({e}).") from e
        if not callable(fn):
            raise ValueError(f"`advantage_estimator`: {spec!r} is not callable.")
        return fn
    raise ValueError(
        f"`advantage_estimator` must be one of {sorted(BUILTIN_ESTIMATORS)} or an import path "
        f"'package.module:function', got {spec!r}."
    )


def zero_without_reward_spread(estimator: Estimator | None, args) -> bool:
    """Whether a group without reward spread gets advantage exactly 0 from `estimator` (None: GRPO).

    GRPO's advantages (and CoPO's, `A_traj` times a weight: `rlvcr_mode="copo"`) are 0 in exact arithmetic there, so
    the float32 rounding noise TRL's computation leaves (e.g. six rewards of 0.3: 3.0e-4 on every row) is replaced by
    0. RLVCR's additive rule and custom estimators keep their advantages, which can carry signal without a reward
    spread. Decided by the estimator that runs, not the config's string: a callable passed to a trainer while the
    config says `"rlvcr"` is a custom estimator, and RLVCR named by its import path is RLVCR.
    """
    if estimator is None or estimator is grpo_estimator:
        return True
    return getattr(args, "rlvcr_mode", None) == "copo" and estimator is resolve_estimator("rlvcr")
