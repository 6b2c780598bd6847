"""The TracIn-filtered step of the asynchronous trainer (`tracin_enabled`, LoRA, one training process).

Why not `tracin/trainer_mixin.py`: the mixin overrides `GRPOTrainer._prepare_inputs`, `_compute_loss` and
`_generate_and_score_completions`, which `AsyncGRPOTrainer` does not have, and it separates rows by the batch
dimension of the training forward, whereas TRL's asynchronous trainer packs all rows of a micro-batch into ONE
tree-packed sequence in which a shared prefix token belongs to several rows. What is reused: the ghost-gradient hooks
(`tracin.hooks.LoraGhostHooks`), the selection (`tracin.selection.select_rows`), the schedule (`tracin.schedule.due`)
and trl-agentic's rollout loop for the validation rollouts.

Per micro-batch, when TRL trains it (`AsyncAgenticGRPOTrainer.training_step`, before its forward), at the weights it
trains with: accelerate's dispatcher collates the next micro-batch before the current one trains, so the rows are only
tagged at collate time (`stash`) and filtered here (`apply`), else they would be scored, and V refreshed, one optimizer
step early, at the previous weights.

1. V, the validation direction (refreshed every `tracin_val_refresh_steps` optimizer steps): `tracin_val_batch_size`
   validation prompts are rolled out `tracin_val_num_generations` times each with the policy the server serves and
   made into rows as the worker makes training rows (`validation.ValidationRollouts`: the server's current adapter,
   up to `weight_sync_steps - 1` optimizer steps behind the trained weights, as the training rollouts are;
   trl-agentic's rollout loop, tools and environments, the trajectories of a refresh at once; negative and snapshot
   rows, the worker's group advantages or the trainer-side estimator's, exactly 0 in a group without reward spread
   under GRPO and CoPO), and V is the gradient w.r.t. the LoRA weights of TRL's asynchronous loss on them at ratio 1
   (`-sum_b sum_t A_bt exp(logp_t - sg(logp_t)) / N_tokens`, one forward). New rollouts are drawn every `tracin_val_rollout_steps` optimizer steps, as in the
   synchronous trainer; a refresh in between recomputes V at the current weights on the stored rows and advantages.
   Without a validation row to train (every rollout lost, say) V is zero.
2. Scores: `score_b = <grad ell_b, V>`, `ell_b` being row b's term of the loss TRL trains the micro-batch with
   (`-sum_t min(r_t A_t, clip(r_t) A_t) / N_tokens / gradient_accumulation_steps`, `r_t` against the row's sampling
   log-probs, `N_tokens` the micro-batch's trained tokens), from one forward of the rows unpacked (a padded batch) and
   one backward through the hooks (no parameter gradient is touched).
3. Selection: `select_rows` with the config's mode and `tracin_min_selected` (0: a micro-batch may keep no row). When
   V is exactly zero (no validation group had a reward spread) every valid row is kept and none is scored, as in the
   synchronous trainer. The selection is per micro-batch: with `gradient_accumulation_steps` 1 (the default) that is
   the optimizer step's rows, as in the synchronous trainer; above 1, each micro-batch keeps its own share, and since
   TRL normalises each micro-batch by its own trained tokens, a row kept alone weighs as much as all the kept rows of
   another micro-batch (TRL's weighting of micro-batches, here uneven because the selection is).
4. Training: the rejected rows' loss terms are dropped from the packed micro-batch (`token_index` -1) and TRL's
   normaliser (`global_n_tokens`) counts the selected rows' terms only: training on it is training on the selected rows
   alone (the rejected rows' tokens stay in the forward as context of nothing but themselves; an MoE router's
   auxiliary loss, which TRL adds over the whole forward, still covers them). With no row selected the micro-batch is
   not trained at all: no forward, no gradient, no trained tokens counted (under DeepSpeed, which counts micro-batches
   in its backward, its advantages are set to 0 instead). TRL's collator metrics (`sample/trained_tokens_mean`,
   `batch/masked_token_frac`) describe the micro-batch as collated, before the filter; `batch/trained_tokens_per_step`
   and `tracin/*` describe it after.

Gradient checkpointing (on by default in `AsyncGRPOConfig`): the hooks follow non-reentrant checkpointing (a
region's LoRA inputs are taken from its recompute in the backward, `LoraGhostHooks`), so the scoring forward and V's
run checkpointed; reentrant checkpointing (`gradient_checkpointing_kwargs={"use_reentrant": True}`) runs its first
forward without autograd, so those two passes run without it (a warning at start-up says so), as in the synchronous
trainer. Training is checkpointed either way.

Metrics: `tracin/selected_ratio`, `tracin/num_selected`, `tracin/score_mean`, `tracin/score_pos_frac`,
`tracin/val_reward` and `perf/tracin_val_rollout_s` (at new validation rollouts), `tracin/val_grad_norm` and
`perf/tracin_refresh_s` (at refreshes: the wall seconds the refresh held the step up, rollouts included).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from contextlib import nullcontext

import numpy as np
import torch

from ..tracin.hooks import LoraGhostHooks, checkpointing_paused, reentrant_checkpointing
from ..tracin.layers import find_lora_layers
from ..tracin.lora_gradient import LoraGradient, is_zero
from ..tracin.lora_gradient import norm as gradient_norm
from ..tracin.schedule import due
from ..tracin.selection import select_rows, warn_uninformative_direction
from .validation import ValidationRollouts

__all__ = ["AsyncTracIn", "async_row_losses"]

STATE_FILE = "tracin_async_state.pt"


def async_row_losses(
    model,
    samples: list[dict],
    *,
    temperature: float,
    epsilon_low: float,
    epsilon_high: float,
    ratio_one: bool = False,
):
    """Per-row terms of TRL's asynchronous loss, from one padded forward of the rows (sum over the row's trained
    tokens of `-min(r A, clip(r) A)`, not yet normalised). With `ratio_one` the old log-probs are this forward's own,
    detached (`r = exp(logp - sg(logp))`: exactly 1, its gradient that of `logp`), and `samples` need none. Returns
    `(losses (B,), trained token count)`."""
    device = next(model.parameters()).device
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long, device=device)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(samples), width, dtype=torch.float32, device=device)
    old = torch.zeros(len(samples), width, dtype=torch.float32, device=device)
    adv = torch.zeros(len(samples), width, dtype=torch.float32, device=device)
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[b, :n] = torch.as_tensor(np.asarray(s["input_ids"]), device=device)
        attention[b, :n] = 1
        mask[b, :n] = torch.as_tensor(np.asarray(s["completion_mask"]), dtype=torch.float32, device=device)
        if not ratio_one:
            old[b, :n] = torch.as_tensor(np.asarray(s["old_log_probs"]), dtype=torch.float32, device=device)
        a = s["advantage"]
        adv[b, :n] = (
            torch.as_tensor(np.asarray(a, dtype=np.float32), device=device) if isinstance(a, np.ndarray) else a
        )
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / temperature
    logps = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    target_mask, old, adv = mask[:, 1:], (logps.detach() if ratio_one else old[:, 1:]), adv[:, 1:]
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    return (per_token * target_mask).sum(dim=1), target_mask.sum()


class AsyncTracIn:
    """TracIn row filter of `AsyncAgenticGRPOTrainer` (module docstring).

    Args:
        trainer: The trainer.
        dataset: Validation prompts (map-style dataset with the training dataset's columns).
    """

    def __init__(self, trainer, dataset):
        if dataset is None or len(dataset) == 0:
            raise ValueError("TracIn needs validation prompts: pass `tracin_eval_dataset` to the trainer.")
        if trainer.accelerator.num_processes > 1:
            raise ValueError("The asynchronous TracIn filter runs with one training process.")
        self.trainer = trainer
        self.dataset = dataset
        self.direction = None
        self.refreshed_at: int | None = None
        self.refreshes = 0  # validation rollouts so far (they seed the validation prompts' order)
        self.val_rows: list[dict] | None = None  # the last validation rollouts, reused until new ones are due
        self.rolled_out_at: int | None = None
        self.last: dict = {}
        # Micro-batches collated but not yet trained, by id: accelerate's dispatcher collates the next micro-batch
        # before the current one trains, so the filter runs when a micro-batch is trained, not when it is collated.
        self._pending: dict[int, list[dict]] = {}
        self._collated = 0
        self.validation = ValidationRollouts(trainer)
        self._prompts_checked = False
        self.disable_checkpointing = reentrant_checkpointing(trainer.args)
        if self.disable_checkpointing:
            warnings.warn(
                "TracIn: reentrant gradient checkpointing is on (`gradient_checkpointing_kwargs` has "
                "`use_reentrant=True`); the TracIn scoring and validation passes run with gradient checkpointing "
                "disabled, which costs activation memory. Non-reentrant checkpointing (the default) does not.",
                UserWarning,
                stacklevel=3,
            )
        from trl.chat_template_utils import add_response_schema

        tokenizer = trainer.processing_class
        if (
            getattr(tokenizer, "response_template", None) is None
            and getattr(tokenizer, "response_schema", None) is None
        ):
            add_response_schema(tokenizer)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def save(self, folder: str) -> None:
        direction = None
        if self.direction is not None:
            direction = {name: {"A": g.A.cpu(), "B": g.B.cpu()} for name, g in self.direction.items()}
        rows = None
        if self.val_rows is not None:
            rows = [
                {
                    "input_ids": torch.as_tensor(np.asarray(r["input_ids"]), dtype=torch.long),
                    "completion_mask": torch.as_tensor(np.asarray(r["completion_mask"]), dtype=torch.long),
                    # A float, or an array over `input_ids` (a trainer-side estimator's token-level advantages).
                    "advantage": torch.as_tensor(r["advantage"], dtype=torch.float32)
                    if isinstance(r["advantage"], np.ndarray)
                    else float(r["advantage"]),
                    "kind": int(r.get("kind", 0)),
                }
                for r in self.val_rows
            ]
        state = {
            "direction": direction,
            "refreshed_at": self.refreshed_at,
            "refreshes": self.refreshes,
            "val_rows": rows,
            "rolled_out_at": self.rolled_out_at,
        }
        os.makedirs(folder, exist_ok=True)
        torch.save(state, os.path.join(folder, STATE_FILE))

    def load(self, folder: str) -> None:
        from ..tracin.lora_gradient import LoraGradient

        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        device = self.trainer.accelerator.device
        if state["direction"] is not None:
            self.direction = {
                name: LoraGradient(A=g["A"].to(device), B=g["B"].to(device)) for name, g in state["direction"].items()
            }
        self.refreshed_at, self.refreshes = state["refreshed_at"], state["refreshes"]
        # A checkpoint written before validation rollouts were reused has none: the next refresh rolls out.
        self.rolled_out_at = state.get("rolled_out_at")
        rows = state.get("val_rows")
        self.val_rows = None
        if rows is not None:
            self.val_rows = [
                {
                    "input_ids": r["input_ids"].numpy(),
                    "completion_mask": r["completion_mask"].numpy(),
                    "advantage": r["advantage"].numpy() if torch.is_tensor(r["advantage"]) else r["advantage"],
                    "kind": r.get("kind", 0),
                }
                for r in rows
            ]

    # ----------------------------------------------------------------------------------------------- filter
    @property
    def direction_is_zero(self) -> bool:
        """V is exactly zero: no information, so every valid row is selected (and none is scored)."""
        return self.direction is not None and is_zero(self.direction)

    def _model(self):
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def _influence_pass(self):
        """Gradient checkpointing off while it is reentrant (the hooks cannot see through its no-grad forward)."""
        if not getattr(self, "disable_checkpointing", False):
            return nullcontext()
        return checkpointing_paused(self._model())

    def stash(self, rows) -> dict:
        """At collate time (`stage.token_advantage_collate`): keep the micro-batch's rows (the planner's `TreeRow`s)
        for `apply`, and tag the packed batch with their id."""
        self._collated += 1
        self._pending[self._collated] = [s for row in rows for s in row.samples]
        return {"tracin_batch": torch.tensor([self._collated])}

    def apply(self, inputs: dict, *, can_skip: bool = True) -> dict | None:
        """When TRL trains the packed micro-batch `inputs` (`training_step`, before its forward): score its rows at
        the current weights (refreshing V first when due), select, and drop the rejected rows' loss terms
        (`token_index` -1), with `global_n_tokens`, TRL's normaliser, counting the selected rows' terms only: the
        loss TRL then computes is the one of the selected rows alone. With no term selected, `None`: nothing to
        train, so no forward and no gradient (an MoE router's auxiliary loss included); when the step cannot be
        skipped (`can_skip=False`: DeepSpeed counts its micro-batches in its backward), every advantage is set to 0
        instead, a policy loss of exactly 0."""
        batch = int(inputs.pop("tracin_batch")[0])
        samples = self._pending.pop(batch)
        for stale in [k for k in self._pending if k < batch]:  # collated, never trained (an earlier `train()`)
            del self._pending[stale]
        selected = self.select(samples).to(inputs["segment_id"].device)
        terms = inputs["token_index"] >= 0
        rejected = terms & ~selected[inputs["segment_id"]]
        kept = int((terms & ~rejected).sum())
        if kept == 0:
            if can_skip:
                return None
            inputs["advantages"] = torch.zeros_like(inputs["advantages"])
            return inputs
        inputs["token_index"] = inputs["token_index"].masked_fill(rejected, -1)
        inputs["global_n_tokens"] = torch.full_like(inputs["global_n_tokens"], float(kept))
        return inputs

    def select(self, samples: list[dict]) -> torch.Tensor:
        """Which of a micro-batch's rows (dicts with `input_ids`, `completion_mask`, `old_log_probs`, `advantage`)
        are trained: V refreshed first when due, the rows scored, `select_rows`; the `tracin/*` metrics."""
        t, args = self.trainer, self.trainer.args
        model = self._model()
        if not model.training:
            # Step 0's rows are read before `Trainer` puts the model in training mode (`stage.estimate_group` does
            # the same): the filter's passes run in the mode training runs in, so with its dropout and, above all,
            # its gradient checkpointing (inactive in eval mode: the first V, the largest pass, would not be).
            model.train()
        # The filter's passes (V's and the scoring forward) run with LoRA dropout like training, on a forked torch RNG:
        # training then draws exactly the dropout masks it draws without the filter (a run that keeps every row trains
        # as plain training, bit for bit). The scores see masks of their own, not the training forward's: TRL's packed
        # forward cannot be replayed row by row (docs/async.md).
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if due(t.state.global_step, self.refreshed_at, args.tracin_val_refresh_steps):
                self.refresh()
            valid = torch.tensor([bool(np.asarray(s["completion_mask"]).any()) for s in samples])
            scores = None if self.direction_is_zero else self.scores(samples)
        if scores is None:
            # V = 0 (no validation group with a reward spread and a token to train): every score is 0 and says
            # nothing about a row, so every row is trained, as in the synchronous trainer; not the fallback's first
            # row at full weight.
            scores, selected = torch.zeros(len(samples)), valid.clone()
        else:
            selected = select_rows(
                scores.detach().cpu().double(),
                valid,
                mode=args.tracin_selection,
                fraction=args.tracin_top_fraction,
                threshold=args.tracin_threshold,
                min_selected=args.tracin_min_selected,
            )
        metrics = t._metrics["train"]
        n_valid = float(valid.sum())
        valid_scores = scores.detach().cpu().double()[valid]
        # TRL's rates: `(numerator, denominator)` pairs, reduced over the logging window as their sums' ratio (a
        # plain float is averaged over micro-batches, whose row counts vary with the token budget).
        metrics["tracin/selected_ratio"].append((float(selected.sum()), n_valid))
        metrics["tracin/score_mean"].append((valid_scores.sum().item(), n_valid))
        metrics["tracin/score_pos_frac"].append((float((valid_scores > 0).sum()), n_valid))
        # Selected rows per optimizer step: the step's first micro-batch counts the step once.
        new_step = getattr(self, "_metrics_step", None) != t.state.global_step
        self._metrics_step = t.state.global_step
        metrics["tracin/num_selected"].append((float(selected.sum()), float(new_step)))
        self.last = {"scores": scores.detach().cpu(), "selected": selected.clone(), "valid": valid}
        return selected

    def scores(self, samples: list[dict]) -> torch.Tensor:
        """`<grad ell_b, V>` per row (module docstring, step 2)."""
        t = self.trainer
        model = self._model()
        with self._influence_pass(), LoraGhostHooks(model) as hooks:
            with hooks.record(direction=self.direction):
                losses, tokens = async_row_losses(
                    model, samples, temperature=t.temperature, epsilon_low=t.epsilon_low, epsilon_high=t.epsilon_high
                )
                # TRL's divisor (`current_gradient_accumulation_steps`, set by the training loop; the configured
                # value before the first step), so scores are on the scale of the gradient trained with.
                accumulation = getattr(t, "current_gradient_accumulation_steps", t.args.gradient_accumulation_steps)
                loss = losses.sum() / tokens.clamp(min=1.0) / accumulation
            return hooks.score_rows(loss, self.direction)

    # ----------------------------------------------------------------------------------------------- validation
    def refresh(self) -> None:
        """Recompute V at the current weights (module docstring, step 1), on new validation rollouts when they are due
        (every `tracin_val_rollout_steps` optimizer steps, as in the synchronous trainer), else on the stored ones:
        the same rows and advantages, their old log-probs the current policy's (ratio 1)."""
        t = self.trainer
        started = time.perf_counter()
        metrics = t._metrics["train"]
        # No stored row (none yet, or a refresh whose every rollout was lost): roll out, rather than keep V at 0.
        if not self.val_rows or due(t.state.global_step, self.rolled_out_at, t.args.tracin_val_rollout_steps):
            self.val_rows, rewards = self._validation_rollouts()
            self.rolled_out_at = t.state.global_step
            self.refreshes += 1
            scored = [r for r in rewards if not math.isnan(r)]
            metrics["tracin/val_reward"].append(sum(scored) / len(scored) if scored else math.nan)
            metrics["perf/tracin_val_rollout_s"].append(time.perf_counter() - started)
        model = self._model()
        if not self.val_rows:  # nothing to train on: no information, so every row is kept (`direction_is_zero`)
            self.direction = {
                ref.name: LoraGradient(A=torch.zeros_like(ref.lora_A.weight), B=torch.zeros_like(ref.lora_B.weight))
                for ref in find_lora_layers(model)
            }
        else:
            self.direction = self._validation_direction(model)
        self.refreshed_at = t.state.global_step
        if self.direction_is_zero:
            warn_uninformative_direction(
                t.state.global_step, t.args.tracin_val_num_generations, rows_lost=not self.val_rows
            )
        metrics["tracin/val_grad_norm"].append(gradient_norm(self.direction))
        # Wall seconds of the refresh (validation rollouts when due, the rows' forward and V's backward), logged at the
        # step that paid them: the refresh runs in the training process and holds the step up.
        metrics["perf/tracin_refresh_s"].append(time.perf_counter() - started)

    def _validation_direction(self, model):
        t = self.trainer
        with self._influence_pass(), LoraGhostHooks(model) as hooks, hooks.record():
            losses, tokens = async_row_losses(
                model,
                self.val_rows,
                temperature=t.temperature,
                epsilon_low=t.epsilon_low,
                epsilon_high=t.epsilon_high,
                ratio_one=True,  # at the current weights, whenever the rows were rolled out
            )
            return hooks.accumulate_gradient(losses.sum() / tokens.clamp(min=1.0))

    def _validation_rollouts(self):
        """New validation rows (`input_ids`, `completion_mask`, `advantage`) and each conversation's reward
        (`validation.ValidationRollouts`)."""
        args = self.trainer.args
        if not self._prompts_checked:  # every prompt, before the first rollout (a refresh draws a sample of them)
            self.validation.check_prompts(self.dataset)
            self._prompts_checked = True
        seed = args.seed * 1_000_003 + self.refreshes
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        prompts = [dict(self.dataset[order[i % len(order)]]) for i in range(args.tracin_val_batch_size)]
        return self.validation.run(prompts, seed)

    def close(self) -> None:
        """Stop the validation rollouts' event loop (the trainer calls it when `train()` ends)."""
        self.validation.close()
