"""Reward functions of the BFCL suite (TRL signature: they read the rollouts' environments).

- [`bfcl_reward`]: the official checker's verdict on the whole conversation, 1.0 (valid) or 0.0;
- [`bfcl_turn_credit`]: ours, not BFCL's: the fraction of leading turns that pass the official per-turn checks (a
  dense signal; 1.0 exactly when the verdict is valid).

The verdict is read through reward functions rather than an environment `get_reward`: TRL adds one reward column per
environment class defining `get_reward`, and the suite has one class per tool group.
"""

from __future__ import annotations

from .env import BFCLEnv


def bfcl_reward(environments=None, **kwargs) -> list[float | None]:
    """The official BFCL multi-turn verdict of each rollout: 1.0 or 0.0 (None for rollouts of other environments)."""
    return [
        (1.0 if env._official_verdict()["valid"] else 0.0) if isinstance(env, BFCLEnv) else None
        for env in environments or []
    ]


def bfcl_turn_credit(environments=None, **kwargs) -> list[float | None]:
    """Our per-turn partial credit of each rollout, in [0, 1] (None for rollouts of other environments)."""
    return [env._turn_credit() if isinstance(env, BFCLEnv) else None for env in environments or []]
