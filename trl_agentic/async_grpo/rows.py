"""Training rows of one asynchronous trajectory and the advantages of a group's rows: pure functions, no model.

A trajectory run by trl-agentic's rollout loop (`trl_agentic.rollout.loop.AgenticRolloutLoop`) gives TRL's worker
one row per conversation segment plus its extra rows, as `AgenticSequence`s (TRL's `TrainingSequence` with the row's
kind): the regular row (the last segment), then the loop's `ExtraRow`s (negative samples, earlier snapshot segments)
in the loop's order. A row's `completion_mask` is TRL's: 1 on tokens the model generated (`tool_mask == 1`), 0 on the
prompt and on environment tokens; `old_log_probs` are vLLM's sampling log-probs there and 0 elsewhere.

`group_row_advantages` gives every row of a group its reward and advantage with the synchronous trainer's rules
(`trl_agentic.batch.BatchAugmenter`, steps 1-2): a negative row's reward is `negative_sample_rewards` of its error
types, a snapshot row's the episode's reward plus the optional `snapshot_reward_func` term; the per-group cap
`max_negative_samples_per_group` keeps the earliest negatives (`cap_order`: by the loop iteration that saved them,
as the synchronous loop does); the baseline is `group_baseline` /
`snapshot_advantage`; the advantages come from the configured estimator through the estimator protocol
(`trl_agentic.estimators`, `grpo_estimator` = `group_advantages`), and a negative row's advantage is clamped at 0.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

import torch

from ..advantages import DEFAULT_STD_FLOOR, negative_sample_rewards
from ..batch import baseline_mask, kept_negatives
from ..estimators import AdvantageBatch, grpo_estimator
from ..rollout.types import ExtraRow, RowKind
from .compat import worker_module

__all__ = [
    "AgenticSequence",
    "GroupRows",
    "advantage_batch",
    "group_row_advantages",
    "is_truncated",
    "pushed_rows",
    "row_from_tokens",
    "score_group_rows",
    "segment_info",
    "sequences_from_loop",
    "trajectory_rows",
    "trained_rows",
]

TrainingSequence = worker_module().TrainingSequence


@dataclass
class AgenticSequence(TrainingSequence):
    """TRL's `TrainingSequence` (one training row) with what trl-agentic's advantage rules need.

    Attributes:
        kind: `RowKind` of the row (regular, negative, snapshot).
        error_types: A negative row's error type names (its reward: `negative_sample_rewards`).
        segment_index: The row's segment in its episode (0 = first).
        tokens_freed: A snapshot row's context tokens freed by the deletion that closed it.
        policy_versions: `(first, last)` policy version that generated a turn of the trajectory.
        lost: The rollout was lost to an infrastructure failure (unscorable, not trained on).
        iteration: A negative row's `ExtraRow.iteration` (the order in which the per-group cap keeps negatives).
        truncated: The regular row's completion was cut by the budget (`is_truncated`).
        prompt_length: Tokens of the row's prompt (-1: unknown). A segment's completion can begin with environment
            tokens (a rollback hint before its first turn), so its first trained token is not where its prompt ends.
    """

    kind: int = int(RowKind.REGULAR)
    error_types: list[str] = field(default_factory=list)
    segment_index: int = 0
    tokens_freed: int = 0
    policy_versions: tuple = (0, 0)
    lost: bool = False
    iteration: int = 0
    truncated: bool = False
    prompt_length: int = -1


def is_truncated(completion_ids, stop_token_ids) -> bool:
    """TRL's test of a completion cut by `max_completion_length` (`GRPOTrainer`'s `mask_truncated_completions`): its
    last token is neither an EOS nor the pad token. The worker applies it to a trajectory's whole completion (model and
    tool tokens, as the synchronous trainer's row); TRL's `completions/clipped_ratio` applies it to the model's tokens
    only, so a trajectory ending on a tool result that filled the budget is truncated here but not clipped there."""
    # An empty completion is not truncated (`GRPOTrainer` never sees one: its test would fail on it).
    return bool(completion_ids) and completion_ids[-1] not in stop_token_ids


def row_from_tokens(prompt_ids, completion_ids, tool_mask, logprobs) -> tuple[list[int], list[int], list[float]]:
    """`(input_ids, completion_mask, old_log_probs)` of TRL's row layout from trl-agentic's prompt / completion split."""
    n = len(completion_ids)
    if len(tool_mask) != n:
        raise ValueError(f"tool_mask has {len(tool_mask)} entries for {n} completion tokens")
    lps = [0.0 if lp is None or (isinstance(lp, float) and math.isnan(lp)) else float(lp) for lp in (logprobs or [])]
    if logprobs is None:
        lps = [0.0] * n
    if len(lps) != n:
        raise ValueError(f"logprobs has {len(lps)} entries for {n} completion tokens")
    mask = [int(m) for m in tool_mask]
    return (
        list(prompt_ids) + list(completion_ids),
        [0] * len(prompt_ids) + mask,
        [0.0] * len(prompt_ids) + [lp if m else 0.0 for lp, m in zip(lps, mask)],
    )


def sequences_from_loop(
    prompt_ids: list[int],
    completion_ids: list[int],
    tool_mask: list[int],
    logprobs: list[float] | None,
    extra_rows: list[ExtraRow],
    rollout_id: str,
    last_segment: int = 0,
) -> list[AgenticSequence]:
    """The training rows of one trajectory: the regular row (last segment) first, then the loop's extra rows."""

    def sequence(prompt, completion, mask, lps, **fields) -> AgenticSequence:
        ids, mask, lps = row_from_tokens(prompt, completion, mask, lps)
        return AgenticSequence(ids, mask, lps, rollout_id, prompt_length=len(prompt), **fields)

    rows = [
        sequence(
            prompt_ids, completion_ids, tool_mask, logprobs, kind=int(RowKind.REGULAR), segment_index=last_segment
        )
    ]
    for e in extra_rows:
        rows.append(
            sequence(
                e.prompt_ids,
                e.completion_ids,
                e.tool_mask,
                e.logprobs,
                kind=int(e.kind),
                error_types=list(e.error_types),
                segment_index=e.segment_index,
                tokens_freed=e.tokens_freed,
                iteration=e.iteration,
            )
        )
    return rows


