"""The variable-group data path: rows with explicit group ids, advantages across processes, padded batches.

`BatchAugmenter` runs after TRL's `_generate_and_score_completions` built the batch of regular rows (one per
rollout, `num_generations` per prompt). Its stages, in order (`BatchAugmenter.__call__`), each rule in one place:

1. `_regular_rewards`: the rollouts' rewards as TRL aggregates them; unscorable and infrastructure-lost rows are NaN;
2. `_gather_rows`: the extra rows of the rollout loop (negative samples, snapshot segments) gathered as small
   metadata with variable counts per process, `max_negative_samples_per_group` applied globally, every row's reward,
   episode and `group_id` (unique across processes);
3. `_baseline`: which rows enter their group's statistics (`group_baseline`, `snapshot_advantage`);
4. `_append_rows` / `_untrained_rows`: the local extra rows appended to the tensors (re-padded widths, old/ref
   log-probs and vLLM importance ratios computed like TRL's), the rows that are not trained zeroed;
5. `_estimate`: TRL's own advantages when the batch is one `GRPOTrainer` would train on, else the advantage estimator
   once on the gathered rewards/group ids (each process keeps its own rows);
6. `_assemble`: advantages (negatives clamped to <= 0), row ids, `counted_row`, and the estimator's own rows;
7. `_pad_and_count`: every process padded to the same row count, a multiple of `steps_per_generation`
   (`split_tensor_dict` silently drops a remainder), with zero-weight rows; `num_items_in_batch` and
   `num_rows_in_batch` (`counted_rows`, the one rule for which rows count) recomputed.

A stage that can raise on one process only ends at a synchronisation point (`trl_agentic.rank_errors`), so an error
on any process stops every process instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import importlib
import math
from collections import deque
from dataclasses import dataclass

import torch
from accelerate.utils import gather, gather_object
from transformers.utils import logging
from trl.trainer.utils import use_adapter

from .advantages import negative_sample_rewards, tied_rows
from .estimators import AdvantageBatch, EstimatorResult, grpo_estimator
from .rank_errors import error_summary, raise_on_every_rank
from .rollout.types import ExtraRow, RowKind

logger = logging.get_logger(__name__)

# Keys of TRL's output dict that are (B, T) per-token tensors, with their padding value.
_TOKEN_KEYS = {
    "completion_ids": None,  # pad token, set at run time
    "completion_mask": 0,
    "tool_mask": 1,  # TRL pads tool_mask with 1 (the completion mask hides it)
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
}


def _pad_to(x: torch.Tensor, width: int, value, side: str) -> torch.Tensor:
    if x.size(1) >= width:
        return x
    filler = x.new_full((x.size(0), width - x.size(1)), value)
    return torch.cat([filler, x] if side == "left" else [x, filler], dim=1)


def _stack(rows: list[list], width: int, value, side: str, dtype, device) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype, device=device)
    for k, row in enumerate(rows):
        if row:
            values = torch.tensor(row, dtype=dtype, device=device)
            if side == "left":
                out[k, width - len(row) :] = values
            else:
                out[k, : len(row)] = values
    return out


# Batch keys set by the augmenter itself (recomputed or extended after extra rows are appended).
_ROW_ID_KEYS = (
    "advantages",
    "num_items_in_batch",
    "num_rows_in_batch",
    "group_id",
    "row_kind",
    "episode_id",
    "segment_index",
    "counted_row",
)


def _check_mergeable(output: dict) -> None:
    """Refuse a batch whose keys extra rows cannot be appended to. Called on every process when any process has extra
    rows: the keys are the same everywhere, so every process raises here together."""
    known = {"prompt_ids", "prompt_mask", "importance_sampling_ratio", *_TOKEN_KEYS, *_ROW_ID_KEYS}
    for key in output:
        if key not in known:
            raise NotImplementedError(f"Extra rows cannot be combined with the batch key {key!r} (multimodal?).")


def _round_up(x: int, multiple: int | None) -> int:
    return x if not multiple else int(math.ceil(x / multiple) * multiple)


@dataclass
class _Failed:
    """What a process gathers in place of its payload when it failed (an exception may not pickle)."""

    error: str


def _raise_if_failed(gathered: list, local_error: BaseException | None) -> None:
    """Raise on every process when any process failed: its own error on that process, a `RuntimeError` elsewhere."""
    if local_error is not None:
        raise local_error
    failed = {rank: p.error for rank, p in enumerate(gathered) if isinstance(p, _Failed)}
    if failed:
        raise RuntimeError(f"Stopped because the batch augmentation failed on another process: {failed}")


@dataclass
class _Rows:
    """Every row of the generation batch over every process: the regular rows in global rollout order, then each
    process's kept extra rows in process order. `local_index` gives this process's rows (regular, then extra) in these
    `(N,)` tensors; `local_extras` are its kept extra rows."""

    rewards: torch.Tensor
    kinds: torch.Tensor
    parents: torch.Tensor  # the episode: global index of the rollout (its regular row)
    groups: torch.Tensor  # the prompt group: parent // group size
    local_index: torch.Tensor
    local_extras: list[ExtraRow]


def counted_rows(batch: dict) -> torch.Tensor:
    """
    Which rows of a batch count: the one rule behind `num_rows_in_batch` (the per-row losses' denominator,
    `loss_weights.py`) and TracIn's row counts (`tracin/trainer_mixin.py`).

    A row counts unless it is a padding row or a row that is not trained (`counted_row` False: a rollout lost to
    infrastructure, and the earlier segments of an episode whose last segment is not trained). A regular row that TRL
    itself masks (`mask_truncated_completions`) still counts, as it does in TRL's own per-row mean.

    Args:
        batch (`dict`): A batch (or micro-batch) built by `BatchAugmenter`; without its keys every row counts.

    Returns:
        `torch.Tensor`: `(B,)` bool.
    """
    rows = batch["prompt_ids"].size(0)
    counted = batch.get("counted_row")
    counted = torch.ones(rows, dtype=torch.bool, device=batch["prompt_ids"].device) if counted is None else counted
    if "row_kind" in batch:
        counted = counted.bool() & (batch["row_kind"] != RowKind.PADDING)
    return counted.bool()


def row_advantages(batch: dict) -> torch.Tensor:
    """Each row's advantage as logs show it: the `(B,)` advantages, or token-level ones averaged over the row's
    trained tokens (not the padded width: a row's padding and masked tokens hold 0)."""
    advantages = batch["advantages"].float()
    if advantages.dim() == 1:
        return advantages
    mask = (batch["completion_mask"] * batch.get("tool_mask", 1)).float()
    return (advantages * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def check_estimate(result, num_rows: int, width: int):
    """What an advantage estimator returned, checked: `(advantages, extra rows, their advantages)`."""
    if isinstance(result, EstimatorResult):
        advantages, rows, extra = result.advantages, list(result.extra_rows), result.extra_advantages
    else:
        advantages, rows, extra = result, [], None
    if not isinstance(advantages, torch.Tensor) or advantages.dim() not in (1, 2) or advantages.size(0) != num_rows:
        shape = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"The advantage estimator returned {shape}; it must return ({num_rows},) or ({num_rows}, T).")
    if advantages.dim() == 2 and advantages.size(1) != width:
        raise ValueError(
            f"The advantage estimator returned shape {tuple(advantages.shape)}; token-level advantages must have "
            f"width {width}."
        )
    if rows and (extra is None or extra.size(0) != len(rows)):
        raise ValueError("An EstimatorResult with extra rows needs one advantage per extra row.")
    if rows:
        # Checked here, before the estimator stage's synchronisation point: `_append_estimator_rows` indexes the
        # batch with the parents (a negative one would silently pick another row's group) and re-pads the advantages.
        bad = [r.parent for r in rows if not isinstance(r.parent, int) or not 0 <= r.parent < num_rows]
        if bad:
            raise ValueError(
                f"An extra row's parent must be a local row index in [0, {num_rows}), got parent {bad[0]}."
            )
        if extra.dim() not in (1, 2):
            raise ValueError(f"Extra rows' advantages must have shape (K,) or (K, T), got {tuple(extra.shape)}.")
        widest = max([width] + [len(r.completion_ids) for r in rows])
        if extra.dim() == 2 and extra.size(1) > widest:
            raise ValueError(
                f"Extra rows' token-level advantages have width {extra.size(1)}, more than the widest row ({widest})."
            )
    return advantages, rows, extra


def kept_negatives(negatives: list[tuple[int, int]], group_size: int, cap: int) -> list[bool]:
    """Which negative rows the per-group cap `max_negative_samples_per_group` keeps, over every process's rows.

    `negatives` are `(iteration, rollout)` in any order: the loop iteration that saved the row (`ExtraRow.iteration`)
    and its rollout's global index (its group: `rollout // group_size`). A group keeps its `cap` earliest ones, by
    iteration then rollout, which is the order one process's loop saves them in. Each process's loop already keeps
    only its own earliest `cap`, and the earliest `cap` of a group are among those, so the rows kept do not depend on
    how the group's rollouts were split across processes.
    """
    order = sorted(range(len(negatives)), key=lambda k: negatives[k])
    keep, count = [False] * len(negatives), {}
    for k in order:
        group = negatives[k][1] // group_size
        if count.get(group, 0) < cap:
            keep[k], count[group] = True, count.get(group, 0) + 1
    return keep


def snapshot_reward(path: str | None):
    """The `snapshot_reward_func` callable named `"module:function"` (None: no term). Both trainers call it before the
    model loads, so that a path that does not import is an error naming the field there, not in the batch (or, in the
    asynchronous trainer, in the rollout worker's child process, whose traceback reaches only its stderr)."""
    if not path:
        return None
    module, _, attr = path.partition(":")
    try:
        function = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"`snapshot_reward_func={path!r}` cannot be imported: {type(error).__name__}: {error}"
        ) from error
    if not callable(function):
        raise ValueError(f"`snapshot_reward_func={path!r}` is not callable (a {type(function).__name__}).")
    return function


