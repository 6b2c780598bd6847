"""TracIn-filtered training step for `AgenticGRPOTrainer` (a mixin; inactive unless `args.tracin_enabled`).

Per generation batch (all processes' rows), with the current policy:

1. Validation direction V (refreshed every `tracin_val_refresh_steps` optimizer steps): validation prompts are rolled
   out `tracin_val_num_generations` times each through the trainer's own rollout path (tools and environments work),
   scored, given group advantages (exactly 0 in a group without reward spread: `_tracin_zero_groups_without_spread`),
   and V is the gradient of TRL's loss on that batch w.r.t. the LoRA weights, built
   from the ghost hooks and averaged over processes (`all_reduce_`).
2. Scores: `score_b = <grad_theta ell_b, V>`, where `ell_b` is row b's term of the loss TRL computes for the training
   micro-batch holding it; computed inside the `lora_B` backward hooks (gradients w.r.t. module outputs only, so
   `param.grad` and DeepSpeed's buffers are untouched).
3. Selection (`select_rows`) on the gathered scores of every process, so every process computes the same global
   selection and keeps its slice.
4. Training: TRL's loss with the loss mask of unselected rows zeroed and `num_items_in_batch` recomputed over the
   selected rows. Every process still runs every micro-batch (no skipped backward: DeepSpeed steps inside the last
   backward of the accumulation window), so a process that selects nothing does not hang the others.

Two implementations of steps 2-4, chosen at start-up:

- **fused** (one forward and one backward over the training rows; used when `steps_per_generation == 1`,
  `num_iterations == 1`, no entropy bonus, `top_entropy_quantile == 1`): the training forward is recorded, one
  backward gives the scores *and* every row's LoRA gradient, and the selected rows' gradient reaches the optimizer
  through the surrogate loss `sum <W, G_W>` (`LoraGhostHooks.gradient_surrogate`), back-propagated by
  `accelerator.backward`, so DeepSpeed's gradient reduction applies as usual.
- **two-pass** (every other configuration): when TRL has buffered the generation batch, a scoring pass (forward and
  backward, hooks only, memory O(micro-batch)) runs over its micro-batches, then the masked micro-batches are trained
  on by TRL unchanged.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict, deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.utils import logging

from ..batch import counted_rows
from ..estimators import zero_without_reward_spread
from ..loss_weights import LOCAL_TOKEN_LOSSES, ROW_MEAN_LOSSES
from ..rollout.types import RowKind
from .hooks import LoraGhostHooks, checkpointing_paused, reentrant_checkpointing
from .layers import validate_tracin_model
from .lora_gradient import LoraGradient, LoraGradients, all_reduce_, is_zero
from .lora_gradient import norm as gradient_norm
from .schedule import due
from .selection import select_rows, warn_kl_only_direction, warn_uninformative_direction

__all__ = ["TracInMixin", "TracInState"]

logger = logging.get_logger(__name__)

# Key of the per-micro-batch seed that gives the two-pass scoring forward and the training forward of a micro-batch
# the same dropout masks.
_DROPOUT_SEED = "tracin_dropout_seed"

# How the loss normaliser of each TRL loss type reacts to masking rows (see `_fused_scale`).
_GLOBAL_TOKEN_LOSSES = ("dapo", "cispo", "vespo")  # sum / global token count (num_items_in_batch)
_LOCAL_TOKEN_LOSSES = ("bnpo",)  # sum / token count of the micro-batch
_ROW_LOSSES = ROW_MEAN_LOSSES  # per-row terms over the global count of trained rows (`num_rows_in_batch`)
SUPPORTED_LOSS_TYPES = _GLOBAL_TOKEN_LOSSES + _LOCAL_TOKEN_LOSSES + _ROW_LOSSES

# Adaptive-entropy controller state that TRL's `_compute_loss` mutates in train mode; scoring and validation passes
# must leave it as they found it.
_ENTROPY_STATE = ("entropy_coef", "_entropy_window_stats", "_last_world_entropy")


@dataclass
class TracInState:
    """Run-time state of the TracIn filter.

    Args:
        dataset: Validation prompts (map-style dataset).
        fused: Whether the one-backward fused step is used (else the two-pass design).
        disable_checkpointing: Whether recorded passes run with gradient checkpointing disabled (reentrant
            checkpointing, which the hooks cannot see through).
        direction: The current validation direction V, per LoRA layer (identical on every process).
        direction_is_zero: V is exactly zero (e.g. every validation group had equal rewards): no information, so
            every valid row is selected.
        refreshed_at: `state.global_step` of the last refresh of V.
        refreshes: Number of validation rollouts so far (seeds the choice of validation prompts).
        val_batch: The latest validation rollouts (tensors), from which V is recomputed until the next rollout.
        rolled_out_at: `state.global_step` of the latest validation rollouts.
        last: Per-row results of the last selection on this process (`scores`, `selected`, `valid`), for tests and
            debugging.
    """

    dataset: Any
    fused: bool
    disable_checkpointing: bool
    direction: LoraGradients | None = None
    direction_is_zero: bool = False
    refreshed_at: int = -1
    refreshes: int = 0
    val_batch: dict[str, torch.Tensor] | None = None
    rolled_out_at: int = -1
    last: dict[str, torch.Tensor] = field(default_factory=dict)


def _rows(batch: dict) -> int:
    return batch["prompt_ids"].size(0)


def _row_slices(batch: dict, size: int) -> list[dict]:
    """Cut a batch dict into consecutive row chunks (unlike TRL's `split_tensor_dict`, a remainder is kept).

    Tensors with dim >= 1 and lists are sliced on rows; 0-dim tensors and other values are shared by every chunk.
    """
    total = _rows(batch)
    chunks = []
    for start in range(0, total, size):
        stop = min(start + size, total)
        chunk = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                chunk[key] = value[start:stop]
            elif isinstance(value, list):
                chunk[key] = value[start:stop]
            else:
                chunk[key] = value
        chunks.append(chunk)
    return chunks


def _loss_mask(batch: dict) -> torch.Tensor:
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


def _row_advantage(batch: dict, loss_mask: torch.Tensor) -> torch.Tensor:
    advantages = batch["advantages"].float()
    if advantages.dim() == 1:
        return advantages
    # Token-level advantages: the mean over the row's trained tokens.
    mask = loss_mask.float()
    return (advantages * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() < 2:
        return math.nan
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = (x.square().sum() * y.square().sum()).sqrt()
    return (x * y).sum().div(denominator).item() if denominator > 0 else math.nan


def _reusable(batch: dict) -> dict:
    """The tensors of a validation batch that V can be recomputed from at later weights.

    `old_per_token_logps` (the rollout policy's log-probs) is dropped: TRL then uses the current log-probs, i.e. a
    ratio of 1 at the weights V is computed at.
    """
    return {
        key: value.detach()
        for key, value in batch.items()
        if isinstance(value, torch.Tensor) and key != "old_per_token_logps"
    }


def tracin_validation_set(tracin_eval_dataset, eval_dataset, warn: bool = False):
    """The TracIn validation prompts (`tracin_eval_dataset`, else `eval_dataset`), refused with a clear error when
    missing, a dict, not map-style or empty: checked by the trainer before TRL loads the model (`warn`: and a warning
    when `eval_dataset` stands in), and at set-up."""
    dataset = tracin_eval_dataset if tracin_eval_dataset is not None else eval_dataset
    if warn and tracin_eval_dataset is None and eval_dataset is not None and not isinstance(eval_dataset, dict):
        warnings.warn(
            "TracIn validates on `eval_dataset` (no `tracin_eval_dataset` given): their rewards choose the training "
            "rows, so an evaluation on the same problems is no longer held out. Pass other held-out problems as "
            "`tracin_eval_dataset` (`trl-agentic train` uses `trl_agentic.tasks.validation_rows`).",
            UserWarning,
            stacklevel=3,
        )
    if dataset is None:
        raise ValueError(
            "TracIn needs validation prompts: pass `tracin_eval_dataset` (or `eval_dataset`) to the trainer."
        )
    if isinstance(dataset, dict):
        raise ValueError(
            "`eval_dataset` is a dict of datasets; pass the TracIn validation prompts as `tracin_eval_dataset`."
        )
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError("The TracIn validation set must be a map-style dataset (with `len` and indexing).")
    if len(dataset) == 0:
        raise ValueError("The TracIn validation set is empty: it needs at least one prompt.")
    return dataset


class TracInMixin:
    """TracIn row filtering for `AgenticGRPOTrainer`, mixed in before `GRPOTrainer`. Inactive unless
    `args.tracin_enabled`.

    Overrides `_prepare_inputs` (refresh of V; two-pass scoring and masking of the buffered generation batch) and
    `_compute_loss` (the fused step). Its own passes call `GRPOTrainer._compute_loss`, so they use the configured
    `loss_type` and every TRL loss option; their metrics are discarded. `_tracin_state_dict` and
    `_tracin_load_state_dict` give the state that the trainer's checkpoints save and restore. See the module
    docstring and `docs/tracin.md`.
    """

    _tracin: TracInState | None = None

    # ----------------------------------------------------------------------------------------------- start-up

    def _init_tracin(self, tracin_eval_dataset=None) -> None:
        """Check the TracIn set-up and build its state; called at the end of `AgenticGRPOTrainer.__init__`.

        Args:
            tracin_eval_dataset (`Dataset`, *optional*):
                Validation prompts (rows like the training dataset's); `eval_dataset` when None.

        Raises:
            ValueError: TracIn with a model that is not a PEFT LoRA model, LoRA on `lm_head`, no or an empty
                validation set, a mixture-of-experts auxiliary loss, or an unsupported loss type.
        """
        args = self.args
        self._tracin = None
        if not getattr(args, "tracin_enabled", False):
            if tracin_eval_dataset is not None:
                warnings.warn(
                    "`tracin_eval_dataset` is ignored: `tracin_enabled` is False.", UserWarning, stacklevel=3
                )
            return
        if getattr(self, "is_fsdp_enabled", False) or getattr(args, "fsdp", None):
            raise ValueError(
                "TracIn does not support FSDP: FSDP shards the LoRA weights and runs the recorded forwards through its "
                "own wrapped modules, which the influence hooks do not handle. Use DeepSpeed ZeRO-2/3 or DDP, or "
                "disable `tracin_enabled`."
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        refs = validate_tracin_model(unwrapped)
        if args.fp16 or any(ref.lora_A.weight.dtype == torch.float16 for ref in refs):
            raise ValueError(
                "TracIn does not support float16 (`fp16=True` or a float16 adapter): its scoring backward runs "
                "outside the loss scaler, so small per-row gradients underflow to zero. Use `bf16=True` or float32."
            )
        if self.aux_loss_enabled:
            raise ValueError(
                "TracIn needs per-row losses, but the mixture-of-experts load-balancing loss couples the rows of a "
                "micro-batch; set `router_aux_loss_coef=0` or disable `tracin_enabled`."
            )
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(
                f"TracIn does not support loss_type={self.loss_type!r}; use one of {SUPPORTED_LOSS_TYPES}."
            )
        dataset = tracin_validation_set(tracin_eval_dataset, self.eval_dataset)

        disable_checkpointing = reentrant_checkpointing(args)
        if disable_checkpointing:
            # TRL forces reentrant checkpointing for PEFT + ZeRO-3; its first forward runs without autograd, so the
            # hooks could not build gradients from it.
            warnings.warn(
                "TracIn: reentrant gradient checkpointing is on (TRL forces it for PEFT + DeepSpeed ZeRO-3); the "
                "TracIn scoring pass runs with gradient checkpointing disabled, which costs activation memory.",
                UserWarning,
                stacklevel=3,
            )
        layout_allows_fused = (
            args.steps_per_generation == 1
            and self.num_iterations == 1
            and not self._entropy_bonus_enabled
            and self.top_entropy_quantile >= 1.0
        )
        # Under reentrant checkpointing the fused step would run the whole training pass without checkpointing; the
        # two-pass design keeps it for the training pass and gives up only the scoring pass's.
        fused = layout_allows_fused and not disable_checkpointing
        if layout_allows_fused and not fused:
            reason = "reentrant gradient checkpointing (the fused step would train without checkpointing)"
        elif not fused:
            reason = "steps_per_generation > 1, num_iterations > 1 or an entropy option"
        else:
            reason = "one forward and one backward per training row"
        logger.info("TracIn: %s step (%s).", "fused" if fused else "two-pass", reason)
        self._tracin = TracInState(dataset=dataset, fused=fused, disable_checkpointing=disable_checkpointing)

    # ----------------------------------------------------------------------------------------------- checkpoints

    def _tracin_state_dict(self) -> dict[str, Any] | None:
        """The TracIn state a resumed run needs to continue exactly like an uninterrupted one.

        Saved: V (it is the gradient at the weights of its last refresh, which are gone once a step has trained, so it
        cannot be recomputed on resume), whether it is zero, the step of its last refresh (the refresh schedule), the
        rollout count (it seeds the next draw of validation prompts), and the stored validation rollouts with their
        step (one-process runs only: they differ per process, and one process writes the file; a multi-process run
        resumed rolls out afresh at its next refresh). Everything else is rebuilt: the validation
        set, the fused/two-pass choice and the checkpointing flag come from the arguments at start-up, the prompt
        generator is re-seeded from the refresh count at every refresh, the validation rollouts draw from the global
        RNG that the `Trainer` checkpoints, the metrics are TRL's (flushed at every log), and `last` is for inspection
        only.

        V is identical on every process (averaged over processes), so one copy serves every rank.

        Returns:
            A dict of tensors and plain values for `torch.save` (CPU tensors, so the file loads on any device), or
            None when TracIn is off.
        """
        state = self._tracin
        if state is None:
            return None
        direction = None
        if state.direction is not None:
            direction = {
                name: {"A": grad.A.detach().cpu(), "B": grad.B.detach().cpu()}
                for name, grad in state.direction.items()
            }
        val_batch = None
        # The stored validation rollouts differ per process and one process writes this file: they are kept for
        # one-process runs; a multi-process run rolls out afresh at its first refresh after resuming.
        if state.val_batch is not None and self.accelerator.num_processes == 1:
            val_batch = {key: value.detach().cpu() for key, value in state.val_batch.items()}
        return {
            "direction": direction,
            "direction_is_zero": state.direction_is_zero,
            "refreshed_at": state.refreshed_at,
            "refreshes": state.refreshes,
            "val_batch": val_batch,
            "rolled_out_at": state.rolled_out_at,
        }

    def _tracin_load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `_tracin_state_dict` saved (a no-op when TracIn is off).

        Args:
            state_dict (`dict`):
                The output of `_tracin_state_dict`, e.g. as read back by `torch.load`.
        """
        state = self._tracin
        if state is None:
            return
        direction = state_dict["direction"]
        if direction is not None:
            device = self.accelerator.device
            direction = {
                name: LoraGradient(A=grad["A"].to(device), B=grad["B"].to(device)) for name, grad in direction.items()
            }
        state.direction = direction
        state.direction_is_zero = bool(state_dict["direction_is_zero"])
        state.refreshed_at = int(state_dict["refreshed_at"])
        state.refreshes = int(state_dict["refreshes"])
        val_batch = state_dict.get("val_batch")  # absent in checkpoints written before rollout reuse
        if val_batch is not None:
            val_batch = {key: value.to(self.accelerator.device) for key, value in val_batch.items()}
        state.val_batch = val_batch
        state.rolled_out_at = int(state_dict.get("rolled_out_at", -1))

    # ----------------------------------------------------------------------------------------------- overrides

    def _prepare_inputs(self, generation_batch):
        state = self._tracin
        if state is None or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        window_start = self._step % generate_every == 0 or self._buffered_inputs is None
        if window_start and self._tracin_refresh_due():
            self._tracin_refresh_direction()
        inputs = super()._prepare_inputs(generation_batch)
        if window_start and not state.fused:
            # The chunks are TRL's shuffled micro-batches, so each score is the gradient of the row's term in the
            # very loss it is trained with, with the same dropout masks (one seed per micro-batch, used by the
            # scoring forward and by every training forward of that micro-batch).
            for chunk in self._buffered_inputs:
                chunk[_DROPOUT_SEED] = torch.randint(0, 2**62, ())  # 0-dim: not a per-row tensor
            self._tracin_filter_buffer(self._buffered_inputs)
        return inputs

    def _compute_loss(self, model, inputs):
        state = self._tracin
        if state is None or not state.fused or not self.model.training:
            with self._tracin_dropout_rng(inputs):
                return super()._compute_loss(model, inputs)
        return self._tracin_fused_loss(model, inputs)

    @contextmanager
    def _tracin_dropout_rng(self, inputs):
        """Seed the RNG from the micro-batch's `tracin_dropout_seed` (if any) for one forward, restoring it after.

        Dropout masks are drawn in module call order; the same seed and the same forward give the same masks.
        """
        seed = inputs.get(_DROPOUT_SEED) if isinstance(inputs, dict) else None
        if seed is None:
            yield
            return
        device = self.accelerator.device
        devices = [device] if device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            torch.manual_seed(int(seed))
            yield

    # ----------------------------------------------------------------------------------------------- helpers

    @contextmanager
    def _tracin_quiet(self):
        """Run TRL code whose metrics must not be logged and whose entropy-controller updates must not stick."""
        metrics, saved = self._metrics, {name: getattr(self, name, None) for name in _ENTROPY_STATE}
        scratch = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._metrics = scratch
        try:
            yield scratch
        finally:
            self._metrics = metrics
            for name, value in saved.items():
                setattr(self, name, value)

    def _tracin_no_reentrant_checkpointing(self):
        """Disables gradient checkpointing while it is reentrant (the hooks cannot see through its no-grad forward)."""
        if not self._tracin.disable_checkpointing:
            return nullcontext()
        return checkpointing_paused(self.accelerator.unwrap_model(self.model))

    @contextmanager
    def _tracin_hooks(self):
        """LoRA ghost hooks on the policy, registered for one influence pass only."""
        with self._tracin_no_reentrant_checkpointing(), LoraGhostHooks(self.accelerator.unwrap_model(self.model)) as h:
            yield h

    @contextmanager
    def _tracin_forward_override(self, capture: dict | None = None, replay: tuple | None = None):
        """Capture the outputs of `_get_per_token_logps_and_entropies` or replay captured ones without a forward."""
        had_own = "_get_per_token_logps_and_entropies" in self.__dict__
        previous = self.__dict__.get("_get_per_token_logps_and_entropies")
        original = self._get_per_token_logps_and_entropies

        def patched(*args, **kwargs):
            if replay is not None:
                return replay
            out = original(*args, **kwargs)
            capture["out"] = out
            return out

        self._get_per_token_logps_and_entropies = patched
        try:
            yield
        finally:
            if had_own:
                self._get_per_token_logps_and_entropies = previous
            else:
                del self._get_per_token_logps_and_entropies

    def _tracin_base_loss(self, model, inputs):
        """TRL's own `_compute_loss` (not the fused override), with the micro-batch's dropout seed if it has one."""
        with self._tracin_dropout_rng(inputs):
            return super()._compute_loss(model, inputs)

    # ----------------------------------------------------------------------------------------------- validation

    def _tracin_refresh_due(self) -> bool:
        state = self._tracin
        last = None if state.direction is None else state.refreshed_at
        return due(self.state.global_step, last, self.args.tracin_val_refresh_steps)

    def _tracin_validation_rows(self) -> list[dict]:
        """This process's validation rows: `tracin_val_batch_size` prompts, each repeated for its group.

        The prompts come from a permutation seeded by (`seed`, refresh count) with a private generator, identical on
        every process and independent of the global RNG; process p takes the p-th slice (wrapping around a small
        set).
        """
        state, args = self._tracin, self.args
        n, per_process = len(state.dataset), args.tracin_val_batch_size
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + state.refreshes)
        order = torch.randperm(n, generator=generator).tolist()
        start = self.accelerator.process_index * per_process
        indices = [order[i % n] for i in range(start, start + per_process)]
        # A fresh dict per row: TRL writes rollout fields into the rows.
        return [dict(state.dataset[i]) for i in indices for _ in range(args.tracin_val_num_generations)]

    def _tracin_rollout_validation(self, rows: list[dict]) -> tuple[dict, float]:
        """Roll out, score and compute advantages for validation rows through the trainer's own rollout path.

        The training metrics, completion logs and token counter are left untouched; group size is
        `tracin_val_num_generations` for this call.

        Returns:
            The batch dict (as `_generate_and_score_completions` returns it) and the mean validation reward.
        """
        saved_logs, saved_generations = self._logs, self.num_generations
        saved_tokens = self.state.num_input_tokens_seen
        self._logs = {
            "images": deque(),
            "prompt": deque(),
            "completion": deque(),
            "rewards": defaultdict(deque),
            "advantages": deque(),
            "extra": defaultdict(deque),
        }
        self.num_generations = self.args.tracin_val_num_generations
        self._tracin_validating = True  # read by the report's trajectory recorder: these rows are not training rows
        try:
            with self._tracin_quiet() as scratch:
                batch = self._generate_and_score_completions(rows)
        finally:
            self._tracin_validating = False
            self._logs, self.num_generations = saved_logs, saved_generations
            self.state.num_input_tokens_seen = saved_tokens
        rewards = scratch["train"].get("reward", [])
        return self._tracin_zero_groups_without_spread(batch), (rewards[-1] if rewards else math.nan)

    def _tracin_trained_tokens(self, batch: dict) -> int:
        """Tokens of the validation batch that V trains on, over every process (a collective): 0 when every validation
        rollout was lost to the infrastructure or masked (truncated), which also makes V exactly 0."""
        return int(self.accelerator.reduce(_loss_mask(batch).sum().to(torch.long), reduction="sum").item())

    def _tracin_zero_groups_without_spread(self, batch: dict) -> dict:
        """The validation batch with advantage 0 on its tied rows (`advantages.tied_rows`): the baseline rows of a group
        whose baseline rewards are all equal, and its rows out of the baseline with that same reward (a snapshot
        segment); a negative out of the baseline with another reward keeps its advantage, measured from its episode.

        GRPO's advantages there are 0 in exact arithmetic but float32 rounding noise of one sign in TRL's computation
        (e.g. six rewards of 0.3: 3.0e-4 on every row); when no validation group has a spread, that noise *is* V, a
        "raise (or lower) the validation completions' likelihood" direction whose sign rounding picked, and rows would be
        selected by it. With the zeros V is exactly 0 there and every row is kept (`direction_is_zero`). Decided from the
        rewards (`BatchAugmenter.last_tied_rows`, the batch's first rows). Applies to the GRPO advantages and to CoPO's
        (`A_traj` times a weight); RLVCR's additive rule and custom estimators keep their advantages, which can carry
        signal without a reward spread.
        """
        tied = self._augmenter.last_tied_rows
        if tied is None:
            return batch
        if not zero_without_reward_spread(self.advantage_estimator, self.args):
            return batch
        advantages = batch["advantages"]
        rows = torch.zeros(advantages.size(0), dtype=torch.bool, device=advantages.device)
        rows[: tied.numel()] = tied.to(rows.device)  # then the estimator's rows and padding rows: not tied here
        return dict(batch, advantages=advantages.masked_fill(rows if advantages.dim() == 1 else rows[:, None], 0.0))

    def _tracin_validation_gradient(self, batch: dict) -> LoraGradients:
        """V: the gradient of TRL's loss on the validation batch, per LoRA layer, averaged over processes."""
        model = self.model
        direction = None
        # Every counted validation row (or, `bnpo`, token) of every process weighs the same, as in training
        # (`loss_weights.py`): shares of the global counts, times the processes the all-reduce's mean divides by.
        # Local counts weighed a process's rows by its own row count, padding included (V and every score 0.75x on
        # 2 processes with 6 and 2 + 2 padding rows; `bnpo` a different direction).
        counts = torch.stack([counted_rows(batch).sum(), _loss_mask(batch).sum()]).to(torch.float64)
        rows, tokens = self.accelerator.reduce(counts, reduction="sum").clamp(min=1.0).tolist()
        processes = self.accelerator.num_processes
        with self._tracin_hooks() as hooks, self._tracin_quiet():
            for chunk in _row_slices(batch, self.args.per_device_train_batch_size):
                # TRL's own loss on each chunk: the validation batch is not split into training micro-batches, so the
                # row weighting of `loss_weights.py` (which assumes that split) does not apply. Each chunk's loss is
                # weighed by its share of the batch, so that the sum is TRL's loss over the whole validation batch
                # (the chunks' own means weighed the rows of a short last chunk more: 6 rows in chunks of 4 and 2
                # gave the last two rows twice the weight of the others under `grpo`).
                chunk.pop("num_rows_in_batch", None)
                if self.loss_type in ROW_MEAN_LOSSES:  # TRL: the mean over the chunk's rows
                    share = _rows(chunk) * processes / rows
                elif self.loss_type in LOCAL_TOKEN_LOSSES:  # TRL: the mean over the chunk's tokens
                    share = float(_loss_mask(chunk).sum().clamp(min=1.0)) * processes / tokens
                else:  # normalised by the batch's `num_items_in_batch`, which every chunk shares
                    share = 1.0
                with hooks.record():
                    loss = self._tracin_base_loss(model, chunk) * share
                direction = hooks.accumulate_gradient(loss, into=direction)
        return all_reduce_(direction, op="mean")

    def _tracin_rollouts_due(self) -> bool:
        state = self._tracin
        last = None if state.val_batch is None else state.rolled_out_at
        return due(self.state.global_step, last, self.args.tracin_val_rollout_steps)

    def _tracin_refresh_direction(self) -> None:
        """Recompute V at the current weights; roll out new validation prompts first when they are due.

        Between rollouts V is the gradient of TRL's loss on the stored validation rollouts at the current weights,
        with their old log-probs dropped (ratio 1 at the current policy: the on-policy estimator applied to
        earlier samples, without importance weights).
        """
        state = self._tracin
        metrics = self._metrics["train"]
        if self._tracin_rollouts_due():
            rows = self._tracin_validation_rows()
            state.refreshes += 1
            batch, val_reward = self._tracin_rollout_validation(rows)
            state.val_batch = _reusable(batch)
            state.rolled_out_at = self.state.global_step
            metrics["tracin/val_reward"].append(val_reward)
        else:
            batch = state.val_batch
        direction = self._tracin_validation_gradient(batch)
        state.direction = direction
        state.direction_is_zero = is_zero(direction)
        state.refreshed_at = self.state.global_step
        if state.direction_is_zero:  # V is all-reduced: the same on every process, which all join the count below
            lost = self._tracin_trained_tokens(batch) == 0
            if self.accelerator.is_main_process:
                warn_uninformative_direction(self.state.global_step, self.args.tracin_val_num_generations, lost)
        elif self.beta != 0.0:
            # Every validation advantage 0 (no group with a spread): V is the KL term's gradient alone, and rows are
            # picked by how far they move the policy back toward the reference, not by any reward.
            spread = batch["advantages"].detach().abs().sum().to(torch.float64)
            if float(self.accelerator.reduce(spread, reduction="sum")) == 0.0 and self.accelerator.is_main_process:
                warn_kl_only_direction(self.state.global_step, self.args.tracin_val_num_generations, self.beta)
        metrics["tracin/val_grad_norm"].append(gradient_norm(direction))

    # ----------------------------------------------------------------------------------------------- selection

    def _tracin_select(self, scores: torch.Tensor, batches: list[dict]) -> torch.Tensor:
        """Global selection from this process's row scores; returns this process's (B,) bool mask.

        Gathers (score, valid, advantage, tokens) of every row of every process in one collective, applies
        `select_rows` (or keeps every valid row when V is zero), and logs the `tracin/*` metrics.
        """
        state, args = self._tracin, self.args
        device = scores.device
        masks = [_loss_mask(b) for b in batches]
        tokens = torch.cat([m.sum(1) for m in masks]).to(device=device, dtype=torch.float64)
        valid = tokens > 0
        if "row_kind" in batches[0]:
            kinds = torch.cat([b["row_kind"] for b in batches]).to(device)
            valid &= kinds != int(RowKind.PADDING)
        advantages = torch.cat([_row_advantage(b, m) for b, m in zip(batches, masks)]).to(device)
        # Each process's loss is a 1/world_size share of the update (gradients are averaged over processes), so
        # per-row scores of the global objective, identical to a single-process run of the same global batch, are:
        scores = scores / self.accelerator.num_processes
        local = torch.stack([scores.to(torch.float64), valid.to(torch.float64), advantages.double(), tokens], dim=1)
        gathered = self.accelerator.gather(local)
        g_scores, g_valid, g_adv = gathered[:, 0], gathered[:, 1].bool(), gathered[:, 2]
        if state.direction_is_zero:
            selected = g_valid.clone()
        else:
            selected = select_rows(
                g_scores,
                g_valid,
                mode=args.tracin_selection,
                fraction=args.tracin_top_fraction,
                threshold=args.tracin_threshold,
                min_selected=args.tracin_min_selected,
            )
        n_local = scores.shape[0]
        start = self.accelerator.process_index * n_local
        mine = selected[start : start + n_local]

        n_valid = int(g_valid.sum())
        valid_scores = g_scores[g_valid]
        metrics = self._metrics["train"]
        metrics["tracin/selected_ratio"].append(int(selected.sum()) / n_valid if n_valid else math.nan)
        metrics["tracin/num_selected"].append(float(selected.sum()))
        metrics["tracin/score_mean"].append(valid_scores.mean().item() if n_valid else math.nan)
        metrics["tracin/score_pos_frac"].append((valid_scores > 0).double().mean().item() if n_valid else math.nan)
        metrics["tracin/score_adv_corr"].append(_pearson(valid_scores, g_adv[g_valid]))
        state.last = {"scores": scores.detach(), "selected": mine.clone(), "valid": valid.clone()}
        return mine

    def _tracin_selected_items(self, mask: torch.Tensor) -> torch.Tensor:
        """Global number of trained tokens after selection (the recomputed `num_items_in_batch`)."""
        return self.accelerator.gather(mask.sum().reshape(1)).sum()

    def _tracin_selected_rows(self, selected: torch.Tensor, batches: list[dict]) -> torch.Tensor:
        """Global number of rows that count after the selection (the recomputed `num_rows_in_batch`).

        The same rule as the unfiltered batch (`trl_agentic.batch.counted_rows`), less the trainable rows TracIn left
        out: selecting every trainable row gives back `num_rows_in_batch`, hence exactly the unfiltered step. A counted
        row without trained tokens (one TRL masks as truncated) is not selectable and stays counted, as in TRL's mean.
        """
        counted = torch.cat([counted_rows(b) for b in batches]).to(selected.device)
        trainable = torch.cat([_loss_mask(b).sum(1) > 0 for b in batches]).to(selected.device)
        kept = counted & (selected.bool() | ~trainable)
        return self.accelerator.gather(kept.sum().reshape(1)).sum()

    @staticmethod
    def _tracin_masked(batch: dict, selected: torch.Tensor, num_items: torch.Tensor, num_rows: torch.Tensor) -> dict:
        """`batch` with the loss mask of unselected rows zeroed (via `tool_mask`) and the trained token and row counts
        (`num_items_in_batch`, `num_rows_in_batch`) of the selected rows, so that training on the masked batch equals
        training on the selected rows alone, for every loss type."""
        masked = dict(batch)
        tool_mask = batch.get("tool_mask", torch.ones_like(batch["completion_mask"]))
        masked["tool_mask"] = tool_mask * selected.unsqueeze(1).to(tool_mask.dtype)
        for key, value in (("num_items_in_batch", num_items), ("num_rows_in_batch", num_rows)):
            old = batch.get(key)
            if old is not None:
                masked[key] = value.to(device=old.device, dtype=old.dtype).reshape(old.shape)
        return masked

    # ----------------------------------------------------------------------------------------------- two-pass

    def _tracin_filter_buffer(self, chunks: list[dict]) -> None:
        """Score TRL's buffered micro-batches, select globally and mask them in place."""
        direction = self._tracin.direction
        scores = []
        with self._tracin_hooks() as hooks, self._tracin_quiet():
            for chunk in chunks:
                # Projected recording: each layer keeps (B, S, r) between its forward and its backward hook.
                with hooks.record(direction=direction):
                    loss = self._tracin_base_loss(self.model, chunk)
                scores.append(hooks.score_rows(loss, direction))
        selected = self._tracin_select(torch.cat(scores), chunks)
        offsets = [0]
        for chunk in chunks:
            offsets.append(offsets[-1] + _rows(chunk))
        chunk_selected = [selected[offsets[i] : offsets[i + 1]] for i in range(len(chunks))]
        masks = [_loss_mask(c) * s.unsqueeze(1).to(c["completion_mask"].dtype) for c, s in zip(chunks, chunk_selected)]
        num_items = self.accelerator.gather(torch.stack([m.sum() for m in masks]).sum().reshape(1)).sum()
        num_rows = self._tracin_selected_rows(selected, chunks)
        for i, (chunk, mine) in enumerate(zip(chunks, chunk_selected)):
            masked = self._tracin_masked(chunk, mine, num_items, num_rows)
            for key in ("tool_mask", "num_items_in_batch", "num_rows_in_batch"):
                if key in masked:
                    chunk[key] = masked[key]
            chunk["tracin_score"] = self._tracin.last["scores"][offsets[i] : offsets[i + 1]]
            chunk["tracin_selected"] = mine

    # ----------------------------------------------------------------------------------------------- fused

    def _fused_scale(
        self, inputs: dict, mask: torch.Tensor, selected: torch.Tensor, num_items: torch.Tensor, num_rows: torch.Tensor
    ) -> float:
        """Factor c with `loss_masked = c * sum_{b selected} ell_b` as functions of the weights.

        Masking leaves each selected row's term unchanged except for a normaliser that counts what is trained on: the
        global token count for dapo/cispo/vespo and for trl-agentic's bnpo (every token weighs the same,
        `loss_weights.py`), the micro-batch token count for TRL's own bnpo, the global row count (`num_rows_in_batch`)
        for the row-mean losses.
        """
        equal_tokens = "num_rows_in_batch" in inputs and self._equal_token_weights
        if self.loss_type in _GLOBAL_TOKEN_LOSSES or (self.loss_type in _LOCAL_TOKEN_LOSSES and equal_tokens):
            return max(float(inputs["num_items_in_batch"]), 1.0) / max(float(num_items), 1.0)
        if self.loss_type in _LOCAL_TOKEN_LOSSES:
            kept = (mask * selected.unsqueeze(1).to(mask.dtype)).sum()
            return max(float(mask.sum()), 1.0) / max(float(kept), 1.0)
        if "num_rows_in_batch" in inputs:
            return max(float(inputs["num_rows_in_batch"]), 1.0) / max(float(num_rows), 1.0)
        # A batch not built by trl-agentic: TRL's own per-row mean over the micro-batch, which masking does not change.
        return 1.0

    def _tracin_wrapper_anchor(self, model, inputs: dict) -> torch.Tensor:
        """A zero-valued scalar from a one-token forward through the wrapped model (DDP, DeepSpeed engine).

        The recorded forward runs on the unwrapped module, so the wrapper never sees the scoring backward, which
        writes no parameter gradient (DeepSpeed >= 0.18 would otherwise run its gradient-reduction epilogue at the
        end of it). Adding `0 * anchor` to the surrogate lets the wrapper's own backward bookkeeping (DDP reducer,
        DeepSpeed prologue and epilogue, ZeRO-3 gathers) run once per micro-step, as in an ordinary step.
        """
        ids = inputs["prompt_ids"][:1, -1:]
        # Not under reentrant checkpointing: its nested backward would accumulate the LoRA gradients a second time in
        # the same engine backward (ZeRO-3 rejects a parameter reduced twice in one bucket).
        with self._tracin_no_reentrant_checkpointing():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        return logits.float().sum() * 0.0

    def _tracin_fused_loss(self, model, inputs: dict) -> torch.Tensor:
        """One recorded training forward and one backward: scores, global selection and the selected rows' gradient.

        Returns a scalar whose gradient is the gradient of the masked training loss (through the surrogate
        `sum <W, G_W>`) and whose value is that loss (recomputed from the captured log-probs, no second forward).
        """
        state = self._tracin
        if state.direction is None:  # `_compute_loss` called outside the training loop's `_prepare_inputs`
            self._tracin_refresh_direction()
        direction = state.direction
        unwrapped = self.accelerator.unwrap_model(model)
        captured: dict = {}
        with self._tracin_hooks() as hooks:
            with self._tracin_quiet(), self._tracin_forward_override(capture=captured), hooks.record():
                loss = self._tracin_base_loss(unwrapped, inputs)
            scores = hooks.score_rows(loss, direction, keep=True)
            selected = self._tracin_select(scores, [inputs])
            mask = _loss_mask(inputs)
            num_items = self._tracin_selected_items(mask * selected.unsqueeze(1).to(mask.dtype))
            num_rows = self._tracin_selected_rows(selected, [inputs])
            scale = self._fused_scale(inputs, mask, selected, num_items, num_rows)
            weights = selected.to(scores.dtype) * scale
            gradients = hooks.selected_gradients(weights)
            hooks.release()
            for ref in hooks.layers:  # every LoRA weight gets a gradient (DDP expects all of them)
                if ref.name not in gradients:
                    some = next(iter(direction.values())).A
                    gradients[ref.name] = LoraGradient(
                        A=some.new_zeros(ref.lora_A.out_features, ref.lora_A.in_features),
                        B=some.new_zeros(ref.lora_B.out_features, ref.lora_B.in_features),
                    )
            surrogate = hooks.gradient_surrogate(gradients)
        if model is not unwrapped:
            surrogate = surrogate + self._tracin_wrapper_anchor(model, inputs)
        masked = self._tracin_masked(inputs, selected, num_items, num_rows)
        logps, entropies, aux = captured["out"]
        replay = (logps.detach(), None if entropies is None else entropies.detach(), aux)
        with torch.no_grad(), self._tracin_forward_override(replay=replay):
            value = self._tracin_base_loss(model, masked)  # logs TRL's metrics for the trained (masked) batch
        return surrogate - surrogate.detach() + value.to(surrogate.dtype)
