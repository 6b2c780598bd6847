"""`row_selection` in the trainer: choose the rows of each generation batch to train on, after the advantages.

Hooked at the end of `AgenticGRPOTrainer._generate_and_score_completions`, on the finished batch (TRL's rows, their
advantages and the loss normalisers `num_items_in_batch` / `num_rows_in_batch`). The selection is computed from the
rewards of the whole generation batch (gathered over processes), so every process computes the same one and keeps its
own rows. Modes (`trl_agentic.selection.rules`):

- `"random"`: a random `row_selection_fraction` of the rows; the others are masked out exactly as TracIn masks the rows
  it rejects (their `tool_mask` zeroed, the token and row counts recomputed over the kept rows), so that training on
  the masked batch equals training on the kept rows alone, for every loss type. Advantages are unchanged.
- `"max_variance"` (PODS): `num_generations` rollouts per prompt are generated and the `row_selection_keep` of each
  group with the largest reward variance are trained on, with advantages recomputed over the kept rows only. The other
  rows are removed from the batch (not masked: PODS saves the training compute of the rows it drops), so one process
  only. A group with fewer scorable rows keeps fewer; the batch is then filled up to a multiple of
  `steps_per_generation` with dropped rows as zero-weight padding rows (TRL's split drops a remainder).
- `"successful"` (rejection-sampled self-training, RFT/STaR): the rows whose reward is at least
  `row_selection_threshold`, each with advantage 1; the others are masked out. With one update per generation batch
  (`num_iterations=1`) and no KL term (`beta=0`), the importance ratio is 1 and the gradient of TRL's loss is then
  that of supervised fine-tuning on the kept completions' model tokens (tool results masked, as in the warm start),
  normalised as the loss type normalises tokens (`dapo`: the mean over the kept tokens).

Rewards are the batch augmenter's (`BatchAugmenter.last_regular_rewards`): a rollout lost to infrastructure is NaN, as
an unscorable one, never selected and out of every group's statistics.
"""

from __future__ import annotations

import torch

from ..advantages import group_advantages
from ..batch import counted_rows, mark_padding
from ..rollout.types import RowKind
from .rules import max_variance_rows, random_rows, successful_rows


