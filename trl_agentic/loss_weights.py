"""Equal weight for every real row (per-row losses) or token (bnpo), whatever the padding and the row selection.

TRL's `grpo`, `sapo`, `dr_grpo` and `luspo` losses average per-row terms over the rows of a micro-batch: each row
weighs `1 / (B_mb * GA)` on its process, and processes are averaged. With a fixed batch that is `1 / R` for the `R`
rows of the generation batch. trl-agentic's batches hold rows that are not trained (zero-weight padding rows for groups
of variable size and ranks with different row counts, rollouts lost to infrastructure) and TracIn trains on a subset
of rows, so `B_mb * GA * num_processes` is no longer the number of rows trained on. The batch therefore carries
`num_rows_in_batch`, the global number of rows that count (`trl_agentic.batch.counted_rows`, minus the rows TracIn
leaves out), and the loss of a micro-batch is rescaled so that every such row weighs `1 / num_rows_in_batch` over the
generation batch, as `num_items_in_batch` does for the token-level losses:

    factor = B_mb * num_processes * steps_per_generation / num_rows_in_batch   (train; eval: no steps_per_generation)

`bnpo` divides each micro-batch by its own token count `T_mb`, so the real tokens of a micro-batch filled with padding
rows weigh up to `B_mb` times more than those of a full one. When the trainer can reshape batches (a feature that adds
or drops rows, `row_selection`, or trl-agentic's loop, on: `equal_token_weights`), every real token weighs the same
instead: the normaliser is the generation batch's token count shared equally among its micro-batches (as `dapo`'s):

    factor = T_mb * num_processes * steps_per_generation / num_items_in_batch

With every such feature off, TRL's `bnpo` is kept as it is (TRL's own per-micro-batch normaliser: features off stays
TRL bit for bit). `dapo`, `cispo` and `vespo` already divide by the global `num_items_in_batch`. Without padding and
selection the per-row factor is exactly 1 and TRL's loss is returned untouched (bit for bit). Only the policy term is
rescaled: TRL's entropy bonus and MoE auxiliary loss are kept as TRL computes them. The entropy bonus is, by TRL's
definition, the mean entropy over each micro-batch's trained tokens (divided by the accumulation steps), so its
per-token weight is not equalised: with padding rows, the tokens of a sparse micro-batch get a larger share of it.
"""

from __future__ import annotations

import torch

from .estimators import grpo_estimator

ROW_MEAN_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")
# Normalised by the micro-batch's own token count in TRL.
LOCAL_TOKEN_LOSSES = ("bnpo",)


def row_weight_factor(
    inputs: dict, loss_type: str, num_processes: int, steps_per_generation: int, equal_token_weights: bool = False
) -> float:
    """
    The factor that turns TRL's loss of a micro-batch into the equal-weight one (1.0 when nothing changes).

    Args:
        inputs (`dict`): The micro-batch (with `num_rows_in_batch` when trl-agentic built it).
        loss_type (`str`): TRL's `loss_type`.
        num_processes (`int`): Number of processes.
        steps_per_generation (`int`): Micro-batches the generation batch is split into (1 in eval).
        equal_token_weights (`bool`, *optional*, defaults to `False`):
            Whether `bnpo` weighs every real token of the generation batch the same (see the module docstring).

    Returns:
        `float`
    """
    rows = inputs.get("num_rows_in_batch")
    if rows is None:
        return 1.0
    if loss_type in ROW_MEAN_LOSSES:
        slots = inputs["prompt_ids"].size(0) * num_processes * steps_per_generation
        return slots / max(int(rows), 1)
    if loss_type in LOCAL_TOKEN_LOSSES and equal_token_weights:
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        tokens = max(float(mask.sum()), 1.0)  # TRL's `mask.sum().clamp(min=1)`
        return tokens * num_processes * steps_per_generation / max(float(inputs["num_items_in_batch"]), 1.0)
    return 1.0


class RowWeightedLossMixin:
    """Overrides `GRPOTrainer._compute_loss` to apply `row_weight_factor` (see the module docstring)."""

    @property
    def _equal_token_weights(self) -> bool:
        """Whether batches can differ from TRL's (rows added, dropped or padded): then `bnpo` weighs tokens equally.
        An estimator passed to the trainer counts as the config's name does (it may add rows)."""
        return bool(
            self.args.agentic_features_enabled
            or self.args.row_selection != "none"  # masks or drops rows as TracIn does
            or getattr(self, "_uses_agentic_loop", False)
            or getattr(self, "advantage_estimator", grpo_estimator) is not grpo_estimator
        )

    def _compute_loss(self, model, inputs):
        training = self.model.training
        factor = row_weight_factor(
            inputs,
            self.loss_type,
            self.accelerator.num_processes,
            self.args.steps_per_generation if training else 1,
            self._equal_token_weights,
        )
        if factor == 1.0:
            return super()._compute_loss(model, inputs)
        if not self._entropy_bonus_enabled and not self.aux_loss_enabled:
            return super()._compute_loss(model, inputs) * factor
        # The entropy bonus and the auxiliary loss are not per-row averages: rescale the policy term only, i.e.
        # factor * loss - (factor - 1) * (bonus + aux). Their values are recomputed from the captured forward outputs.
        coef = self.entropy_coef
        if self.use_adaptive_entropy and not self._last_world_entropy <= self.args.entropy_target:
            coef = 0.0  # TRL gates the bonus on the previous window's entropy, read before its update
        # The high-entropy mask too: `get_high_entropy_mask` gathers over every process, so computing it again here,
        # where only processes whose factor is not 1 come, would leave the others one collective behind.
        captured, originals = {}, {}
        for name in ("_get_per_token_logps_and_entropies", "get_high_entropy_mask"):
            originals[name] = (name in self.__dict__, getattr(self, name))

            def capture(*args, _name=name, _original=originals[name][1], **kwargs):
                captured[_name] = _original(*args, **kwargs)
                return captured[_name]

            setattr(self, name, capture)
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            for name, (had_own, original) in originals.items():
                if had_own:
                    setattr(self, name, original)
                else:
                    delattr(self, name)
        _, entropies, aux_loss = captured["_get_per_token_logps_and_entropies"]
        accumulation = self.current_gradient_accumulation_steps if training else 1.0
        other = torch.zeros((), dtype=loss.dtype, device=loss.device)
        if self._entropy_bonus_enabled:
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            if self.top_entropy_quantile < 1.0:
                mask = mask * captured["get_high_entropy_mask"]
            other = other - coef * (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        if self.aux_loss_enabled:
            other = other + self.router_aux_loss_coef * aux_loss / accumulation
        return factor * loss - (factor - 1.0) * other
