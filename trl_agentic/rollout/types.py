"""Plain data produced by the rollout loop: extra training rows and per-rollout bookkeeping.

The loop returns TRL's usual per-rollout lists for the *primary* row of each rollout (the last segment) and, beside
them, a list of `ExtraRow`s (negative samples and closed snapshot segments). Nothing here holds tensors or models, so
the trainer can gather these objects across processes with `gather_object`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class RowKind(IntEnum):
    """Kind of a training row, stored in the batch as the `row_kind` tensor."""

    REGULAR = 0
    NEGATIVE = 1
    SNAPSHOT = 2
    PADDING = 3  # zero-weight row added so that every rank has the same, divisible number of rows
    EXPANSION = 4  # row added by an advantage estimator (e.g. an RLVCR alternative thinking level)


@dataclass
class ExtraRow:
    """A training row produced by the loop besides a rollout's final segment.

    Attributes:
        kind: `RowKind.NEGATIVE` (a failed attempt saved before a rollback) or `RowKind.SNAPSHOT` (a segment closed
            by `delete_context`).
        parent: Index of the rollout this row comes from, in the local generation batch.
        prompt_ids / completion_ids / tool_mask / logprobs: Same meaning as TRL's per-rollout lists. `tool_mask` is 1
            on model-generated tokens and 0 on environment tokens; `logprobs` are the sampling log-probs (None when
            the backend gives none, e.g. transformers generation).
        segment_index: Position of a snapshot segment in its rollout (0 = first).
        error_types / error_messages / tool_calls / tool_position: Why a negative sample failed (seed 000 fields);
            `tool_position` is the assistant turn index (`turn_k`).
        tokens_freed: For a snapshot: context tokens removed by the deletion that closed it (the next turn's context
            before minus after).
        iteration: For a negative: the loop iteration that saved it (the rollout's generation calls after its first
            turn; a rollout with work generates once per iteration). The per-group cap
            `max_negative_samples_per_group` keeps the earliest negatives: in the loop, by iteration then rollout;
            in the asynchronous worker, whose trajectories each run a loop of their own, by this field.
        messages: The row's completion as messages (a negative: the failed turn and its error results; a snapshot:
            the segment's messages up to its `delete_context` call).
        prompt_messages: The row's prompt as messages (the conversation before the failed turn or the segment).
    """

    kind: RowKind
    parent: int
    prompt_ids: list[int]
    completion_ids: list[int]
    tool_mask: list[int]
    logprobs: list[float] | None
    segment_index: int = 0
    error_types: list[str] = field(default_factory=list)
    error_messages: list[str] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    tool_position: int = 0
    tokens_freed: int = 0
    iteration: int = 0
    messages: list[dict] = field(default_factory=list)
    prompt_messages: list[dict] = field(default_factory=list)


@dataclass
class LoopStats:
    """Counters of one call of the rollout loop (local to this process)."""

    tool_calls: int = 0
    tool_failures: int = 0  # calls that raised, unknown tools, timeouts, malformed calls (never a returned value)
    malformed_calls: int = 0
    truncated_outputs: int = 0  # tool outputs longer than `max_tool_output_chars`, cut before the model saw them
    rollback_attempts: int = 0
    rollback_recovered: int = 0  # rollbacks whose regenerated turn ran its tools without error
    rollback_exhausted: int = 0  # positions where the retry budget ran out and the error was kept
    negatives_saved: int = 0
    infra_retries: int = 0
    infra_failed_rollouts: int = 0
    snapshots: int = 0  # segments closed by delete_context (before downsampling)
    snapshot_rows: int = 0  # segments kept as training rows
    tokens_freed: int = 0
    generation_calls: int = 0
    dummy_generation_calls: int = 0
    regenerated_tokens: int = 0  # tokens generated again for rolled-back turns
    loop_seconds: float = 0.0  # wall time of the whole loop
    generate_seconds: float = 0.0  # ...spent in the generation backend
    tool_seconds: float = 0.0  # ...spent running tools (the rest is the loop's own overhead)
    failed_turn_tokens: int = 0  # tokens of the failed turns that were rolled back
    truncated_turns: int = (
        0  # turns cut by the completion budget or the per-turn cap (never rolled back or made negatives)
    )
    turn_cap_truncations: int = 0  # ...of which cut by `max_turn_tokens` (the per-turn cap) rather than the budget
    user_turns: int = 0  # user messages supplied by environments (`_next_user_turn`)
    user_turns_dropped: int = 0  # ...that did not fit in the completion budget (the rollout ended there)
    retired_environments: int = 0  # environments replaced after a call timed out (its thread may still run)
    hints_dropped: int = 0  # rollback hints left out: no budget or context left after them for the regenerated turn


@dataclass
class LoopResult:
    """What the loop returns besides TRL's 7-tuple (see `AgenticRolloutLoop.run`)."""

    extra_rows: list[ExtraRow]
    infra_failed: list[bool]
    num_segments: list[int]
    stats: LoopStats
    rollback_log: list[list[dict]]  # per rollout: one entry per rollback (turn, error types) for reports
    segment_starts: list[int] = field(default_factory=list)  # per rollout: index in its completion messages where
    # its last segment (the regular row) starts (0 unless it deleted context)
    tool_failed: list[list[bool]] = field(default_factory=list)  # per rollout: for each tool message of its last
    # segment, in order, whether the call failed (`trl_agentic.errors.tool_call_failed`)