def trajectory_rows(prompt_ids: list[int], trl_tuple: tuple, result, stop_token_ids) -> list[AgenticSequence]:
    """The rows of one trajectory run by trl-agentic's loop (one rollout): `sequences_from_loop` on the loop's TRL
    tuple and `LoopResult`, the regular row marked `lost` (an infrastructure failure) and `truncated` (TRL's rule on
    the whole completion)."""
    tool_mask, _, completion_ids, logprobs, *_ = trl_tuple
    rows = sequences_from_loop(
        prompt_ids,
        completion_ids[0],
        tool_mask[0],
        logprobs[0],
        result.extra_rows,
        uuid.uuid4().hex,
        last_segment=result.num_segments[0] - 1,
    )
    rows[0].lost = bool(result.infra_failed[0])
    rows[0].truncated = is_truncated(completion_ids[0], stop_token_ids)
    return rows


def segment_info(row: AgenticSequence, dataset_row: dict) -> dict:
    """What `snapshot_reward_func` gets for a snapshot row, as the synchronous trainer passes it (`segment_info`):
    the segment's prompt and completion ids, its tool mask, index and freed tokens, and the dataset row (with the
    prompt the model saw)."""
    start = getattr(row, "prompt_length", -1)
    if start < 0:  # a row made elsewhere: its prompt ends before its first trained token
        start = next((k for k, m in enumerate(row.completion_mask) if m), len(row.input_ids))
    return {
        "prompt_ids": row.input_ids[:start],
        "completion_ids": row.input_ids[start:],
        "tool_mask": row.completion_mask[start:],
        "segment_index": row.segment_index,
        "tokens_freed": row.tokens_freed,
        "row": dataset_row,
    }


