"""TracIn influence of training rows on a validation loss, restricted to the active adapter's LoRA parameters."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .hooks import LoraGhostHooks
from .layers import lora_parameters, validate_tracin_model

__all__ = ["lora_influence_scores", "lora_parameters", "validate_tracin_model"]


def lora_influence_scores(
    model: nn.Module,
    per_sample_losses: Callable[[nn.Module], Tensor],
    val_loss: Callable[[nn.Module], Tensor],
) -> Tensor:
    """Per-sample TracIn scores `score_i = <grad ell_i, grad L_val>` over the LoRA weights (A and B of every layer).

    Two forwards and two `torch.autograd.grad` calls in total, whatever the number of samples: the validation
    gradient V is built from the hooks, then the training backward scores every row against V inside the `lora_B`
    backward hooks (see `LoraGhostHooks`). No per-sample backward, and `param.grad` is left untouched. The model's
    train/eval mode is not changed: LoRA dropout applies if the model is in train mode, with the masks of each
    closure's own forward.

    Args:
        model: A `peft.PeftModel` with LoRA adapters (checked by `validate_tracin_model`).
        per_sample_losses: `per_sample_losses(model)` runs one forward and returns an (N,) tensor whose sum is the
            training loss; row i of the batch must be sample i and rows must not interact (true for causal LMs).
        val_loss: `val_loss(model)` runs one forward and returns the scalar validation loss.

    Returns:
        (N,) scores, float32 (float64 for a float64 model). Positive means a gradient step on sample i decreases the
        validation loss, to first order.

    Raises:
        ValueError: For an unsupported model (see `validate_tracin_model`) or closures returning the wrong shapes.
        RuntimeError: If a forward runs without autograd while recording (e.g. reentrant gradient checkpointing).
    """
    validate_tracin_model(model)
    with LoraGhostHooks(model) as hooks:
        with hooks.record():
            validation = val_loss(model)
        if validation.dim() != 0:
            raise ValueError(f"`val_loss` must return a scalar, got shape {tuple(validation.shape)}.")
        direction = hooks.accumulate_gradient(validation)

        with hooks.record(direction=direction):
            losses = per_sample_losses(model)
        if losses.dim() != 1:
            raise ValueError(f"`per_sample_losses` must return a 1-D tensor, got shape {tuple(losses.shape)}.")
        scores = hooks.score_rows(losses.sum(), direction)
    if scores.shape != losses.shape:
        raise ValueError(
            f"`per_sample_losses` returned {losses.shape[0]} losses but the LoRA activations have {scores.shape[0]} "
            "rows; sample i must be row i of the batch."
        )
    return scores