class RowSelectionMixin:
    """Provides `_select_rows(batch)`, which `AgenticGRPOTrainer._generate_and_score_completions` applies last."""

    def _init_row_selection(self) -> None:
        if self.args.row_selection == "max_variance" and self.accelerator.num_processes > 1:
            raise ValueError(
                "`row_selection='max_variance'` removes rows from the batch, which needs one process (got "
                f"{self.accelerator.num_processes}): processes must keep equal row counts."
            )

    def _select_rows(self, batch: dict) -> dict:
        mode = self.args.row_selection
        # What the selection decided for this process's rows (before any is removed), for the trajectory report.
        self._last_row_selection = None
        if mode == "none" or not self.model.training:
            return batch
        device = batch["completion_mask"].device
        rewards = getattr(getattr(self, "_augmenter", None), "last_regular_rewards", None)
        if rewards is None:  # the augmenter kept TRL's batch (GDPO): TRL's rewards, which lose no rollout
            rewards_per_func = self._last_rewards_per_func  # (N_global, n_funcs), gathered
            rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
            rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        rewards = rewards.clone()
        n_local = batch["prompt_ids"].size(0)
        start = self.accelerator.process_index * n_local
        values = rewards.tolist()
        if mode == "random":
            # The same rows on every process. With `steps_per_generation` < `gradient_accumulation_steps` one step
            # draws several generation batches: each its own draw (the micro-step within the step; 0 otherwise).
            within = int(self._step) % max(int(getattr(self, "current_gradient_accumulation_steps", 1)), 1)
            seed = int(self.args.seed) * 1_000_003 + int(self.state.global_step) + within * 7_919_993
            kept = random_rows(values, self.args.row_selection_fraction, seed)
        elif mode == "successful":
            kept = successful_rows(values, self.args.row_selection_threshold)
        else:
            groups = [k // self.num_generations for k in range(len(values))]
            kept = max_variance_rows(values, groups, self.args.row_selection_keep)
        kept_all = torch.tensor(kept, dtype=torch.bool)
        mine = kept_all[start : start + n_local].to(device)
        self._log_selection(kept_all, rewards)
        if mode == "max_variance":
            dropped = rewards.clone()
            dropped[~kept_all.to(dropped.device)] = torch.nan  # out of the group statistics
            groups = torch.arange(len(values), device=dropped.device) // self.num_generations
            advantages = group_advantages(dropped, groups, scale=self.scale_rewards)
            batch = dict(batch, advantages=advantages[start : start + n_local].to(device=device, dtype=torch.float32))
            self._last_row_selection = {"mode": mode, "kept": mine.cpu(), "advantages": batch["advantages"].cpu()}
            rows = _fill_to_multiple(mine, self.args.steps_per_generation)
            taken = _pad_unkept(_take_rows(batch, rows, n_local), mine[rows])
            return self._recount(taken, counted_rows(taken))
        if mode == "successful":
            batch = dict(batch, advantages=mine.to(torch.float32))
        self._last_row_selection = {"mode": mode, "kept": mine.cpu(), "advantages": batch["advantages"].cpu()}
        masked = dict(batch)
        tool_mask = batch.get("tool_mask", torch.ones_like(batch["completion_mask"]))
        masked["tool_mask"] = tool_mask * mine.unsqueeze(1).to(tool_mask.dtype)
        return self._recount(masked, counted_rows(batch) & mine)

    def _recount(self, batch: dict, counted: torch.Tensor) -> dict:
        """The trained tokens and the counted rows (`counted`: the selected rows `counted_rows` counts, so a selected
        row that `mask_truncated_completions` masks still counts, as in TRL) over every process, as TracIn does."""
        loss_mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        for key, value in (
            ("num_items_in_batch", self.accelerator.gather(loss_mask.sum()).sum()),
            ("num_rows_in_batch", self.accelerator.gather(counted.sum()).sum()),
        ):
            old = batch.get(key)
            batch[key] = value if old is None else value.to(device=old.device, dtype=old.dtype).reshape(old.shape)
        return batch

    def _log_selection(self, kept: torch.Tensor, rewards: torch.Tensor) -> None:
        metrics = self._metrics["train"]
        scorable = ~torch.isnan(rewards)
        metrics["selection/num_kept"].append(float(kept.sum()))
        metrics["selection/kept_ratio"].append(float(kept.sum()) / max(int(scorable.sum()), 1))
        chosen = rewards[kept.to(rewards.device) & scorable]
        metrics["selection/kept_reward_mean"].append(chosen.mean().item() if chosen.numel() else float("nan"))


def _take_rows(batch: dict, keep: torch.Tensor, n_rows: int) -> dict:
    """`batch` with only the rows of `keep`: every tensor or list whose first dimension is the row count."""
    index = keep.nonzero().squeeze(1)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == n_rows:
            out[key] = value[index.to(value.device)]
        elif isinstance(value, list) and len(value) == n_rows:
            out[key] = [value[k] for k in index.tolist()]
        else:
            out[key] = value
    return out


def _fill_to_multiple(keep: torch.Tensor, multiple: int) -> torch.Tensor:
    """`keep` plus the first unkept rows needed for a multiple of `multiple` rows (at least `multiple`): TRL's
    `split_tensor_dict` drops a remainder, and a batch of no row trains nothing. The batch's row count is such a
    multiple, so there are enough."""
    count = int(keep.sum())
    target = max(-(-count // multiple) * multiple, multiple)
    fill = (~keep).nonzero().squeeze(1)[: target - count]
    out = keep.clone()
    out[fill] = True
    return out


def _pad_unkept(batch: dict, kept: torch.Tensor) -> dict:
    """Rows of `batch` not in `kept` become zero-weight padding rows (`batch.mark_padding`)."""
    if bool(kept.all()):
        return batch
    out = dict(batch)
    # TRL's own batch (GDPO keeps it) has no row kinds: the kept rows count, the fill rows are padding.
    out.setdefault("counted_row", torch.ones_like(kept))
    out.setdefault("row_kind", torch.full(kept.shape, int(RowKind.REGULAR), dtype=torch.long, device=kept.device))
    return mark_padding(out, ~kept)
