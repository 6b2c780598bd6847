"""Equal weight for every real row in TRL's per-row loss types, whatever the padding and the row selection.

TRL's `grpo`, `sapo`, `dr_grpo` and `luspo` losses average per-row terms over the rows of a micro-batch: each row
weighs `1 / (B_mb * GA)` on its process, and processes are averaged. With a fixed batch that is `1 / R` for the `R`
rows of the generation batch. trl-agentic's batches hold zero-weight padding rows (variable groups, ranks with
different row counts) and TracIn trains on a subset of rows, so `B_mb * GA * num_processes` is no longer the number of
rows trained on. The batch therefore carries `num_rows_in_batch`, the global number of rows that are trained on (real,
and selected when TracIn is on), and the loss of a micro-batch is rescaled so that every such row weighs
`1 / num_rows_in_batch` over the generation batch, as `num_items_in_batch` does for the token-level losses:

    factor = B_mb * num_processes * steps_per_generation / num_rows_in_batch   (train; eval: no steps_per_generation)

Without padding and selection the factor is exactly 1 and TRL's loss is returned untouched (bit for bit). Only the
policy term is rescaled: TRL's entropy bonus and MoE auxiliary loss do not average over rows, so they are kept as
they are.
"""

from __future__ import annotations

import torch

ROW_MEAN_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")


def row_weight_factor(inputs: dict, loss_type: str, num_processes: int, steps_per_generation: int) -> float:
    """
    The factor that turns TRL's per-row loss of a micro-batch into the equal-weight one (1.0 when nothing changes).

    Args:
        inputs (`dict`): The micro-batch (with `num_rows_in_batch` when trl-agentic built it).
        loss_type (`str`): TRL's `loss_type`.
        num_processes (`int`): Number of processes.
        steps_per_generation (`int`): Micro-batches the generation batch is split into (1 in eval).

    Returns:
        `float`
    """
    rows = inputs.get("num_rows_in_batch")
    if rows is None or loss_type not in ROW_MEAN_LOSSES:
        return 1.0
    slots = inputs["prompt_ids"].size(0) * num_processes * steps_per_generation
    return slots / max(int(rows), 1)


class RowWeightedLossMixin:
    """Overrides `GRPOTrainer._compute_loss` to apply `row_weight_factor` (see the module docstring)."""

    def _compute_loss(self, model, inputs):
        training = self.model.training
        factor = row_weight_factor(
            inputs,
            self.loss_type,
            self.accelerator.num_processes,
            self.args.steps_per_generation if training else 1,
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
        captured = {}
        had_own = "_get_per_token_logps_and_entropies" in self.__dict__
        original = self._get_per_token_logps_and_entropies

        def capture(*args, **kwargs):
            captured["out"] = original(*args, **kwargs)
            return captured["out"]

        self._get_per_token_logps_and_entropies = capture
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            if had_own:
                self._get_per_token_logps_and_entropies = original
            else:
                del self._get_per_token_logps_and_entropies
        _, entropies, aux_loss = captured["out"]
        accumulation = self.current_gradient_accumulation_steps if training else 1.0
        other = torch.zeros((), dtype=loss.dtype, device=loss.device)
        if self._entropy_bonus_enabled:
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            if self.top_entropy_quantile < 1.0:
                mask = mask * self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            other = other - coef * (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        if self.aux_loss_enabled:
            other = other + self.router_aux_loss_coef * aux_loss / accumulation
        return factor * loss - (factor - 1.0) * other