def baseline_mask(kinds: torch.Tensor, args) -> torch.Tensor:
    """The rows entering their group's statistics, in the synchronous batch and the asynchronous rows alike: the
    rollouts, plus the negatives with `group_baseline="all_rows"`, plus the snapshot segments with
    `snapshot_advantage="row"` (two independent choices)."""
    baseline = kinds == RowKind.REGULAR
    if args.group_baseline == "all_rows":
        baseline = baseline | (kinds == RowKind.NEGATIVE)
    if args.snapshot_advantage == "row":
        baseline = baseline | (kinds == RowKind.SNAPSHOT)
    return baseline


def mark_padding(batch: dict, rows: torch.Tensor) -> dict:
    """`batch` with `rows` (`(B,)` bool) made zero-weight padding rows: no token of theirs reaches the loss (masks and
    advantages 0), they do not count (`counted_row`), their kind is `RowKind.PADDING` and their ids -1. The keys present
    are changed; the others are left out."""
    out = dict(batch)
    for key, fill in (
        ("completion_mask", 0),
        ("tool_mask", 0),
        ("advantages", 0),
        ("counted_row", 0),
        ("row_kind", int(RowKind.PADDING)),
        ("group_id", -1),
        ("episode_id", -1),
        ("segment_index", -1),
    ):
        if key in out:
            value = out[key]
            out[key] = value.masked_fill(rows.to(value.device).reshape(-1, *[1] * (value.dim() - 1)), fill)
    return out


