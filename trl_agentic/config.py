"""`AgenticGRPOConfig`: TRL's `GRPOConfig` plus the fields of every trl-agentic feature.

Validation happens in `__post_init__`, i.e. when the config is built (from Python or from a YAML file by
`TrlParser`), so a bad value fails before any model is loaded, with a `ValueError` naming the field.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .field_checks import check_finite, check_integer

# The seed's default list (seed 000), by error type name: model errors that trigger a rollback. The seed's
# "worker_timeout" is the sandbox's time limit on model-written code, `SandboxTimeout` here (a model error).
DEFAULT_ROLLBACK_ON_ERRORS = [
    "ImportError",
    "ModuleNotFoundError",
    "SyntaxError",
    "IndentationError",
    "NameError",
    "TypeError",
    "IndexError",
    "SandboxTimeout",
]

# Failures that are not the model's (see `trl_agentic.errors`): retried in place, never trained on.
DEFAULT_INFRA_ERROR_TYPES = ["InfrastructureError"]
# The settings carried out by trl-agentic's rollout loop (any of them on: `uses_agentic_loop`).
AGENTIC_LOOP_FIELDS = (
    "enable_tool_rollback",
    "enable_context_snapshots",
    "tool_timeout",
    "max_tool_output_chars",
    "malformed_tool_call_feedback",
    "max_turn_tokens",
)
MAX_TOOL_TIMEOUT = 1e6  # seconds (11.6 days): well inside what a thread join or an event loop accepts

_CHOICES = {
    "rollback_feedback": ("none", "hint"),
    "group_baseline": ("all_rows", "episodes"),
    "snapshot_downsample": ("last", "random_plus_last"),
    "snapshot_advantage": ("episode", "row"),
    "rlvcr_mode": ("copo", "additive"),
    "rlvcr_norm_mode": ("mean_norm", "mean_std_norm"),
    "rlvcr_expand_steps": ("successful_varied", "varied", "all"),
    "tracin_selection": ("positive", "top_fraction", "threshold"),
    "row_selection": ("none", "random", "max_variance", "successful"),
}


@dataclass
class AgenticGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`AgenticGRPOTrainer`].

    Every field of [`~trl.GRPOConfig`] is accepted unchanged; the fields below switch on and tune the agentic
    features. With all of them at their defaults the trainer behaves exactly like [`~trl.GRPOTrainer`], generation
    included: `transformers_prefix_caching` (on by default) applies only in trl-agentic's own loop, which runs when a
    feature needs it, and reuses cached keys and values for the same tokens (greedy tokens equal, log-probabilities
    within float rounding).

    Parameters:
        > Tool rollback and negative samples (seeds 000/001)

        enable_tool_rollback (`bool`, *optional*, defaults to `False`):
            On a tool error matching `rollback_on_errors`, restore the environment to the checkpoint taken before the
            call, truncate the trajectory to the start of the failed turn and regenerate that turn.
        max_tool_retries (`int`, *optional*, defaults to `3`):
            Maximum number of regenerations per tool-call position (assistant turn). After that the error is kept and
            shown to the model, and the rollout continues.
        rollback_on_errors (`list[str]`, *optional*):
            Error type names that trigger a rollback, matched exactly against the names of a failed call's error: the
            exception's class and its base classes (`"OSError"` matches `FileNotFoundError`), or the `error_type` of
            a `trl_agentic.errors.ToolCallError` (the Python sandbox reports the model code's exception, e.g.
            `"NameError"`, and `"SandboxTimeout"` for code past its time limit). The loop's own errors are
            `"ToolCallParseError"` (malformed call markup), `"ToolNotFoundError"`, `"ToolTimeout"` (`tool_timeout`),
            and the BFCL environment raises its APIs' `{"error": ...}` reports as `"ToolError"`. A call failed only when
            it raised: whatever a tool returns (a printed `"ValueError: ..."`, a returned `{"error": ...}`) is a
            result, never searched. Defaults to the seed's list.
        rollback_feedback (`str`, *optional*, defaults to `"none"`):
            What the model sees before it retries: `"none"` restores the trajectory exactly to the checkpoint and
            re-samples; `"hint"` inserts `rollback_hint_template` as environment tokens (masked from the loss) that
            stay in the trajectory.
        rollback_hint_template (`str`, *optional*):
            Text of the hint inserted with `rollback_feedback="hint"`; `{error}` is replaced by the error message.
        infra_error_types (`list[str]`, *optional*, defaults to `["InfrastructureError"]`):
            Class names of failures that are not the model's, matched against the raised exception's class hierarchy
            only (checked first): a tool or environment raises `trl_agentic.errors.InfrastructureError` (or a
            subclass) when, e.g., its sandbox cannot start or a remote tool server refuses the connection. Add e.g.
            `"ConnectionError"` for tool clients that raise it. A `ToolCallError`'s `error_type` is never matched here:
            model-written code chooses it (the sandbox reports the model's own `ConnectionError` that way). Such a
            call is retried in place; it never creates a negative sample and is never trained on. A timeout, crash or
            memory kill of model-written code is a model error, not this.
        max_infra_retries (`int`, *optional*, defaults to `2`):
            Re-executions of a call that failed with an infrastructure error (only that call: the calls before it in
            the turn are not run again). If it still fails the rollout is kept out of the loss and out of the group
            statistics.
        save_negative_samples (`bool`, *optional*, defaults to `False`):
            Save the failed trajectory before each rollback as an extra training row of the same group, with reward
            `negative_sample_reward`. Requires `enable_tool_rollback`.
        max_negative_samples_per_group (`int`, *optional*, defaults to `1`):
            Maximum number of negative rows added to one prompt group.
        negative_sample_reward (`float`, *optional*, defaults to `-0.5`):
            Reward of a negative row.
        negative_reward_by_error (`dict[str, float]`, *optional*):
            Reward per error type (e.g. `{"SyntaxError": -1.0, "ImportError": -0.3}`); the most negative matching
            entry wins, `negative_sample_reward` otherwise.
        group_baseline (`str`, *optional*, defaults to `"episodes"`):
            Whether negative rows enter a group's mean and std: `"episodes"` (no: the baseline is the regular
            rollouts, and a negative row is scored against its episode, then clipped to the largest advantage a
            rollout of the group can reach, `(m - 1) / sqrt(m)` for `m` rollouts, so a baseline without spread cannot
            blow it up) or `"all_rows"` (yes, the seed's rule: a failed attempt lowers the group's mean, which raises
            every rollout's advantage). Snapshot segments follow `snapshot_advantage` under either. The default is
            the one the pre-registered ablation's rule chose (docs/concepts.md, "Which `group_baseline` is the
            default").
        advantage_std_floor (`float`, *optional*, defaults to `0.1`):
            Smallest divisor of the reward difference of a row outside its group's baseline (negatives under
            `group_baseline="episodes"`, snapshot segments under `snapshot_advantage="episode"`): such a row gets its
            episode's advantage plus `(r - r_episode) / max(d, advantage_std_floor)`, `d` the baseline rows' divisor
            (`std + 1e-4`), clipped as above. A reward difference `eps` then moves it by at most
            `eps / advantage_std_floor` in every group, ties included. The default is a tenth of the unit of 0/1
            rewards: a group of `m` rollouts with 0/1 rewards and any spread has `std >= 1 / sqrt(m)`, at least 0.1
            up to `m = 100`, so there the floor changes nothing. Set it to about a tenth of your task's reward unit.
        tool_timeout (`float`, *optional*, defaults to `0.0`):
            Wall-clock limit in seconds of one tool call; a call past it is reported to the model as a `ToolTimeout`
            error (a model error) and its environment is retired: the rollout continues on a fresh instance restored
            to the state before the call, so the abandoned call cannot change it later. `0` (TRL's behaviour)
            disables the limit; at most `1e6`. With a limit, a sync tool runs in a thread of its own, where a
            `SystemExit` it raises (an `argparse` on bad input) is reported like any error; without, it runs in the
            trainer's thread and `SystemExit` ends training, as in TRL. An in-process tool that holds the GIL (a
            catastrophic regular expression, a C extension) cannot be interrupted and returns late; run such code in
            a sandbox process.
        max_tool_output_chars (`int`, *optional*):
            Tool results (and error messages) longer than this are truncated, with a marker, before they reach the
            model. Unset (TRL's behaviour): no limit.
        malformed_tool_call_feedback (`bool`, *optional*, defaults to `False`):
            Tell the model when its tool-call markup is malformed (a `ToolCallParseError` tool message) instead of
            ending the rollout as plain text, as TRL does. `enable_tool_rollback` turns this on, so that malformed
            calls can be rolled back.

        > Context snapshots (seed 004)

        enable_context_snapshots (`bool`, *optional*, defaults to `False`):
            Give the model the `delete_context` tool. Each call closes the current trajectory as a training row,
            replaces the deleted messages by `context_stub_text` and continues from the re-rendered, shorter prompt.
        max_snapshots_per_episode (`int`, *optional*, defaults to `4`):
            Maximum number of closed segments of one rollout kept as training rows (the final segment is always
            kept).
        snapshot_downsample (`str`, *optional*, defaults to `"last"`):
            Which segments are kept when there are more: `"last"` (the most recent ones) or `"random_plus_last"` (the
            most recent one plus a random choice of the others).
        context_stub_text (`str`, *optional*, defaults to `"[deleted]"`):
            Text that replaces the content of each deleted message.
        snapshot_advantage (`str`, *optional*, defaults to `"episode"`):
            `"episode"`: one advantage per rollout, computed over the group's rollouts and copied to all its
            segments; `"row"`: every segment is a group member (seed).
        snapshot_reward_func (`str`, *optional*):
            Import path `"package.module:function"` of a per-segment reward term added to the episode reward of each
            segment, called as `f(segment_info: dict) -> float`.

        > Advantages

        advantage_estimator (`str`, *optional*, defaults to `"grpo"`):
            `"grpo"` (GRPO over variable-size groups, `trl_agentic.advantages.group_advantages`) or an import path
            `"package.module:function"` of an estimator (see `trl_agentic.estimators`). A callable can also be passed
            to the trainer as `advantage_estimator=`. `"rlvcr"` selects the RLVCR / CoPO thinking-level estimator.

        > RLVCR / CoPO thinking levels (seed 002, arXiv 2602.12662)

        rlvcr_mode (`str`, *optional*, defaults to `"copo"`):
            `"copo"` (the paper: `A_l = A_episode * w_l`, confidence weights) or `"additive"` (the seed: trajectory
            advantage + `rlvcr_step_advantage_w` × thinking advantage on the step's tokens).
        rlvcr_step_advantage_w (`float`, *optional*, defaults to `1.0`):
            Weight of the thinking advantage in `"additive"` mode (the seed's `step_advantage_w`).
        rlvcr_norm_mode (`str`, *optional*, defaults to `"mean_norm"`):
            Normalisation of the thinking reward within the 4 levels in `"additive"` mode: `"mean_norm"` or
            `"mean_std_norm"`.
        rlvcr_alpha (`float`, *optional*, defaults to `0.0`):
            Weight of the thinking-length term `0.5 - min(1, cost/cost_max)` in the additive thinking reward.
        rlvcr_cost_max (`float`, *optional*, defaults to `250.0`):
            Thinking-token count at which the length term saturates.
        rlvcr_k (`float`, *optional*, defaults to `2.0`):
            Temperature `k` of the CoPO weights `exp(k c~_l) / mean exp(k c~)`.
        rlvcr_expand (`bool`, *optional*, defaults to `False`):
            In `"copo"` mode, add the 3 alternative-level rows of each expanded step to the batch as extra rows of the
            same group.
        rlvcr_expand_steps (`str`, *optional*, defaults to `"successful_varied"`):
            Which steps are expanded: `"successful_varied"` (steps of successful rollouts in groups whose rewards
            differ: the paper), `"varied"` (any rollout of such groups) or `"all"`. In `"copo"` mode without `rlvcr_expand`,
            `"all"` gives the advantages of `"varied"` (a group without spread has `A_episode = 0` on every token) at
            the cost of expanding its steps; it is there to exercise the mechanism, and warns.
        rlvcr_level_tag / rlvcr_think_tag / rlvcr_action_tag (`str`, *optional*):
            Tag names of the step format `<level>k</level><think>…</think><action>…</action>`.
        rlvcr_level_prompt_template (`str`, *optional*):
            Level-forcing prompt used to generate alternative thinking (`{history}`, `{level}`, `{action}`
            placeholders); the built-in templates when unset.
        rlvcr_max_thinking_tokens (`int`, *optional*, defaults to `128`):
            Maximum tokens of one generated alternative thinking.
        rlvcr_score_batch_size (`int`, *optional*, defaults to `16`):
            Rows per forward pass when scoring the action under the 4 thinking contexts.

        > Generation (transformers path)

        transformers_prefix_caching (`bool`, *optional*, defaults to `True`):
            In multi-turn tool rollouts generated with transformers by trl-agentic's own loop (when a feature needs
            it; with every feature off TRL's loop and generation run untouched; not vLLM, which caches prefixes itself), keep
            each conversation's keys and values between its turns and prefill only the new tokens (tool results,
            user turns, hints); after a rollback the cache is cropped to the start of the failed turn, after
            `delete_context` it is reused up to the first deleted message. Generation is otherwise TRL's (same
            padded inputs, generation config and logits processors): greedy tokens are the same as without it and
            log-probabilities equal to float tolerance. Off (with a logged reason) for models whose cache is not
            all full-attention layers, dynamic-NTK / LongRoPE models, `cache_implementation`, `prefill_chunk_size`,
            beam search, continuous batching and vision models, and in training mode for models with dropout (TRL
            samples under fresh dropout masks at every turn).
        max_turn_tokens (`int`, *optional*):
            Most tokens the model may generate in one assistant turn (TRL has only the per-rollout
            `max_completion_length`, which still applies). A turn that reaches it without an end-of-turn token is
            truncated like a turn cut by `max_completion_length`: calls TRL's parser still finds in it run as in
            TRL's loop and their results are dropped, the rollout ends there and the turn counts in
            `tools/truncated_turns` (and `tools/turn_cap_truncations`); the rollout's last token is
            then not end-of-sequence, so `mask_truncated_completions` masks it as TRL masks a truncated completion.
            Setting it routes tool rollouts through trl-agentic's loop. Unset: no per-turn cap.

        > vLLM

        vllm_lora_sync (`bool`, *optional*, defaults to `True`):
            With `use_vllm` and a PEFT LoRA policy, hand vLLM only the adapter each step instead of TRL's
            merge-and-push of every base weight (the only sync that works on vLLM's CPU build). Falls back to TRL's
            sync for adapters vLLM cannot serve. This is the one default that differs from `GRPOTrainer`, and only
            for vLLM + PEFT runs.

        > TracIn-filtered training (seed 003)

        tracin_enabled (`bool`, *optional*, defaults to `False`):
            Score every training row by its influence on a validation gradient (LoRA ghost hooks) and train only on
            the selected rows. Requires a PEFT LoRA model.
        tracin_val_num_generations (`int`, *optional*, defaults to `4`):
            Completions per validation prompt (at least 2, otherwise every validation advantage is zero).
        tracin_val_batch_size (`int`, *optional*, defaults to `2`):
            Validation prompts per validation rollout (per process).
        tracin_val_refresh_steps (`int`, *optional*, defaults to `4`):
            Recompute the validation gradient V at the current weights every this many optimizer steps.
        tracin_val_rollout_steps (`int`, *optional*, defaults to `8`):
            Roll out new validation prompts every this many optimizer steps (at the first refresh due at or after
            that); in between, V is recomputed on the stored rollouts. 1 rolls out at every refresh.
        tracin_selection (`str`, *optional*, defaults to `"positive"`):
            `"positive"` (score > 0, the seed), `"top_fraction"` or `"threshold"`.
        tracin_top_fraction (`float`, *optional*, defaults to `0.5`):
            Fraction of rows kept by `"top_fraction"`.
        tracin_threshold (`float`, *optional*, defaults to `0.0`):
            Score threshold of `"threshold"`.
        tracin_min_selected (`int`, *optional*, defaults to `1`):
            If fewer rows are selected (over all processes), the top-scoring ones are taken instead.

        > Row selection (cheap selectors and rejection-sampled self-training; docs/ablation.md)

        row_selection (`str`, *optional*, defaults to `"none"`):
            Which rows of each generation batch are trained on: `"none"` (all), `"random"` (a random
            `row_selection_fraction` of them, masked out as TracIn masks: the control of a learned filter at its
            keep rate), `"max_variance"` (PODS: of each group of `num_generations` rollouts, the
            `row_selection_keep` with the largest reward variance, advantages recomputed over them; the others are
            removed from the batch; one process) or `"successful"` (rejection-sampled self-training, RFT/STaR: the
            rows whose reward is at least `row_selection_threshold`, advantage 1, which with `num_iterations=1` and
            `beta=0` is SFT on the policy's own successful rollouts). Not with rollback, snapshots, TracIn or a
            custom `advantage_estimator`.
        row_selection_fraction (`float`, *optional*, defaults to `0.5`):
            Share of the rows kept by `"random"`, in (0, 1] (rounded up).
        row_selection_keep (`int`, *optional*, defaults to `2`):
            Rows kept per group by `"max_variance"`: at least 2 and fewer than `num_generations`.
        row_selection_threshold (`float`, *optional*, defaults to `1.0`):
            Summed reward a row needs to be kept by `"successful"`.
    """

    # --- rollback and negatives -------------------------------------------------------------------------------
    enable_tool_rollback: bool = field(
        default=False,
        metadata={
            "help": "Restore the environment and regenerate the turn when a tool error matches `rollback_on_errors`."
        },
    )
    max_tool_retries: int = field(default=3, metadata={"help": "Maximum regenerations per tool-call position."})
    rollback_on_errors: list[str] = field(
        default_factory=lambda: list(DEFAULT_ROLLBACK_ON_ERRORS),
        metadata={
            "help": "Error type names (exception class or base class, or a ToolCallError's error_type; never text) "
            "that trigger a rollback."
        },
    )
    rollback_feedback: str = field(
        default="none",
        metadata={
            "help": "What the model sees before a retry: 'none' (exact restore) or 'hint' (masked error hint).",
            "choices": ["none", "hint"],
        },
    )
    rollback_hint_template: str = field(
        default="Your previous tool call failed with: {error}. Write a corrected call.",
        metadata={"help": "Hint text for rollback_feedback='hint'; '{error}' is replaced by the error message."},
    )
    infra_error_types: list[str] = field(
        default_factory=lambda: list(DEFAULT_INFRA_ERROR_TYPES),
        metadata={
            "help": "Class names of failures that are not the model's (default: trl_agentic.errors."
            "InfrastructureError), matched against the raised exception's class hierarchy, never a ToolCallError's "
            "error_type: retried in place, never trained on."
        },
    )
    max_infra_retries: int = field(
        default=2, metadata={"help": "Re-executions of a call (that call only) after an infrastructure error."}
    )
    save_negative_samples: bool = field(
        default=False, metadata={"help": "Save failed trajectories before a rollback as negative training rows."}
    )
    max_negative_samples_per_group: int = field(
        default=1, metadata={"help": "Maximum number of negative rows added to one prompt group."}
    )
    negative_sample_reward: float = field(default=-0.5, metadata={"help": "Reward of a negative row."})
    # `| str` lets the command line pass JSON (HfArgumentParser would call `dict()` on the string); parsed in
    # __post_init__, as TRL does for `model_init_kwargs`.
    negative_reward_by_error: dict[str, float] | str | None = field(
        default=None,
        metadata={
            "help": "Reward per error type, e.g. {'SyntaxError': -1.0} (JSON on the command line); the most negative "
            "match wins."
        },
    )
    group_baseline: str = field(
        default="episodes",
        metadata={
            "help": "Whether negative rows enter a group's mean/std: 'episodes' (no: they are scored against their "
            "episode and clipped to what a rollout can reach) or 'all_rows' (yes, the seed's rule). Snapshot segments "
            "follow `snapshot_advantage`.",
            "choices": ["all_rows", "episodes"],
        },
    )
    advantage_std_floor: float = field(
        default=0.1,
        metadata={
            "help": "Smallest divisor of the reward difference of a row outside its group's baseline (its episode's "
            "advantage + (r - r_episode) / max(std + 1e-4, floor)): a reward change eps moves it by at most "
            "eps / floor, ties included. 0.1 is below the std of any 0/1-reward group of <= 100 rollouts with spread."
        },
    )
    tool_timeout: float = field(
        default=0.0,
        metadata={
            "help": "Wall-clock limit (s) of one tool call, reported as a ToolTimeout model error; 0 (TRL) disables it."
        },
    )
    max_tool_output_chars: int | None = field(
        default=None,
        metadata={"help": "Truncate tool results longer than this many characters; unset (TRL): no limit."},
    )
    malformed_tool_call_feedback: bool = field(
        default=False,
        metadata={
            "help": "Send malformed tool-call markup back to the model as a ToolCallParseError (TRL ends the rollout "
            "instead); on with enable_tool_rollback."
        },
    )
    # --- context snapshots ------------------------------------------------------------------------------------
    enable_context_snapshots: bool = field(
        default=False,
        metadata={"help": "Enable the delete_context tool: each call closes a segment as a training row."},
    )
    max_snapshots_per_episode: int = field(
        default=4, metadata={"help": "Maximum closed segments of one rollout kept as training rows."}
    )
    snapshot_downsample: str = field(
        default="last",
        metadata={
            "help": "Which segments are kept: 'last' or 'random_plus_last'.",
            "choices": ["last", "random_plus_last"],
        },
    )
    context_stub_text: str = field(
        default="[deleted]", metadata={"help": "Text that replaces the content of each deleted message."}
    )
    snapshot_advantage: str = field(
        default="episode",
        metadata={
            "help": "'episode' (one advantage per rollout, copied to its segments) or 'row' (seed).",
            "choices": ["episode", "row"],
        },
    )
    snapshot_reward_func: str | None = field(
        default=None,
        metadata={
            "help": "Import path 'pkg.module:function' of a per-segment reward term added to the episode reward."
        },
    )
    # --- advantages -------------------------------------------------------------------------------------------
    advantage_estimator: str = field(
        default="grpo",
        metadata={
            "help": "Advantage estimator: 'grpo' (variable-group GRPO), 'rlvcr' (RLVCR / CoPO thinking levels) or an "
            "import path 'pkg.module:function'."
        },
    )

    # --- RLVCR ---------------------------------------------------------------------------------------------------
    rlvcr_mode: str = field(
        default="copo",
        metadata={
            "help": "'copo' (paper, multiplicative weights) or 'additive' (seed).",
            "choices": ["copo", "additive"],
        },
    )
    rlvcr_step_advantage_w: float = field(
        default=1.0, metadata={"help": "Weight of the thinking advantage (additive mode)."}
    )
    rlvcr_norm_mode: str = field(
        default="mean_norm",
        metadata={
            "help": "Thinking-reward normalisation (additive): 'mean_norm' or 'mean_std_norm'.",
            "choices": ["mean_norm", "mean_std_norm"],
        },
    )
    rlvcr_alpha: float = field(default=0.0, metadata={"help": "Weight of the thinking-length term (additive mode)."})
    rlvcr_cost_max: float = field(
        default=250.0, metadata={"help": "Thinking tokens at which the length term saturates."}
    )
    rlvcr_k: float = field(default=2.0, metadata={"help": "Temperature k of the CoPO confidence weights."})
    rlvcr_expand: bool = field(
        default=False, metadata={"help": "CoPO: add the 3 alternative-level rows of expanded steps to the batch."}
    )
    rlvcr_expand_steps: str = field(
        default="successful_varied",
        metadata={
            "help": "Which steps expand: 'successful_varied' (paper), 'varied' or 'all'. In 'copo' mode without "
            "rlvcr_expand, 'all' gives the advantages of 'varied' (a group without spread has advantage 0) at the "
            "cost of expanding its steps.",
            "choices": ["successful_varied", "varied", "all"],
        },
    )
    rlvcr_level_tag: str = field(default="level", metadata={"help": "Tag name of the thinking level."})
    rlvcr_think_tag: str = field(default="think", metadata={"help": "Tag name of the thinking block."})
    rlvcr_action_tag: str = field(default="action", metadata={"help": "Tag name of the action block."})
    rlvcr_level_prompt_template: str | None = field(
        default=None, metadata={"help": "Level-forcing prompt ({history}, {level}, {action}); built-in when unset."}
    )
    rlvcr_max_thinking_tokens: int = field(
        default=128, metadata={"help": "Maximum tokens of one alternative thinking."}
    )
    rlvcr_score_batch_size: int = field(default=16, metadata={"help": "Rows per scoring forward pass."})
    # --- TracIn --------------------------------------------------------------------------------------------------
    tracin_enabled: bool = field(
        default=False,
        metadata={"help": "Train only on rows whose LoRA influence on a validation gradient is selected."},
    )
    tracin_val_num_generations: int = field(default=4, metadata={"help": "Completions per validation prompt (>= 2)."})
    tracin_val_batch_size: int = field(default=2, metadata={"help": "Validation prompts per rollout (per process)."})
    tracin_val_refresh_steps: int = field(
        default=4, metadata={"help": "Recompute the validation gradient at the current weights every N steps."}
    )
    tracin_val_rollout_steps: int = field(
        default=8,
        metadata={"help": "Roll out new validation prompts every N steps; V is recomputed on stored ones in between."},
    )
    tracin_selection: str = field(
        default="positive",
        metadata={
            "help": "'positive' (seed), 'top_fraction' or 'threshold'.",
            "choices": ["positive", "top_fraction", "threshold"],
        },
    )
    tracin_top_fraction: float = field(default=0.5, metadata={"help": "Fraction kept by 'top_fraction'."})
    tracin_threshold: float = field(default=0.0, metadata={"help": "Score threshold of 'threshold'."})
    tracin_min_selected: int = field(default=1, metadata={"help": "Fallback: at least this many rows (top scores)."})
    # --- row selection ----------------------------------------------------------------------------------------
    row_selection: str = field(
        default="none",
        metadata={
            "help": "Rows trained on: 'none', 'random' (a random row_selection_fraction), 'max_variance' (PODS: the "
            "row_selection_keep of each group with the largest reward variance) or 'successful' (RFT: rows with "
            "reward >= row_selection_threshold, advantage 1).",
            "choices": ["none", "random", "max_variance", "successful"],
        },
    )
    row_selection_fraction: float = field(default=0.5, metadata={"help": "Share of rows kept by 'random'."})
    row_selection_keep: int = field(default=2, metadata={"help": "Rows kept per group by 'max_variance'."})
    row_selection_threshold: float = field(
        default=1.0, metadata={"help": "Reward a row needs to be kept by 'successful'."}
    )

    # --- generation ----------------------------------------------------------------------------------------------
    transformers_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "Transformers generation of multi-turn tool rollouts in trl-agentic's own loop (when a loop feature "
            "or an environment's further user turns need it; otherwise TRL's generation runs untouched): keep each conversation's KV cache between "
            "turns and prefill only the new tokens (cropped after a rollback, reused up to the first deleted message "
            "after delete_context). Same tokens as without it under greedy decoding. Off, with a logged reason, "
            "where it does not apply (vLLM caches prefixes itself; in training mode, models with dropout)."
        },
    )
    max_turn_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Most tokens generated in one assistant turn (beside the per-rollout max_completion_length). A "
            "turn that reaches it without an end-of-turn token is truncated: the rollout ends there, as for a turn "
            "cut by max_completion_length. Unset: no per-turn cap."
        },
    )

    # --- vLLM --------------------------------------------------------------------------------------------------
    vllm_lora_sync: bool = field(
        default=True,
        metadata={
            "help": "With vLLM and a PEFT LoRA policy, hand vLLM only the adapter each step (loaded as a vLLM LoRA "
            "adapter) instead of TRL's merge-and-push of every base weight. Falls back to TRL's sync for adapters "
            "vLLM cannot serve (DoRA, modules_to_save, biases, rank/alpha patterns) and with sleep mode."
        },
    )

    # Fields whose dict values arrive as JSON strings from the command line.
    _VALID_DICT_FIELDS = [*GRPOConfig._VALID_DICT_FIELDS, "negative_reward_by_error"]

    def __post_init__(self):
        # Our checks first: they are cheap, and a bad value must fail before anything else happens.
        self._validate_agentic_fields()
        super().__post_init__()
        if self.row_selection == "max_variance":  # needs TRL's generation_batch_size and steps_per_generation
            groups = self.generation_batch_size // self.num_generations
            if (groups * self.row_selection_keep) % self.steps_per_generation:
                raise ValueError(
                    f"`row_selection='max_variance'` keeps {groups} groups x {self.row_selection_keep} rows, which "
                    f"must split into `steps_per_generation` = {self.steps_per_generation} micro-batches: choose "
                    "`row_selection_keep` or the batch so that it divides."
                )

    @property
    def uses_agentic_loop(self) -> bool:
        """Whether tool rollouts need trl-agentic's loop; otherwise TRL's own `_tool_call_loop` runs, unchanged.

        An environment that supplies further user turns (`_next_user_turn`) also needs it (decided by the trainer).
        """
        # Set means truthy for each: `tool_timeout` 0 is off, the two limits are validated positive when set.
        return any(getattr(self, name) for name in AGENTIC_LOOP_FIELDS)

    @property
    def agentic_features_enabled(self) -> bool:
        """Whether any feature that adds rows, changes the rollout loop, the advantages or the training step is on."""
        return (
            self.enable_tool_rollback
            or self.enable_context_snapshots
            or self.tracin_enabled
            or self.advantage_estimator != "grpo"
        )

    def _validate_row_selection(self) -> None:
        if self.row_selection == "none":
            return
        others = {
            "enable_tool_rollback": self.enable_tool_rollback,
            "enable_context_snapshots": self.enable_context_snapshots,
            "tracin_enabled": self.tracin_enabled,
            "advantage_estimator": self.advantage_estimator != "grpo",
        }
        if any(others.values()):
            names = ", ".join(f"`{k}`" for k, v in others.items() if v)
            raise ValueError(
                f"`row_selection={self.row_selection!r}` selects among the regular rollouts and sets their advantages: "
                f"it does not combine with {names}."
            )
        check_finite("row_selection_fraction", self.row_selection_fraction)
        if not 0 < self.row_selection_fraction <= 1:
            raise ValueError(f"`row_selection_fraction` must be in (0, 1], got {self.row_selection_fraction!r}.")
        if self.row_selection == "max_variance":
            keep = self.row_selection_keep
            if not isinstance(keep, int) or isinstance(keep, bool) or not 2 <= keep < self.num_generations:
                raise ValueError(
                    f"`row_selection_keep` must be an integer in [2, num_generations) = [2, {self.num_generations}), "
                    f"got {keep!r}: the kept rows of a group need a spread, and keeping all selects nothing."
                )

    def _validate_agentic_fields(self) -> None:
        kwargs = getattr(self, "generation_kwargs", None)
        if isinstance(kwargs, str):  # JSON from the command line, parsed by TRL's own checks later
            try:
                kwargs = json.loads(kwargs)
            except ValueError:
                kwargs = None
        capped = [key for key in ("max_tokens", "max_new_tokens") if isinstance(kwargs, dict) and key in kwargs]
        if capped and (self.uses_agentic_loop or self.agentic_features_enabled):
            # TRL applies `generation_kwargs` after its own length, so this would replace the limit the loop gives
            # each call (the budget left, `max_turn_tokens`), and a turn it cut would read as complete.
            raise ValueError(
                f"`generation_kwargs` sets `{capped[0]}`, which overrides the token limit trl-agentic's rollout loop "
                "gives each turn: use `max_turn_tokens` (per turn) and `max_completion_length` (per conversation)."
            )
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")
        for name in ("max_tool_retries", "max_infra_retries", "max_negative_samples_per_group"):
            check_integer(name, getattr(self, name), 0)
        if self.max_tool_output_chars is not None and (
            not isinstance(self.max_tool_output_chars, int)
            or isinstance(self.max_tool_output_chars, bool)
            or self.max_tool_output_chars < 64
        ):
            raise ValueError(
                f"`max_tool_output_chars` must be unset or an integer >= 64, got {self.max_tool_output_chars!r}."
            )
        if self.max_turn_tokens is not None and (
            not isinstance(self.max_turn_tokens, int)
            or isinstance(self.max_turn_tokens, bool)
            or self.max_turn_tokens < 1
        ):
            raise ValueError(f"`max_turn_tokens` must be unset or a positive integer, got {self.max_turn_tokens!r}.")
        if not isinstance(self.transformers_prefix_caching, bool):
            raise ValueError(
                f"`transformers_prefix_caching` must be a boolean, got {self.transformers_prefix_caching!r}."
            )
        check_integer("max_snapshots_per_episode", self.max_snapshots_per_episode, 0)
        # Finite and bounded: threads and event loops refuse a wait past their platform's limit (inf, 1e10), and
        # NaN compares false to everything, so either would fail every call at run time instead of here.
        timeout = self.tool_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_TOOL_TIMEOUT:
            raise ValueError(
                f"`tool_timeout` must be a number of seconds from 0 (no limit) to {MAX_TOOL_TIMEOUT:.0f}, got "
                f"{timeout!r}."
            )
        for name in ("rollback_on_errors", "infra_error_types"):
            patterns = getattr(self, name)
            if isinstance(patterns, str):  # a single pattern from the command line
                patterns = [patterns]
                setattr(self, name, patterns)

            # "NameError, TypeError" (a YAML list written inline without brackets) would match nothing. Infrastructure
            # is read from class names alone; `rollback_on_errors` also matches an environment's own `error_type`
            # (any name without commas or spaces, e.g. "http-404").
            def valid(p, infra=name == "infra_error_types"):
                return (
                    isinstance(p, str)
                    and bool(p)
                    and (p.isidentifier() if infra else not any(c in p for c in ", \t\n"))
                )

            if not isinstance(patterns, list | tuple) or not all(valid(p) for p in patterns):
                what = "exception class names" if name == "infra_error_types" else "error type names"
                raise ValueError(f"`{name}` must be a list of {what} (e.g. [NameError, TypeError]), got {patterns!r}.")
            for catch_all in {"Exception", "BaseException"} & set(patterns):
                warnings.warn(
                    f"`{name}` lists `{catch_all}`: it matches a bare `{catch_all}` only, not its subclasses (the "
                    "catch-all bases are left out of the hierarchy matched); list the classes you mean.",
                    UserWarning,
                    stacklevel=3,
                )
        if self.enable_tool_rollback and not self.rollback_on_errors:
            raise ValueError("`rollback_on_errors` is empty but `enable_tool_rollback=True`: nothing would roll back.")
        if self.rollback_feedback == "hint":
            if "{error}" not in self.rollback_hint_template:
                raise ValueError("`rollback_hint_template` must contain '{error}' when `rollback_feedback='hint'`.")
            try:  # the loop formats it at every rollback: a bad template must fail here, not mid-training
                self.rollback_hint_template.format(error="ValueError: x")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"`rollback_hint_template` is not a valid format string with one '{{error}}' field: {e!r}."
                ) from e
        if isinstance(self.negative_reward_by_error, str):  # JSON from the command line
            try:
                self.negative_reward_by_error = json.loads(self.negative_reward_by_error)
            except ValueError as e:
                raise ValueError(f"`negative_reward_by_error` is not valid JSON: {e}") from e
        if self.negative_reward_by_error is not None:
            if not isinstance(self.negative_reward_by_error, dict) or not all(
                isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for k, v in self.negative_reward_by_error.items()
            ):
                raise ValueError(
                    "`negative_reward_by_error` must map error type names to finite numbers, got "
                    f"{self.negative_reward_by_error!r}."
                )
        # A non-finite reward or weight makes a whole group's advantages NaN (through its mean and std), and a NaN
        # threshold compares false to every score.
        for name in (
            "negative_sample_reward",
            "rlvcr_step_advantage_w",
            "row_selection_threshold",
            "tracin_threshold",
        ):
            check_finite(name, getattr(self, name))
        if self.snapshot_reward_func is not None and ":" not in self.snapshot_reward_func:
            raise ValueError(
                f"`snapshot_reward_func` must be an import path 'package.module:function', got {self.snapshot_reward_func!r}."
            )
        if not isinstance(self.advantage_estimator, str) or not (
            self.advantage_estimator in ("grpo", "rlvcr") or ":" in self.advantage_estimator
        ):
            raise ValueError(
                f"`advantage_estimator` must be 'grpo', 'rlvcr' or an import path 'package.module:function', "
                f"got {self.advantage_estimator!r}."
            )
        for name in ("rlvcr_level_tag", "rlvcr_think_tag", "rlvcr_action_tag"):
            tag = getattr(self, name)
            if not isinstance(tag, str) or not tag.strip() or any(c in tag for c in "<>/ "):
                raise ValueError(
                    f"`{name}` must be a non-empty tag name without '<', '>', '/' or spaces, got {tag!r}."
                )
        if len({self.rlvcr_level_tag, self.rlvcr_think_tag, self.rlvcr_action_tag}) < 3:
            raise ValueError("`rlvcr_level_tag`, `rlvcr_think_tag` and `rlvcr_action_tag` must be different.")
        if self.rlvcr_level_prompt_template is not None and "{action}" not in self.rlvcr_level_prompt_template:
            raise ValueError(
                "`rlvcr_level_prompt_template` must contain '{action}' (the thinking justifies the action)."
            )
        if self.rlvcr_expand and self.rlvcr_mode != "copo":
            raise ValueError(
                f"`rlvcr_expand` (True) needs `rlvcr_mode` = 'copo' (expansion rows carry CoPO advantages), "
                f"got `rlvcr_mode` = {self.rlvcr_mode!r}."
            )
        check_finite("rlvcr_alpha", self.rlvcr_alpha)
        for name in ("rlvcr_cost_max", "rlvcr_k", "advantage_std_floor"):
            check_finite(name, getattr(self, name))  # inf: NaN CoPO weights, no penalty difference, no saturation
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)!r}.")
        for name in (
            "rlvcr_max_thinking_tokens",
            "rlvcr_score_batch_size",
            "tracin_val_batch_size",
            "tracin_val_refresh_steps",
            "tracin_val_rollout_steps",
        ):
            check_integer(name, getattr(self, name), 1)
        check_integer(
            "tracin_val_num_generations",
            self.tracin_val_num_generations,
            2,
            "an integer >= 2 (with 1 every validation advantage is 0)",
        )
        if self.tracin_enabled and self.fp16:
            raise ValueError(
                "`tracin_enabled=True` does not support `fp16=True`: the TracIn scoring backward runs outside the "
                "loss scaler, so small per-row gradients would underflow. Use `bf16=True` or float32."
            )
        if self.tracin_enabled and self.fsdp:
            raise ValueError(
                f"`tracin_enabled=True` does not support FSDP (`fsdp={self.fsdp!r}`): the influence hooks do not "
                "handle FSDP-sharded LoRA weights. Use DeepSpeed ZeRO-2/3 or DDP."
            )
        check_finite("tracin_top_fraction", self.tracin_top_fraction)
        if not 0 < self.tracin_top_fraction <= 1:
            raise ValueError(f"`tracin_top_fraction` must be in (0, 1], got {self.tracin_top_fraction!r}.")
        check_integer("tracin_min_selected", self.tracin_min_selected, 0)
        self._validate_row_selection()
        copo_all = self.rlvcr_mode == "copo" and self.rlvcr_expand_steps == "all" and not self.rlvcr_expand
        if self.advantage_estimator == "rlvcr" and copo_all:
            warnings.warn(
                "`rlvcr_expand_steps='all'` with `rlvcr_mode='copo'` and no `rlvcr_expand` gives the advantages of "
                "'varied' (but in groups whose rewards differ by at most 1e-6): a group without reward spread has "
                "episode advantage 0 on every token, so expanding its steps costs generation and scoring for no "
                "gradient.",
                UserWarning,
                stacklevel=3,
            )
        # Seed 000 "Parameter Interactions": negatives need rollback.
        if self.save_negative_samples and not self.enable_tool_rollback:
            warnings.warn(
                "`save_negative_samples=True` has no effect without `enable_tool_rollback=True`: no negative samples "
                "will be saved (seed 000, 'Parameter Interactions').",
                UserWarning,
                stacklevel=3,
            )
        for on, budget in (
            ("enable_tool_rollback", "max_tool_retries"),
            ("save_negative_samples", "max_negative_samples_per_group"),
        ):
            if getattr(self, on) and getattr(self, budget) == 0:
                warnings.warn(f"`{on}=True` does nothing with `{budget}=0`.", UserWarning, stacklevel=3)
