"""Equal compute for the ablation's budget arms (amendment 3): token passes through the model, not seconds.

A budget in seconds is equal compute only when the control and the budget arm run at one machine speed, and this
machine's speed moved 1.5x between sessions without any probe seeing it (docs/ablation.md, findings). A token pass
is one token through the base model's decoder, counted by a forward pre-hook, so the count does not depend on the
machine, its load or the session: a deterministic run records the same count anywhere.

What a pass counts: every forward of the decoder adds the tokens it processes (its new positions whose attention
mask is 1; all of them without a mask), so generation counts its prefill and each decoded token once, and a prefix
reused from a cache is not counted again. Padding a batch holds is not counted where the mask marks it: a prompt's
left padding, a training row's positions after its end; rows that finished generating keep decoding until the batch
does, with mask 1 (transformers extends it), and are counted, as the work is done. A forward with autograd on is
followed by a backward through the frozen base weights (LoRA: gradients with respect to activations, about one
forward's multiply-adds), so it counts `BACKWARD_FACTOR` = 2 times; TracIn's scoring pass (a backward to the LoRA
outputs) is such a pair too, and with `steps_per_generation > 1` TracIn trains every row, the rejected ones masked,
so it pays that pass for every row. Left out: attention's cost growing with the context and the LM head (outside
the decoder; proportional to the positions whose logits are computed), for every arm alike; the optimizer and the
tools; and TracIn's per-row products in its LoRA hooks (a few % of a scoring pass at r=16), which favours `tracin`.
"""

from __future__ import annotations

BACKWARD_FACTOR = 2  # forward + the activation-gradient backward of frozen weights (LoRA trains only the adapters)


def _decoder(model):
    """The module every forward of `model` passes through, whichever wrapper (PEFT, accelerate's autocast, the
    prefix cache's prefill on the base model) was called: the base model's decoder."""
    from ..rollout.prefix_cache import generation_module  # the base model, past torch.compile's and PEFT's wrappers

    return generation_module(model).get_decoder()


class TokenPasses:
    """Counts token passes through `model` while attached (`attach` / `detach`, or as a context manager).

    Attributes:
        forward_tokens: Tokens through a forward without autograd (generation, reference or old log-probabilities).
        backward_tokens: Tokens through a forward with autograd on (each also back-propagated).
    """

    def __init__(self, model):
        self._module = _decoder(model)
        self._handle = None
        self.forward_tokens = 0
        self.backward_tokens = 0
        self.per_step: list[int] = []  # the total after each optimizer step (`stop_at_token_passes`)

    @property
    def total(self) -> int:
        return self.forward_tokens + BACKWARD_FACTOR * self.backward_tokens

    def attach(self) -> TokenPasses:
        if self._handle is None:
            self._handle = self._module.register_forward_pre_hook(self._count, with_kwargs=True)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> TokenPasses:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _count(self, module, args, kwargs) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2]
        new = shape[1]
        mask = kwargs.get("attention_mask")
        if mask is None:  # every position is a token
            tokens = shape[0] * new
        elif isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == shape[0] and mask.shape[1] >= new:
            tokens = int(mask[:, mask.shape[1] - new :].sum())
        else:  # a 4-D mask (compileable caches) would silently count padding: the unit must not change unseen
            raise ValueError(
                f"TokenPasses counts a 2-D attention mask of at least {new} columns; got {type(mask).__name__} of "
                f"shape {tuple(getattr(mask, 'shape', ()))}."
            )
        if torch.is_grad_enabled():
            self.backward_tokens += tokens
        else:
            self.forward_tokens += tokens

    def record(self) -> dict:
        return {
            "total": self.total,
            "forward_tokens": self.forward_tokens,
            "backward_tokens": self.backward_tokens,
            "backward_factor": BACKWARD_FACTOR,
            "per_step": list(self.per_step),
        }


def stop_at_token_passes(budget: int | None, counter: TokenPasses):
    """A `TrainerCallback` that stops training at the end of the first optimizer step after which `counter` has
    counted `budget` token passes (with a constant learning rate a stopped run is a prefix of a longer one; the last
    step may overshoot the budget, by less than one step). It never clears a stop `max_steps` asked for. It also
    records `counter.total` after every step in `counter.per_step` (`budget=None`: only that)."""
    from transformers import TrainerCallback

    class StopAtTokenPasses(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            counter.per_step.append(counter.total)
            if budget is not None and counter.total >= budget:
                control.should_training_stop = True

    return StopAtTokenPasses()