def advantage_batch(
    rows: list[dict],
    rewards: torch.Tensor,
    group_ids,
    baseline,
    kinds,
    episodes,
    scale: str,
    std_floor: float = DEFAULT_STD_FLOOR,
):
    """An `AdvantageBatch` for rows given as `{"input_ids", "completion_mask"}` in TRL's layout.

    `episodes` are conversation ids; the batch's `episode_ids` are the positions of each conversation's regular row
    (what an estimator anchors an extra row to, as in the synchronous trainer, where a rollout's row index is its
    episode id), -1 for a conversation without one.

    The prompt of a row is everything before its first trained token (left-padded), the completion the rest
    (right-padded); `tool_mask` is the completion part of `completion_mask` (1 on padding, as TRL pads it),
    `completion_mask` (attention) is 1 on the completion's real tokens.
    """
    prompts, completions, tool_masks = [], [], []
    for row in rows:
        ids, mask = [int(t) for t in row["input_ids"]], [int(m) for m in row["completion_mask"]]
        start = next((k for k, m in enumerate(mask) if m), len(ids))
        prompts.append(ids[:start])
        completions.append(ids[start:])
        tool_masks.append(mask[start:])
    n = len(rows)
    p_w = max([len(p) for p in prompts] + [1])
    c_w = max([len(c) for c in completions] + [1])
    prompt_ids = torch.zeros(n, p_w, dtype=torch.long)
    prompt_mask = torch.zeros(n, p_w, dtype=torch.long)
    completion_ids = torch.zeros(n, c_w, dtype=torch.long)
    completion_mask = torch.zeros(n, c_w, dtype=torch.long)
    tool_mask = torch.ones(n, c_w, dtype=torch.long)  # TRL pads `tool_mask` with 1 (the completion mask hides it)
    for i in range(n):
        p, c = prompts[i], completions[i]
        if p:
            prompt_ids[i, p_w - len(p) :] = torch.tensor(p)
            prompt_mask[i, p_w - len(p) :] = 1
        if c:
            completion_ids[i, : len(c)] = torch.tensor(c)
            completion_mask[i, : len(c)] = 1
            tool_mask[i, : len(c)] = torch.tensor(tool_masks[i])
    return AdvantageBatch(
        rewards=rewards,
        group_ids=torch.as_tensor(group_ids, dtype=torch.long),
        baseline_mask=torch.as_tensor(baseline, dtype=torch.bool),
        row_kind=torch.as_tensor(kinds, dtype=torch.long),
        episode_ids=torch.tensor(regular_positions(kinds, episodes), dtype=torch.long),
        local_index=torch.arange(n),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        tool_mask=tool_mask,
        loss_mask=completion_mask * tool_mask,
        scale=scale,
        std_floor=std_floor,
    )


def regular_positions(kinds, episodes) -> list[int]:
    """For each row, the position of its conversation's regular row (-1 when the conversation has none here)."""
    kinds, episodes = [int(k) for k in kinds], [int(e) for e in episodes]
    first = {}
    for k, (kind, episode) in enumerate(zip(kinds, episodes)):
        if kind == RowKind.REGULAR:
            first.setdefault(episode, k)
    return [first.get(episode, -1) for episode in episodes]


@dataclass
class GroupRows:
    """The rows of one group after `group_row_advantages`.

    Attributes:
        keep: Per input row, whether it stays (a negative beyond `max_negative_samples_per_group` does not).
        rewards: Reward of each kept row.
        kinds / episodes: `RowKind` and conversation index of each kept row.
        baseline: Whether each kept row enters the group statistics.
        advantages: `(K,)` advantages of the kept rows.
    """

    keep: list[bool]
    rewards: torch.Tensor
    kinds: torch.Tensor
    episodes: torch.Tensor
    baseline: torch.Tensor
    advantages: torch.Tensor