def negative_not_a_penalty(rewards: torch.Tensor, group_ids: torch.Tensor, kinds: torch.Tensor) -> str | None:
    """The warning to give when a negative row's reward is not below every episode of its group, else None: its
    advantage is clamped to 0, but in the baseline (`group_baseline="all_rows"`) it still lowers every episode's
    advantage. Used by both trainers (the asynchronous one per group, on the trainer side)."""
    negative = kinds == RowKind.NEGATIVE
    if not bool(negative.any()):
        return None
    for g in group_ids[negative].unique().tolist():
        episodes = rewards[(group_ids == g) & (kinds == RowKind.REGULAR)]
        penalties = rewards[(group_ids == g) & negative]
        if episodes.numel() and bool((penalties >= episodes.min()).any()):
            return (
                f"A negative sample's reward ({penalties.max().item():g}) is not below the rewards of its group's "
                f"episodes (lowest {episodes.min().item():g}): it is not a penalty. Its advantage "
                "is clamped to 0 (with `group_baseline='all_rows'` it also moves the group's baseline): the failed "
                "attempt is not pushed down. Set `negative_sample_reward` below the task's reward range."
            )
    return None


class BatchAugmenter:
    """Turns TRL's batch of regular rows plus the rollout loop's extra rows into the training batch.

    Args:
        trainer: The `AgenticGRPOTrainer` (for its config, accelerator, models and metric store).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        args = trainer.args
        self.segment_reward = snapshot_reward(args.snapshot_reward_func)
        self._warned_negative_reward = False
        # Per local row (regular, then extra; the batch's first rows) of the last batch: tied (`tied_rows`); None for
        # GDPO.
        self.last_tied_rows: torch.Tensor | None = None
        self.last_regular_rewards: torch.Tensor | None = None  # the last batch's, gathered (`_regular_rewards`)
        self._logged_extra_rows = 0  # extra rows the last batch added to TRL's completion logs

    def _warn_negative_reward_not_lowest(self, rewards, group_ids, kinds) -> None:
        """Warn once when a negative row's reward is not below every episode of its group (`negative_not_a_penalty`)."""
        if self._warned_negative_reward:
            return
        message = negative_not_a_penalty(rewards, group_ids, kinds)
        if message is not None:
            self._warned_negative_reward = True
            logger.warning(message)

    def __call__(self, output: dict, inputs: list[dict], rewards_per_func: torch.Tensor, loop_result) -> dict:
        """TRL's batch of regular rows plus the loop's extra rows → the training batch, in named stages (in order):

        1. `_regular_rewards`: the rollouts' rewards (NaN = unscorable or lost to infrastructure);
        2. `_gather_rows`: every row of the generation batch over every process, with its reward, group and episode;
        3. `_baseline`: which rows enter their group's statistics;
        4. `_append_rows` + `_untrained_rows`: the local tensors, and the rows that are not trained (loss mask 0);
        5. `_estimate`: the advantages (TRL's own when the batch is TRL's, else the estimator);
        6. `_assemble`: advantages and row ids into the batch, plus the estimator's rows;
        7. `_pad_and_count`: equal, divisible row counts on every process, and what the losses count
           (`num_items_in_batch`, `num_rows_in_batch`, from `counted_rows`).

        Every step that can fail on one process only ends at a synchronisation point (`rank_errors`), so an error on
        any process stops every process.
        """
        t, args = self.trainer, self.trainer.args
        self.last_tied_rows = None
        self.last_regular_rewards = None
        if args.multi_objective_aggregation != "sum_then_normalize":
            return output  # GDPO keeps TRL's advantages (the trainer refuses it with extra rows)
        mode = "train" if t.model.training else "eval"
        num_local = output["prompt_ids"].size(0)
        extras = loop_result.extra_rows if loop_result is not None else []
        infra_local = loop_result.infra_failed if loop_result is not None else [False] * num_local

        rewards, infra = self._regular_rewards(rewards_per_func, infra_local)
        self.last_regular_rewards = rewards  # for `row_selection`, which runs after (lost rollouts are NaN)
        rows = self._gather_rows(extras, rewards, inputs, num_local, mode)
        baseline = self._baseline(rows.kinds)
        # The local rows whose advantage is 0 in exact arithmetic (`tied_rows`, decided over every process), for
        # TracIn's validation direction.
        self.last_tied_rows = tied_rows(rows.rewards, rows.groups, baseline)[rows.local_index]
        if rows.kinds.numel() > num_local * t.accelerator.num_processes:
            _check_mergeable(output)
        batch = self._append_rows(output, rows.local_extras, t.accelerator.device)
        untrained = self._untrained_rows(output, infra_local, rows.local_extras)
        if bool(untrained.any()):
            batch["tool_mask"] = batch["tool_mask"].masked_fill(untrained.unsqueeze(1), 0)
        advantages, est_rows, est_adv = self._estimate(output, batch, rows, baseline, infra, num_local)
        batch = self._assemble(batch, rows, advantages, untrained, loop_result, num_local, est_rows, est_adv)
        batch = self._pad_and_count(batch, mode)
        self._log_metrics(mode, batch, loop_result, rows.groups, rows.kinds)
        self._log_trained_rows(batch, num_local, rows.local_extras, loop_result, inputs)
        return batch

    # --------------------------------------------------------------------------------------------------- stages
    def _regular_rewards(self, rewards_per_func: torch.Tensor, infra_local: list[bool]):
        """1. The regular rows' rewards over every process, aggregated as TRL does (weighted `nansum`); a row every
        reward function skipped is unscorable and a rollout lost to infrastructure has no reward: both NaN."""
        t = self.trainer
        device = t.accelerator.device
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        rewards = (rewards_per_func * t.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        infra = gather(torch.tensor(infra_local, dtype=torch.bool, device=device))
        rewards[infra] = torch.nan
        return rewards, infra

    def _gather_rows(
        self, extras: list[ExtraRow], rewards: torch.Tensor, inputs: list[dict], num_local: int, mode: str
    ):
        """2. Every row of the generation batch on every process: the regular rows (global rollout order), then each
        process's kept extra rows (negatives capped per group by `max_negative_samples_per_group`, across processes as
        one process would: `kept_negatives`). The metadata is gathered with variable counts per process (small Python
        objects)."""
        t, args = self.trainer, self.trainer.args
        device = t.accelerator.device
        nproc, rank = t.accelerator.num_processes, t.accelerator.process_index
        group_size = t.num_generations if mode == "train" else t.num_generations_eval
        local_error = None
        try:
            local_meta = [
                (int(e.kind), rank * num_local + e.parent, e.error_types, self._segment_term(e, inputs), e.iteration)
                for e in extras
            ]
        except Exception as e:  # noqa: BLE001 - e.g. a failing snapshot_reward_func: raised on every process below
            local_error, local_meta = e, _Failed(error_summary(e))
        all_meta = gather_object([local_meta]) if nproc > 1 else [local_meta]
        _raise_if_failed(all_meta, local_error)
        kinds = [int(RowKind.REGULAR)] * (num_local * nproc)
        parents = list(range(num_local * nproc))
        extra_rewards: list[float] = []
        owners: list[int] = []
        keep: list[bool] = []
        negatives = [(m[4], m[1]) for metas in all_meta for m in metas if m[0] == RowKind.NEGATIVE]
        capped = iter(kept_negatives(negatives, group_size, args.max_negative_samples_per_group))
        for owner, metas in enumerate(all_meta):
            for kind, parent, error_types, term, _ in metas:
                ok = True
                if kind == RowKind.NEGATIVE:  # the per-group cap across processes: as one process would keep them
                    ok = next(capped)
                    value = negative_sample_rewards(
                        [error_types], args.negative_sample_reward, args.negative_reward_by_error
                    )[0]
                else:  # snapshot: the episode's reward (StateLM), plus an optional per-segment term
                    value = rewards[parent].item() + term
                keep.append(ok)
                if ok:
                    kinds.append(kind)
                    parents.append(parent)
                    extra_rewards.append(value)
                    owners.append(owner)
        local_extras = [e for e, ok in zip(extras, self._own_keep(keep, all_meta, rank)) if ok]
        first_extra = num_local * nproc + sum(1 for o in owners if o < rank)
        parent_t = torch.tensor(parents, device=device)
        return _Rows(
            rewards=torch.cat([rewards, torch.tensor(extra_rewards, dtype=rewards.dtype, device=device)]),
            kinds=torch.tensor(kinds, device=device),
            parents=parent_t,
            groups=parent_t // group_size,
            local_index=torch.cat(
                [
                    torch.arange(rank * num_local, (rank + 1) * num_local, device=device),
                    torch.arange(first_extra, first_extra + len(local_extras), device=device),
                ]
            ),
            local_extras=local_extras,
        )

    def _baseline(self, kinds: torch.Tensor) -> torch.Tensor:
        """3. The rows that enter their group's mean and std (`baseline_mask`). The others are measured from their
        episode (`group_advantages`)."""
        return baseline_mask(kinds, self.trainer.args)

    def _untrained_rows(self, output: dict, infra_local: list[bool], local_extras: list[ExtraRow]) -> torch.Tensor:
        """4. The local rows (regular, then extra) that are not trained: a rollout lost to infrastructure, and the
        earlier segments (snapshot rows) of an episode whose last segment is not trained (lost, or a truncated one
        TRL masked: `mask_truncated_completions` zeroes the completion mask of a row cut by the budget). A negative
        row is its own complete turn and keeps its loss. These rows do not count either (`counted_rows`)."""
        untrained = list(infra_local)
        if self.trainer.args.mask_truncated_completions:
            masked = (output["completion_mask"].sum(dim=1) == 0).tolist()
            untrained = [a or b for a, b in zip(untrained, masked)]
        lost = list(infra_local) + [e.kind == RowKind.SNAPSHOT and untrained[e.parent] for e in local_extras]
        return torch.tensor(lost, dtype=torch.bool, device=self.trainer.accelerator.device)

    def _estimate(self, output: dict, batch: dict, rows: _Rows, baseline: torch.Tensor, infra, num_local: int):
        """5. The advantages of this process's rows, `(B,)` or `(B, T)`, and the estimator's own extra rows.

        When the batch is one `GRPOTrainer` would train on (`_trl_advantages_hold`), TRL's own advantages; else the
        estimator on the gathered rewards. The estimator and the checks of what it returned run before a
        synchronisation point: a failure on one process stops every process there.
        """
        t, args = self.trainer, self.trainer.args
        estimator_batch = AdvantageBatch(
            rewards=rows.rewards,
            group_ids=rows.groups,
            baseline_mask=baseline,
            row_kind=rows.kinds,
            episode_ids=rows.parents,
            local_index=rows.local_index,
            prompt_ids=batch["prompt_ids"],
            prompt_mask=batch["prompt_mask"],
            completion_ids=batch["completion_ids"],
            completion_mask=batch["completion_mask"],
            tool_mask=batch["tool_mask"] if "tool_mask" in batch else torch.ones_like(batch["completion_mask"]),
            loss_mask=batch["completion_mask"] * batch.get("tool_mask", 1),
            scale=t.scale_rewards,
            std_floor=args.advantage_std_floor,
        )
        num_extra = rows.kinds.numel() - num_local * t.accelerator.num_processes
        result = est_rows = est_adv = error = None
        try:
            if self._trl_advantages_hold(t, num_extra, infra):
                # Features off in this batch: TRL's own advantages, exactly as `GRPOTrainer` computed them.
                result = output["advantages"]
            else:
                result = t.advantage_estimator(estimator_batch, t)
            result, est_rows, est_adv = check_estimate(
                result, batch["prompt_ids"].size(0), batch["completion_ids"].size(1)
            )
            if est_rows:
                _check_mergeable(output)
        except Exception as e:  # noqa: BLE001 - re-raised on every process (e.g. a custom estimator's bug on one rank)
            error = e
        raise_on_every_rank(t.accelerator, error, "the advantage estimator")
        return result, est_rows, est_adv

    def _assemble(self, batch, rows: _Rows, advantages, untrained, loop_result, num_local: int, est_rows, est_adv):
        """6. The advantages (a negative row's clamped to <= 0), the row ids (`group_id`, `row_kind`, `episode_id`,
        `segment_index`, `counted_row`) and the estimator's rows."""
        t = self.trainer
        device = t.accelerator.device
        # A failed attempt is never reinforced: with custom rewards, regular rows can score below the negative reward,
        # and the group statistics would then give the negative row a positive advantage.
        self._warn_negative_reward_not_lowest(rows.rewards, rows.groups, rows.kinds)
        negative = rows.kinds[rows.local_index] == RowKind.NEGATIVE
        if advantages.dim() == 2:
            negative = negative.unsqueeze(1)
        advantages = torch.where(negative.to(advantages.device), advantages.clamp(max=0), advantages)
        batch["advantages"] = advantages.to(device=device, dtype=torch.float32)
        batch["group_id"] = rows.groups[rows.local_index]
        batch["row_kind"] = rows.kinds[rows.local_index]
        # The episode (global rollout index) of every row and the row's segment in it (0 = first; a rollout's
        # regular row is its last segment). is_snapshot is `row_kind == RowKind.SNAPSHOT`.
        batch["episode_id"] = rows.parents[rows.local_index]
        last_segments = [n - 1 for n in loop_result.num_segments] if loop_result is not None else [0] * num_local
        batch["segment_index"] = torch.tensor(
            last_segments + [e.segment_index for e in rows.local_extras], dtype=torch.long, device=device
        )
        batch["counted_row"] = ~untrained
        if est_rows or self._forwards_are_collective(batch):
            # Even without rows of its own, a process joins the others' log-prob forward passes (see _append_rows).
            batch = self._append_estimator_rows(batch, est_rows, est_adv, device)
        return batch

    def _pad_and_count(self, batch: dict, mode: str) -> dict:
        """7. Every process ends with the same number of rows, a multiple of `steps_per_generation` (TRL's
        `split_tensor_dict` silently drops a remainder), with zero-weight padding rows; then the counts the losses
        divide by: `num_items_in_batch` (trained tokens) and `num_rows_in_batch` (`counted_rows`), over every process."""
        t, args = self.trainer, self.trainer.args
        local_rows = torch.tensor([batch["prompt_ids"].size(0)], device=t.accelerator.device)
        if t.accelerator.num_processes > 1:
            most = int(t.accelerator.reduce(local_rows, reduction="max").item())
        else:
            most = int(local_rows.item())
        batch = self._pad_rows(batch, _round_up(most, args.steps_per_generation if mode == "train" else None))
        loss_mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        batch["num_items_in_batch"] = t.accelerator.gather(loss_mask.sum()).sum()
        batch["num_rows_in_batch"] = t.accelerator.gather(counted_rows(batch).sum()).sum()
        return batch

    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _trl_advantages_hold(trainer, num_extra_rows: int, infra: torch.Tensor) -> bool:
        """Whether the batch is one `GRPOTrainer` would train on, advantages included: the default estimator, no extra
        row on any process, no rollout lost to infrastructure (whose reward TRL would have kept). Then TRL's own
        `advantages` are kept, so that features off stays TRL's computation bit for bit, whatever TRL computes."""
        return trainer.advantage_estimator is grpo_estimator and num_extra_rows == 0 and not bool(infra.any())

    @staticmethod
    def _own_keep(keep: list[bool], all_meta: list[list], rank: int) -> list[bool]:
        start = sum(len(m) for m in all_meta[:rank])
        return keep[start : start + len(all_meta[rank])]

    def _segment_term(self, row: ExtraRow, inputs: list[dict]) -> float:
        if row.kind != RowKind.SNAPSHOT or self.segment_reward is None:
            return 0.0
        info = {
            "prompt_ids": row.prompt_ids,
            "completion_ids": row.completion_ids,
            "tool_mask": row.tool_mask,
            "segment_index": row.segment_index,
            "tokens_freed": row.tokens_freed,
            "row": inputs[row.parent] if row.parent < len(inputs) else {},
        }
        return float(self.segment_reward(info))

    def _forwards_are_collective(self, output: dict) -> bool:
        """Whether extra rows need model forward passes (old/ref log-probs) that every process must run alike.

        Under ZeRO-3 every forward pass all-gathers the parameters (and a DeepSpeed reference model's), so a process
        that skips one while another runs it hangs both. Plain DDP forwards are local, but the rule is kept for every
        multi-process run: one code path, and a reference model can be DeepSpeed-wrapped under ZeRO-2 too.
        """
        needs_model = "old_per_token_logps" in output or "ref_per_token_logps" in output
        return needs_model and self.trainer.accelerator.num_processes > 1

    def _append_rows(self, output: dict, rows: list[ExtraRow], device) -> dict:
        t = self.trainer
        forward_rows = len(rows)
        if self._forwards_are_collective(output):
            # Every process runs as many rows (so as many chunked forward passes) as the process with the most rows.
            count = torch.tensor([len(rows)], device=device)
            forward_rows = int(t.accelerator.reduce(count, reduction="max").item())
        if not rows and not forward_rows:
            return dict(output)
        pad_id = t._tokenizer.pad_token_id
        multiple = t.pad_to_multiple_of
        prompt_w = _round_up(max([output["prompt_ids"].size(1)] + [len(r.prompt_ids) for r in rows]), multiple)
        comp_w = _round_up(max([output["completion_ids"].size(1)] + [len(r.completion_ids) for r in rows]), multiple)
        long = torch.long
        ext = {
            "prompt_ids": _stack([r.prompt_ids for r in rows], prompt_w, pad_id, "left", long, device),
            "prompt_mask": _stack([[1] * len(r.prompt_ids) for r in rows], prompt_w, 0, "left", long, device),
            "completion_ids": _stack([r.completion_ids for r in rows], comp_w, pad_id, "right", long, device),
            "completion_mask": _stack([[1] * len(r.completion_ids) for r in rows], comp_w, 0, "right", long, device),
            "tool_mask": _stack([r.tool_mask for r in rows], comp_w, 1, "right", long, device),
        }
        forward = self._with_filler_rows(ext, output, forward_rows, prompt_w, comp_w, pad_id)
        if "old_per_token_logps" in output:
            ext["old_per_token_logps"] = t._logps_for_rows(
                t.model,
                forward["prompt_ids"],
                forward["prompt_mask"],
                forward["completion_ids"],
                forward["completion_mask"],
            )[: len(rows)]
        if "ref_per_token_logps" in output:
            ext["ref_per_token_logps"] = self._ref_logps(forward)[: len(rows)]
        if not rows:
            return dict(output)
        if "sampling_per_token_logps" in output:
            # vLLM gives None for a NaN log-prob; NaN here, as TRL does for regular rows (neutralised in the IS ratio).
            ext["sampling_per_token_logps"] = _stack(
                [
                    [math.nan if lp is None else lp for lp in (r.logprobs or [0.0] * len(r.completion_ids))]
                    for r in rows
                ],
                comp_w,
                0.0,
                "right",
                torch.float32,
                device,
            )
        if "importance_sampling_ratio" in output:
            ext["importance_sampling_ratio"] = self._is_ratio(ext, output["importance_sampling_ratio"].size(1) == 1)

        merged = {}
        for key, value in output.items():
            if key in ("prompt_ids", "prompt_mask"):
                fill = pad_id if key == "prompt_ids" else 0
                merged[key] = torch.cat([_pad_to(value, prompt_w, fill, "left"), ext[key]])
            elif key in _TOKEN_KEYS:
                fill = pad_id if key == "completion_ids" else _TOKEN_KEYS[key]
                merged[key] = torch.cat([_pad_to(value, comp_w, fill, "right"), ext[key].to(value.dtype)])
            elif key == "importance_sampling_ratio":
                width = value.size(1) if value.size(1) == 1 else comp_w
                merged[key] = torch.cat([_pad_to(value, width, 1.0, "right"), _pad_to(ext[key], width, 1.0, "right")])
            elif key in _ROW_ID_KEYS:
                merged[key] = value  # recomputed or extended by the caller
            else:  # refused before, on every process, by `_check_mergeable`
                raise NotImplementedError(f"Extra rows cannot be combined with the batch key {key!r} (multimodal?).")
        return merged

    def _append_estimator_rows(self, batch: dict, rows: list[ExtraRow], advantages, device) -> dict:
        """Append rows created by the advantage estimator (members of their parent's group) with their advantages."""
        if not rows:
            return self._append_rows(batch, rows, device)  # only joins the other processes' forward passes
        parents = torch.tensor([r.parent for r in rows], device=device)  # in range: `check_estimate`
        group_id, row_kind = batch["group_id"], batch["row_kind"]
        episode_id, segment_index, counted = batch["episode_id"], batch["segment_index"], batch["counted_row"]
        old = batch["advantages"]
        batch = self._append_rows(batch, rows, device)
        width = batch["completion_ids"].size(1)
        advantages = advantages.to(device=device, dtype=torch.float32)
        if old.dim() == 2 or advantages.dim() == 2:  # token-level: both to (rows, width)
            old = _pad_to(old, width, 0.0, "right") if old.dim() == 2 else old[:, None].expand(-1, width)
            advantages = (
                _pad_to(advantages, width, 0.0, "right")
                if advantages.dim() == 2
                else advantages[:, None].expand(-1, width)
            )
        batch["advantages"] = torch.cat([old, advantages])
        batch["group_id"] = torch.cat([group_id, group_id[parents]])
        batch["row_kind"] = torch.cat([row_kind, torch.full_like(parents, int(RowKind.EXPANSION))])
        batch["episode_id"] = torch.cat([episode_id, episode_id[parents]])
        batch["segment_index"] = torch.cat([segment_index, segment_index[parents]])
        batch["counted_row"] = torch.cat([counted, torch.ones_like(parents, dtype=torch.bool)])
        return batch

    @staticmethod
    def _with_filler_rows(ext: dict, output: dict, rows: int, prompt_w: int, comp_w: int, pad_id: int) -> dict:
        """`ext`'s model inputs grown to `rows` rows with copies of the batch's first row (their outputs are dropped)."""
        missing = rows - ext["prompt_ids"].size(0)
        if missing <= 0:
            return ext
        filler = {
            "prompt_ids": _pad_to(output["prompt_ids"][:1], prompt_w, pad_id, "left"),
            "prompt_mask": _pad_to(output["prompt_mask"][:1], prompt_w, 0, "left"),
            "completion_ids": _pad_to(output["completion_ids"][:1], comp_w, pad_id, "right"),
            "completion_mask": _pad_to(output["completion_mask"][:1], comp_w, 0, "right"),
        }
        return {
            key: torch.cat([ext[key], filler[key].to(ext[key].dtype).expand(missing, -1)])
            for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        }

    @torch.no_grad()
    def _ref_logps(self, ext: dict) -> torch.Tensor:
        t = self.trainer
        args = (ext["prompt_ids"], ext["prompt_mask"], ext["completion_ids"], ext["completion_mask"])
        if t.ref_model is not None:
            return t._logps_for_rows(t.ref_model, *args)
        model = t.accelerator.unwrap_model(t.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return t._logps_for_rows(t.model, *args)

    def _is_ratio(self, ext: dict, sequence_level: bool) -> torch.Tensor:
        # Same formula as TRL 1.16's vLLM importance-sampling correction (grpo_trainer.py, "importance sampling").
        t = self.trainer
        mask = ext["completion_mask"] * ext["tool_mask"]
        diff = torch.nan_to_num((ext["old_per_token_logps"] - ext["sampling_per_token_logps"]) * mask, nan=0.0)
        if sequence_level:
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        low, high = t.vllm_importance_sampling_clip_min, t.vllm_importance_sampling_clip_max
        if t.vllm_importance_sampling_mode in ("sequence_truncate", "token_truncate"):
            return torch.clamp(ratio, min=low, max=high)
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

    @staticmethod
    def _pad_rows(batch: dict, target: int) -> dict:
        rows = batch["prompt_ids"].size(0)
        if rows >= target:
            return batch
        extra = target - rows
        padded = {}
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                padded[key] = value
                continue
            padded[key] = torch.cat([value, value[:1].expand(extra, *value.shape[1:])])
        added = torch.arange(target, device=batch["prompt_ids"].device) >= rows
        return mark_padding(padded, added)

    def _log_trained_rows(
        self, batch: dict, num_local: int, local_extras: list[ExtraRow], loop_result, inputs
    ) -> None:
        """Make TRL's completion logs show what is trained on: the recomputed advantages of the regular rows, the last
        segment of a rollout that deleted context, and the extra rows (negatives, snapshot segments)."""
        t = self.trainer
        logs = t._logs
        values = row_advantages(batch).tolist()
        starts = (loop_result.segment_starts if loop_result is not None else None) or [0] * num_local
        extras = [
            (e.prompt_messages, e.messages, values[num_local + k], RowKind(e.kind).name.lower())
            for k, e in enumerate(local_extras)
        ]
        payload = (values[:num_local], starts, extras)
        gathered = gather_object([payload]) if t.accelerator.num_processes > 1 else [payload]
        regular = [a for p in gathered for a in p[0]]
        starts = [s for p in gathered for s in p[1]]
        extras = [x for p in gathered for x in p[2]]
        n = len(regular)
        if len(logs["advantages"]) < n or len(logs["completion"]) < n:
            return  # not the batch TRL just logged (e.g. a test calling the augmenter directly)
        first = len(logs["advantages"]) - n
        for k, value in enumerate(regular):
            logs["advantages"][first + k] = value
        first = len(logs["completion"]) - n
        for k, start in enumerate(starts):
            if start:
                logs["completion"][first + k] = logs["completion"][first + k][start:]
        # The last batch's extra rows sit right before this batch's n rows (TRL appended them to deques grown for
        # those extras): they are removed, then this batch's extra rows appended. Left there, they showed in front of
        # a later batch's rows, under its step, with shifted `row_kind` labels. Earlier rows stay, as TRL keeps them
        # (several evaluation batches of fewer rows than a generation batch).
        previous, self._logged_extra_rows = getattr(self, "_logged_extra_rows", 0), len(extras)
        length = len(logs["prompt"])
        stale = min(previous, max(length - n, 0))
        size = max(n + len(extras), t.args.generation_batch_size)

        def rebuilt(column, tail):
            items = list(column)
            if stale and len(items) == length:
                del items[length - n - stale : length - n]
            return deque([*items, *tail], maxlen=size)

        logs["prompt"] = rebuilt(logs["prompt"], [prompt for prompt, *_ in extras])
        logs["completion"] = rebuilt(logs["completion"], [completion for _, completion, *_ in extras])
        logs["advantages"] = rebuilt(logs["advantages"], [value for *_, value, _ in extras])
        for name in list(logs["rewards"]):  # an extra row has one reward, not one per reward function
            logs["rewards"][name] = rebuilt(logs["rewards"][name], [math.nan] * len(extras))
        for name in list(logs["extra"]):
            if name != "row_kind":
                logs["extra"][name] = rebuilt(logs["extra"][name], [None] * len(extras))
        if extras or "row_kind" in logs["extra"]:
            regular = len(logs["prompt"]) - len(extras)  # every row before this batch's extras is a regular one
            logs["extra"]["row_kind"] = deque(["regular"] * regular + [kind for *_, kind in extras], maxlen=size)

    def _log_metrics(self, mode: str, batch: dict, loop_result, group_t: torch.Tensor, kind_t: torch.Tensor) -> None:
        t = self.trainer
        metrics = t._metrics[mode]
        device = t.accelerator.device
        kinds, adv_row = batch["row_kind"], row_advantages(batch)
        negative = kinds == RowKind.NEGATIVE
        stats = loop_result.stats if loop_result is not None else None
        local = torch.tensor(
            [
                negative.sum().item(),
                adv_row[negative].sum().item() if negative.any() else 0.0,
                (kinds == RowKind.SNAPSHOT).sum().item(),
                *(
                    [
                        stats.rollback_attempts,
                        stats.rollback_recovered,
                        stats.rollback_exhausted,
                        stats.negatives_saved,
                        stats.infra_retries,
                        stats.snapshots,
                        stats.tokens_freed,
                        stats.malformed_calls,
                        sum(loop_result.num_segments),
                        len(loop_result.num_segments),
                        stats.regenerated_tokens,
                        stats.failed_turn_tokens,
                        stats.truncated_outputs,
                        stats.truncated_turns,
                        stats.user_turns,
                        stats.user_turns_dropped,
                        stats.retired_environments,
                        stats.turn_cap_truncations,
                        stats.hints_dropped,
                    ]
                    if stats is not None
                    else [0] * 19
                ),
            ],
            dtype=torch.float64,
            device=device,
        )
        total = t.accelerator.reduce(local, reduction="sum").tolist()
        (
            neg_rows,
            neg_adv,
            snap_rows,
            attempts,
            recovered,
            exhausted,
            saved,
            infra_retries,
            snapshots,
            freed,
            malformed,
            segments,
            episodes,
            regen_tokens,
            failed_tokens,
            truncated,
            truncated_turns,
            user_turns,
            user_turns_dropped,
            retired,
            turn_cap_truncations,
            hints_dropped,
        ) = total
        sizes = torch.bincount(group_t - group_t.min()) if group_t.numel() else torch.zeros(1)
        sizes = sizes[sizes > 0].float()
        metrics["groups/size_mean"].append(sizes.mean().item())
        metrics["groups/size_max"].append(sizes.max().item())
        args = t.args
        if args.enable_tool_rollback:
            metrics["rollback/attempts"].append(attempts)
            metrics["rollback/recovered_ratio"].append(recovered / attempts if attempts else 0.0)
            metrics["rollback/exhausted"].append(exhausted)
            metrics["rollback/regenerated_tokens_per_failed_token"].append(
                regen_tokens / failed_tokens if failed_tokens else 0.0
            )
            metrics["negatives/saved"].append(saved)
            metrics["negatives/rows"].append(neg_rows)
            metrics["negatives/mean_advantage"].append(neg_adv / neg_rows if neg_rows else 0.0)
            metrics["infra/retries"].append(infra_retries)
            if args.rollback_feedback == "hint":
                metrics["rollback/hints_dropped"].append(hints_dropped)
        if t.tools and getattr(t, "_uses_agentic_loop", True):  # TRL's own loop keeps TRL's metrics only
            metrics["tools/malformed_calls"].append(malformed)
            metrics["tools/truncated_outputs"].append(truncated)
            metrics["tools/truncated_turns"].append(truncated_turns)
            if args.max_turn_tokens is not None:
                metrics["tools/turn_cap_truncations"].append(turn_cap_truncations)
            metrics["tools/retired_environments"].append(retired)
            metrics["conversation/user_turns"].append(user_turns)
            metrics["conversation/user_turns_dropped"].append(user_turns_dropped)
        if args.enable_context_snapshots:
            metrics["snapshots/rows"].append(snap_rows)
            metrics["snapshots/per_episode_mean"].append(snapshots / episodes if episodes else 0.0)
            metrics["context/tokens_freed"].append(freed)
