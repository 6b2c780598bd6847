"""`AsyncAgenticGRPOConfig`: TRL's `AsyncGRPOConfig` plus trl-agentic's feature fields.

The feature fields are those of `AgenticGRPOConfig` (same names, defaults and help texts: they are copied from its
dataclass fields when this module is imported, so the two configs cannot drift), minus `vllm_lora_sync` (the
asynchronous trainer syncs LoRA adapters with TRL's own mechanism). They are validated by the same
`AgenticGRPOConfig._validate_agentic_fields`, before TRL's own checks, so a bad value fails before any model loads.
A few combinations the asynchronous trainer does not support are refused here too (see `_validate_async`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trl import GRPOConfig

from ..config import AgenticGRPOConfig
from .compat import AsyncGRPOConfig

__all__ = ["AsyncAgenticGRPOConfig"]

# Fields of the synchronous config that have no meaning here.
_NOT_COPIED = {"vllm_lora_sync"}


def _feature_fields() -> list[dataclasses.Field]:
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f for f in dataclasses.fields(AgenticGRPOConfig) if f.name not in grpo and f.name not in _NOT_COPIED]


def _copy(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)


@dataclass
class _AsyncOwnFields(AsyncGRPOConfig):
    """The fields of `AsyncAgenticGRPOConfig` that the synchronous config does not have."""

    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "With a trl-agentic feature on, how the group's centred rewards are scaled, as the synchronous "
            "trainer does (`trl_agentic.advantages.group_advantages`): 'group' divides by the unbiased std of the "
            "group's baseline rows plus 1e-4, 'none' does not divide. With every feature off TRL's own advantage "
            "(population std plus 1e-8) is kept unchanged.",
            "choices": ["group", "none"],
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "As `GRPOConfig.mask_truncated_completions` (TRL's `AsyncGRPOConfig` has no such field): a "
            "conversation whose completion does not end with an EOS or pad token was cut by `max_completion_length`; "
            "its rows get no loss (completion mask zeroed). They stay in the step and their reward stays in the "
            "group statistics, as `GRPOTrainer` keeps a masked row; a `delete_context` conversation's earlier "
            "segments are not trained either, its negative rows keep their loss (docs/async.md)."
        },
    )
    vllm_server_start: bool = field(
        default=False,
        metadata={
            "help": "`trl-agentic train` only: start a local vLLM server (LoRA enabled, on a free loopback port) for "
            "the run with this Python interpreter and stop it afterwards; `vllm_server_base_url` is then set to it."
        },
    )


_namespace = {"__annotations__": {}, "__module__": __name__, "__qualname__": "AsyncAgenticGRPOConfig"}
for _f in _feature_fields():
    _namespace["__annotations__"][_f.name] = _f.type
    _namespace[_f.name] = _copy(_f)


def _post_init(self):
    # Our checks first, as in AgenticGRPOConfig: cheap, and a bad value must fail before anything else happens (what
    # the asynchronous trainer refuses first, so that its message names why).
    self._validate_async()
    AgenticGRPOConfig._validate_agentic_fields(self)
    AsyncGRPOConfig.__post_init__(self)


def _validate_async(self) -> None:
    if self.scale_rewards not in ("group", "none"):
        raise ValueError(f"`scale_rewards` must be one of ['group', 'none'], got {self.scale_rewards!r}.")
    if self.tool_timeout:
        raise ValueError(
            "`tool_timeout` is not supported by AsyncAgenticGRPOTrainer: TRL's worker returns a rollout's "
            "environment to its pool after the rollout, so an environment whose timed-out call still runs in a thread "
            "would be reused. Leave `tool_timeout=0`."
        )
    strategy = str(getattr(self.eval_strategy, "value", self.eval_strategy))
    for name, on in (("eval_strategy", strategy != "no"), ("eval_on_start", self.eval_on_start)):
        if on:  # TRL's AsyncGRPOTrainer takes no `eval_dataset`: `Trainer.__init__` refused it after the model loaded
            raise ValueError(
                f"`{name}={getattr(self, name)!r}` is not supported by AsyncAgenticGRPOTrainer: TRL's asynchronous "
                "trainer has no evaluation loop. Leave `eval_strategy='no'` and `eval_on_start=False`; "
                "`trl-agentic train`'s held-out evaluation (`heldout_eval`) runs after training instead."
            )
    if self.row_selection != "none":
        raise ValueError(
            "`row_selection` is not supported by AsyncAgenticGRPOTrainer: it selects rows of a synchronous generation "
            "batch, which the asynchronous trainer does not have (docs/async.md)."
        )


_namespace["__post_init__"] = _post_init
_namespace["_validate_async"] = _validate_async
_namespace["_validate_row_selection"] = lambda self: None  # refused outright by `_validate_async`
_namespace["uses_agentic_loop"] = AgenticGRPOConfig.uses_agentic_loop
_namespace["agentic_features_enabled"] = AgenticGRPOConfig.agentic_features_enabled
_namespace["_VALID_DICT_FIELDS"] = [*AsyncGRPOConfig._VALID_DICT_FIELDS, "negative_reward_by_error"]
_namespace["__doc__"] = f"""
    Configuration class for [`AsyncAgenticGRPOTrainer`].

    Every field of TRL's [`~trl.experimental.async_grpo.AsyncGRPOConfig`] is accepted unchanged, plus the feature
    fields of [`AgenticGRPOConfig`] (same names, defaults and meaning; see its documentation): rollback and negative
    samples, context snapshots, further user turns, the advantage estimator (`advantage_estimator`, `rlvcr_*`) and
    the TracIn filter (`tracin_*`). With all of them at their defaults the trainer behaves exactly like TRL's
    `AsyncGRPOTrainer`. Own fields: `scale_rewards`, `mask_truncated_completions`,
    `vllm_server_start`. Not supported:
    `tool_timeout`, `row_selection`
    (refused with an error naming the field); `transformers_prefix_caching` has no effect (vLLM generates).

    Feature fields: {", ".join(f.name for f in _feature_fields())}.
    """

AsyncAgenticGRPOConfig = dataclass(type("AsyncAgenticGRPOConfig", (_AsyncOwnFields,), _namespace))