def clamp_negatives(advantages: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
    """A failed attempt is never reinforced (`BatchAugmenter`): a negative row's advantage is at most 0."""
    negative = kinds == RowKind.NEGATIVE
    if advantages.dim() == 2:
        negative = negative.unsqueeze(1)
    return torch.where(negative, advantages.clamp(max=0), advantages)


def group_row_advantages(
    conversation_rewards: list[float],
    row_conversation: list[int],
    row_kinds: list[int],
    row_error_types: list[list[str]],
    args,
    segment_terms: list[float] | None = None,
    cap_order: list | None = None,
) -> GroupRows:
    """Rewards and advantages of one group's rows with the synchronous trainer's rules (module docstring).

    Args:
        conversation_rewards: Reward of each conversation (rollout) of the group; NaN = unscorable.
        row_conversation / row_kinds / row_error_types: Per row, its conversation, `RowKind` and error types.
        args: The config (`negative_sample_reward`, `negative_reward_by_error`, `max_negative_samples_per_group`,
            `group_baseline`, `snapshot_advantage`, `scale_rewards`).
        segment_terms: Per row, the `snapshot_reward_func` term of a snapshot row (0 elsewhere).
        cap_order: Per row, a sort key: `max_negative_samples_per_group` keeps the negatives that sort first (ties
            and `None`: row order).
    """
    negative_rows = [k for k, kind in enumerate(row_kinds) if kind == RowKind.NEGATIVE]
    # The synchronous trainer's rule on one group (every row's "rollout" key below the group size): sort, then cap.
    keys = [((cap_order[k] if cap_order is not None else 0), k) for k in negative_rows]
    kept = kept_negatives(keys, group_size=len(row_kinds) + 1, cap=args.max_negative_samples_per_group)
    capped = {k for k, ok in zip(negative_rows, kept) if ok}
    keep, rewards, kinds, episodes = [], [], [], []
    for k, (conv, kind) in enumerate(zip(row_conversation, row_kinds)):
        ok = True
        if kind == RowKind.NEGATIVE:
            ok = k in capped
            value = negative_sample_rewards(
                [row_error_types[k]], args.negative_sample_reward, args.negative_reward_by_error
            )[0]
        else:  # regular and snapshot rows: the episode's reward (plus a snapshot's segment term)
            value = conversation_rewards[conv] + (segment_terms[k] if segment_terms else 0.0)
        keep.append(ok)
        if ok:
            rewards.append(value)
            kinds.append(int(kind))
            episodes.append(conv)
    rewards_t = torch.tensor(rewards, dtype=torch.float32)
    kinds_t = torch.tensor(kinds, dtype=torch.long)
    baseline = baseline_mask(kinds_t, args)
    batch = AdvantageBatch(
        rewards=rewards_t,
        group_ids=torch.zeros(len(rewards), dtype=torch.long),
        baseline_mask=baseline,
        row_kind=kinds_t,
        # Anchors are row positions: an extra row outside the baseline is measured from its conversation's regular row.
        episode_ids=torch.tensor(regular_positions(kinds, episodes), dtype=torch.long),
        local_index=torch.arange(len(rewards)),
        prompt_ids=torch.zeros(len(rewards), 0, dtype=torch.long),
        prompt_mask=torch.zeros(len(rewards), 0, dtype=torch.long),
        completion_ids=torch.zeros(len(rewards), 0, dtype=torch.long),
        completion_mask=torch.zeros(len(rewards), 0, dtype=torch.long),
        tool_mask=torch.zeros(len(rewards), 0, dtype=torch.long),
        loss_mask=torch.zeros(len(rewards), 0, dtype=torch.long),
        scale=args.scale_rewards,
        std_floor=args.advantage_std_floor,
    )
    advantages = clamp_negatives(grpo_estimator(batch), kinds_t)
    return GroupRows(keep, rewards_t, kinds_t, torch.tensor(episodes, dtype=torch.long), baseline, advantages)


def trained_rows(
    keep: list[bool], row_kinds: list[int], row_lost: list[bool], row_has_tokens: list[bool]
) -> list[tuple[int, int]]:
    """`(row, kept position)` of the rows that are trained, as the synchronous trainer decides (`_untrained_rows`).

    A kept row is trained unless `row_lost` marks it (its conversation was lost to an infrastructure failure, or
    masked by `mask_truncated_completions`: its regular row and its snapshot rows) or it has no trained token. A conversation that is merely
    unscorable (every reward function gave None: NaN, advantage 0) is not lost: it is trained, as in both trainers.
    A negative row is its own complete turn with its own reward: it is trained even when its conversation was lost
    later, as in the synchronous trainer. A kept row that is not trained still counted in the group's statistics
    when it had a reward (a row without a trained token; not a lost rollout, whose reward is NaN).
    """
    out, j = [], 0
    for k, (kept, kind) in enumerate(zip(keep, row_kinds)):
        if not kept:
            continue
        if row_has_tokens[k] and not (row_lost[k] and kind != RowKind.NEGATIVE):
            out.append((k, j))
        j += 1
    return out


def score_group_rows(
    rows: list[AgenticSequence],
    row_conversation: list[int],
    row_rewards: list[float],
    num_conversations: int,
    args,
    segment_terms: list[float] | None = None,
    mask_truncated: bool = False,
) -> tuple[GroupRows, list[tuple[int, int]]]:
    """What the async worker does with a scored group: `group_row_advantages`, then `trained_rows`.

    With `mask_truncated` (`mask_truncated_completions`) a conversation whose regular row is `truncated` is handled as
    the synchronous trainer handles a row TRL masked (`BatchAugmenter._untrained_rows`): its reward stays in the group
    statistics, its regular row and its snapshot rows (earlier segments) are not trained, its negative rows (complete
    turns of their own) are. The synchronous batch keeps the masked regular row with a zero completion mask, which
    weighs nothing in the asynchronous token-mean loss; here it is not pushed (TRL's packer cannot build a micro-batch
    of rows without a trained token).

    Args:
        rows: The group's rows in order (each conversation's regular row, then its extra rows).
        row_conversation: Per row, its conversation.
        row_rewards: Per row, the reward TRL stamped on it (its conversation's; NaN when unscorable).
        num_conversations: Conversations in the group.
        args / segment_terms: As for `group_row_advantages`. The per-group cap keeps the earliest negatives, by
            `iteration` (the synchronous loop's order; trajectories here each ran a loop of their own), ties broken by
            `rollout_id` (random: the synchronous loop breaks them by rollout index, not by which finished first).
    """
    rewards = [math.nan] * num_conversations
    lost = set()
    for row, conv, reward in zip(rows, row_conversation, row_rewards):
        if row.kind == RowKind.REGULAR:
            if row.lost:  # lost to infrastructure: unscorable and not trained
                lost.add(conv)
            rewards[conv] = math.nan if row.lost else reward
    masked = {
        c for row, c in zip(rows, row_conversation) if mask_truncated and row.kind == RowKind.REGULAR and row.truncated
    }
    kinds = [row.kind for row in rows]
    order = [(row.iteration, str(row.rollout_id)) for row in rows]
    scored = group_row_advantages(
        rewards, row_conversation, kinds, [row.error_types for row in rows], args, segment_terms, order
    )
    has_tokens = [any(row.completion_mask) for row in rows]
    # An episode whose last segment is not trained (lost, or masked) does not train its earlier segments either.
    trained = trained_rows(scored.keep, kinds, [c in lost or c in masked for c in row_conversation], has_tokens)
    return scored, trained


def pushed_rows(keep: list[bool], trained: list[tuple[int, int]], untrained: bool) -> list[tuple[int, int, bool]]:
    """`(row, kept position, trained)` of the rows the worker pushes: the trained ones; with `untrained` (an estimator
    runs on the trainer side) every kept row, as the synchronous trainer's estimator sees every row of its batch
    (a lost rollout's rows with their NaN reward, a row without a trained token); the stage drops them after it."""
    if not untrained:
        return [(k, j, True) for k, j in trained]
    trained_set = set(trained)
    kept = [k for k, ok in enumerate(keep) if ok]
    return [(k, j, (k, j) in trained_set) for j, k in enumerate(kept)]
