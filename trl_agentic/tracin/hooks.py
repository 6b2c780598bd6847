"""Forward/backward hooks on PEFT LoRA modules that turn one batched backward into per-row LoRA gradient information.

Notation (per LoRA layer, rows b, positions s): `x` is the post-dropout input of `lora_A` (d_in), `h = A x` its output
(r), `g_o` the gradient w.r.t. the output of `lora_B` (d_out, already multiplied by the LoRA scaling alpha/r) and
`g_h = B^T g_o` the gradient w.r.t. `h`. Row b's LoRA gradient is `dA_b = sum_s g_h,bs x_bs^T`,
`dB_b = sum_s g_o,bs h_bs^T`, so its inner product with a direction V is
`sum_s [g_h,bs . (V_A x_bs) + g_o,bs . (V_B h_bs)]`, computable without materialising dA_b, dB_b.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .layers import LoraModuleRef, active_lora_adapter, find_lora_layers
from .lora_gradient import LoraGradient, LoraGradients, all_reduce_

__all__ = ["LoraGhostHooks", "all_reduce_", "checkpointing_paused", "reentrant_checkpointing"]

_NO_GRAD_MESSAGE = (
    "LoraGhostHooks recorded a forward of LoRA layer '{name}' with autograd disabled, so its gradient cannot be "
    "captured. This happens with reentrant gradient checkpointing (use_reentrant=True, which TRL forces for PEFT + "
    "ZeRO-3): disable gradient checkpointing for the influence pass, or enable it with "
    "gradient_checkpointing_kwargs={{'use_reentrant': False}}. It also happens when recording is left on during a "
    "torch.no_grad() pass (reference / old log-prob passes): set `hooks.recording = False` for those."
)


def reentrant_checkpointing(args) -> bool:
    """Whether a trainer config turns on reentrant gradient checkpointing, whose first forward runs without autograd
    (the hooks cannot record through it: the influence passes then run with checkpointing disabled).

    As `transformers.Trainer` enables it: without keyword arguments for `torch.utils.checkpoint` (`every_n_layers`
    and `offload` are transformers' own) transformers picks non-reentrant; with some, `use_reentrant` decides, and
    torch's default when it is absent or None is reentrant. TRL forces reentrant for PEFT + DeepSpeed ZeRO-3.
    """
    if not getattr(args, "gradient_checkpointing", False):
        return False
    kwargs = getattr(args, "gradient_checkpointing_kwargs", None) or {}
    kwargs = {k: v for k, v in kwargs.items() if k not in ("every_n_layers", "offload")}
    return bool(kwargs) and kwargs.get("use_reentrant") is not False


@contextmanager
def checkpointing_paused(model: nn.Module) -> Iterator[None]:
    """Gradient checkpointing off in `model` for the block, then each module's flag as it was.

    Not TRL's `disable_gradient_checkpointing`, which re-enables through `gradient_checkpointing_enable`: that loses
    what `transformers.Trainer` enabled besides torch's arguments (`every_n_layers` back to 1, `offload` passed on
    to torch, which rejects it) and registers one more input-embedding hook at every call.
    """
    modules = model.modules() if isinstance(model, nn.Module) else ()  # (a test double without modules: none)
    flags = [(m, m.gradient_checkpointing) for m in modules if getattr(m, "gradient_checkpointing", False)]
    for module, _ in flags:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module, flag in flags:
            module.gradient_checkpointing = flag


def _inside_backward() -> bool:
    # Non-reentrant checkpointing re-runs the forward while the autograd engine executes a backward; torch's own
    # checkpoint code uses the same test.
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _inside_checkpoint_forward() -> bool:
    """Whether the current forward runs inside a non-reentrant `torch.utils.checkpoint` region (its first pass).

    There, autograd keeps no activation of the region: the backward recomputes them. Detected by the saved-tensor
    hooks that non-reentrant checkpointing installs (the same private accessor torch's own tests use).
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    hooks = top(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook.")


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 for half inputs, float64 stays float64.
    return torch.promote_types(dtype, torch.float32)


def _rows(t: Tensor) -> Tensor:
    """View (B, ..., d) as (B, T, d): rows are dim 0, every other leading dim is a position."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


@dataclass
class _Capture:
    h: Tensor  # output of lora_A, still attached to the graph: it is the `inputs=` of autograd.grad
    rows: int
    x: Tensor | None = None  # detached post-dropout input of lora_A, unless projected
    deferred: bool = False  # x is taken from the checkpoint recompute in the backward, not kept from the forward
    x_proj: Tensor | None = None  # x V_A^T, (B, ..., r); None with a zero direction for this layer
    projected_onto: LoraGradients | None = None  # the direction x was projected onto in the forward


class LoraGhostHooks:
    """Hooks on the active adapter's `lora_A` (forward) and `lora_B` (full backward) of every PEFT LoRA linear layer.

    Capture happens only while `recording` is True, and only for LoRA layers that actually run, so passes with
    disabled adapters (PEFT reference model) never capture. The hooks never read a weight tensor (ZeRO-3 / FSDP
    partition them). A recorded forward must be back-propagated with `accumulate_gradient` or `score_rows`: both call
    `torch.autograd.grad` w.r.t. the recorded `lora_A` outputs, which drives the `lora_B` backward hooks of every
    layer but accumulates nothing into `param.grad` (so no DDP / ZeRO gradient-reduction hook fires).

    Usage, per micro-batch (one forward call per LoRA layer and micro-batch; rows are dim 0 of the activations):

    ```python
    with LoraGhostHooks(model) as hooks:
        with hooks.record():
            val_loss = compute_val_loss(model)  # scalar
        V = hooks.accumulate_gradient(val_loss)  # or `into=V` for further validation micro-batches
        all_reduce_(V)  # same direction on every rank

        # Scores only (then train on the selected rows with an ordinary masked forward/backward):
        with hooks.record(direction=V):  # stores x V_A^T (rank r) instead of x
            losses = per_row_losses(model)  # (B,), sum = training loss of the micro-batch
        scores = hooks.score_rows(losses.sum(), V)  # (B,) = <grad loss_b, V>

        # Or scores and the selected rows' gradients from the same single backward:
        with hooks.record():
            losses = per_row_losses(model)
        scores = hooks.score_rows(losses.sum(), V, keep=True)
        mask = select_rows(gathered(scores), ...)[local rows]
        grads = hooks.selected_gradients(mask)  # sum_{b in mask} grad loss_b, per layer
        hooks.release()
        accelerator.backward(hooks.gradient_surrogate(grads))  # param.grad += grads, no second model backward
    ```

    Register the hooks only around influence passes: while registered, every `lora_B` call is wrapped by the full
    backward hook machinery, even when not recording. Under DDP, run the recorded forwards on the unwrapped module
    (or under `no_sync()`), since the reducer expects a parameter backward after a synced forward.

    Gradient checkpointing: non-reentrant checkpointing re-runs the forward inside the backward. Inside a
    checkpointed region, `record()` keeps only `h` (B, S, r) from the first forward and takes `x` from the recompute,
    right before the layer's backward (the same `x`: checkpointing restores the RNG state for dropout), so at most one
    region's inputs are held at a time, as in an ordinary checkpointed backward; `record(direction=V)` holds
    `x V_A^T` (B, S, r). Reentrant checkpointing runs the first forward without autograd, which raises a RuntimeError
    while recording.

    Per-row gradients are exact when rows do not interact in the loss (causal LMs without cross-row terms such as an
    MoE load-balancing loss); loss normalisers (token counts, batch size) must be constants, as in TRL.

    Args:
        model: A module containing PEFT `LoraLayer`s (typically the unwrapped `PeftModel`).
        adapter_name: The adapter whose LoRA parameters are scored; defaults to the single active adapter.
    """

    def __init__(self, model: nn.Module, adapter_name: str | None = None):
        self.adapter_name = active_lora_adapter(model) if adapter_name is None else adapter_name
        self.layers: list[LoraModuleRef] = find_lora_layers(model, self.adapter_name)
        if not self.layers:
            raise ValueError(f"Adapter '{self.adapter_name}' has no LoRA linear layer to hook.")
        self.recording = False
        self._pending: dict[str, _Capture] = {}  # recorded in the forward, not yet back-propagated
        self._kept: dict[str, LoraGradient] = {}  # per-row (B, ...) gradients from score_rows(keep=True)
        self._record_direction: LoraGradients | None = None
        self._mode: Literal["accumulate", "score"] | None = None
        self._direction: LoraGradients | None = None
        self._accumulated: LoraGradients | None = None
        self._scores: Tensor | None = None
        self._keep = False
        self._in_backward = False
        self._handles = []
        for ref in self.layers:
            self._handles.append(ref.lora_A.register_forward_hook(self._forward_hook(ref)))
            self._handles.append(ref.lora_A.register_forward_pre_hook(self._recompute_hook(ref)))
            self._handles.append(ref.lora_B.register_full_backward_hook(self._backward_hook(ref)))
            self._handles.append(ref.layer.register_forward_hook(self._layer_hook(ref)))

    # ----------------------------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> LoraGhostHooks:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Unregister all hooks and drop every capture."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.reset()

    def reset(self) -> None:
        """Drop pending and kept captures (e.g. after an exception between a recorded forward and its backward)."""
        self._pending.clear()
        self._kept.clear()
        self._mode, self._direction, self._accumulated, self._scores, self._keep = None, None, None, None, False

    @contextmanager
    def record(self, direction: LoraGradients | None = None) -> Iterator[LoraGhostHooks]:
        """Context manager setting `recording = True` for the forward passes inside it.

        Args:
            direction: For a forward that will be scored with `score_rows(loss, direction)` (keep=False): each layer
                then stores `x V_A^T`, shape (B, ..., r), instead of `x`, shape (B, ..., d_in). Use it with
                gradient checkpointing, where `x` would otherwise be held for every layer from the forward to the
                backward. Leave None for `accumulate_gradient` and `score_rows(..., keep=True)`, which need `x`.
        """
        previous = self.recording, self._record_direction
        self.recording, self._record_direction = True, direction
        try:
            yield self
        finally:
            self.recording, self._record_direction = previous

    @property
    def num_pending(self) -> int:
        """Number of LoRA layers recorded in the forward and not yet consumed by a backward."""
        return len(self._pending)

    @property
    def num_kept(self) -> int:
        """Number of LoRA layers whose per-row gradients are kept for `selected_gradients` (0 after `release`)."""
        return len(self._kept)

    # ----------------------------------------------------------------------------------------------- hooks

    def _forward_hook(self, ref: LoraModuleRef):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if not self.recording or self._in_backward or _inside_backward():
                return  # off, or a checkpoint recompute of an already captured forward
            if ref.layer.disable_adapters or self.adapter_name not in ref.layer.active_adapters:
                return
            if not torch.is_grad_enabled():
                raise RuntimeError(_NO_GRAD_MESSAGE.format(name=ref.name))
            if not output.requires_grad:
                raise RuntimeError(
                    f"The lora_A output of '{ref.name}' does not require grad (frozen LoRA weights?); "
                    "its influence cannot be computed."
                )
            if ref.name in self._pending or ref.name in self._kept:
                raise RuntimeError(
                    f"LoRA layer '{ref.name}' was called twice while recording. Back-propagate each recorded "
                    "micro-batch (accumulate_gradient / score_rows) and release() kept tensors before the next "
                    "forward; one forward call per LoRA layer and micro-batch is supported (no chunked forwards)."
                )
            x = args[0].detach()
            capture = _Capture(h=output, rows=x.shape[0])
            direction = self._record_direction
            if direction is None and _inside_checkpoint_forward():
                # Gradient checkpointing drops this layer's activations until its backward recomputes them: keeping
                # x here would hold every layer's input at once. `_recompute_hook` takes it from the recompute.
                capture.deferred = True
            elif direction is None:
                capture.x = x
            else:
                capture.projected_onto = direction
                if ref.name in direction:
                    with torch.no_grad():
                        dtype = _accumulation_dtype(x.dtype)
                        capture.x_proj = x.to(dtype) @ direction[ref.name].A.to(dtype=dtype, device=x.device).T
            self._pending[ref.name] = capture

        return hook

    def _layer_hook(self, ref: LoraModuleRef):
        # Every gradient is read from lora_A's input and lora_B's output: a LoRA layer whose forward ran without
        # calling lora_A (a PEFT layer type `find_lora_layers` does not know) would be silently left out.
        def hook(module: nn.Module, args: tuple, output) -> None:
            if not self.recording or self._in_backward or _inside_backward() or not torch.is_grad_enabled():
                return
            if ref.layer.disable_adapters or self.adapter_name not in ref.layer.active_adapters:
                return
            if ref.name not in self._pending and ref.name not in self._kept:
                raise RuntimeError(
                    f"LoRA layer '{ref.name}' ({type(ref.layer).__name__}) ran without calling its lora_A module: its "
                    "gradient cannot be read from the hooks, so TracIn cannot score or train it. TracIn supports "
                    "LoRA layers computing `lora_B(lora_A(dropout(x)))` (PEFT's Linear)."
                )

        return hook

    def _recompute_hook(self, ref: LoraModuleRef):
        # A forward pre-hook: it runs before lora_A saves its input, so the recompute's early stop (after the last
        # saved tensor of the region) cannot skip it. Checkpointing restores the RNG, so dropout masks are the same.
        def hook(module: nn.Module, args: tuple) -> None:
            capture = self._pending.get(ref.name)
            if capture is not None and capture.deferred and capture.x is None and _inside_backward():
                capture.x = args[0].detach()

        return hook

    def _backward_hook(self, ref: LoraModuleRef):
        def hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            capture = self._pending.pop(ref.name, None)
            if capture is None:
                return  # this forward was not recorded
            if self._mode is None:
                raise RuntimeError(
                    f"A recorded forward of '{ref.name}' was back-propagated outside LoraGhostHooks. Use "
                    "hooks.accumulate_gradient(loss) or hooks.score_rows(loss, V), or record with recording=False."
                )
            g_h, g_o = grad_input[0], grad_output[0]
            if g_h is None or g_o is None:
                raise RuntimeError(
                    f"The backward hook of '{ref.name}' received no gradient (grad_input={g_h is not None}, "
                    f"grad_output={g_o is not None}). Reentrant gradient checkpointing is not supported: disable "
                    "gradient checkpointing for the influence pass or use use_reentrant=False."
                )
            with torch.no_grad():
                if self._mode == "accumulate":
                    self._accumulate(ref.name, capture, g_h, g_o)
                elif self._keep:
                    self._score_and_keep(ref.name, capture, g_h, g_o)
                else:
                    self._score(ref.name, capture, g_h, g_o)
            # The capture goes out of scope here, freeing its tensors before the backward reaches earlier layers.

        return hook

    def _need_inputs(self, name: str, capture: _Capture, purpose: str) -> Tensor:
        if capture.x is None and capture.deferred:
            raise RuntimeError(
                f"'{name}' ran inside a gradient-checkpointed region, but its backward came without a recompute of "
                "its forward, so its lora_A inputs are unknown."
            )
        if capture.x is None:
            raise RuntimeError(
                f"{purpose} needs the lora_A inputs, but '{name}' was recorded with `record(direction=...)`, "
                "which keeps only their projection; record with `record()` instead."
            )
        return capture.x

    def _row_scores(self, name: str, rows: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        if self._scores is None:
            self._scores = torch.zeros(rows, dtype=dtype, device=device)
        elif self._scores.shape[0] != rows:
            raise RuntimeError(
                f"LoRA layer '{name}' saw {rows} rows but earlier layers saw {self._scores.shape[0]}; "
                "rows must be dim 0 of every LoRA activation."
            )
        return self._scores

    def _accumulate(self, name: str, capture: _Capture, g_h: Tensor, g_o: Tensor) -> None:
        x = self._need_inputs(name, capture, "accumulate_gradient")
        target = self._accumulated[name]
        dtype = target.A.dtype
        x, h = x.reshape(-1, x.shape[-1]).to(dtype), capture.h.detach().reshape(-1, g_h.shape[-1]).to(dtype)
        g_h, g_o = g_h.reshape(-1, g_h.shape[-1]).to(dtype), g_o.reshape(-1, g_o.shape[-1]).to(dtype)
        target.A.add_(g_h.T @ x)  # (r, d_in) = sum over rows and positions of g_h x^T
        target.B.add_(g_o.T @ h)  # (d_out, r)

    def _score(self, name: str, capture: _Capture, g_h: Tensor, g_o: Tensor) -> None:
        dtype = _accumulation_dtype(capture.h.dtype)
        scores = self._row_scores(name, capture.rows, dtype, g_h.device)
        if capture.projected_onto is not None and capture.projected_onto is not self._direction:
            raise ValueError(f"'{name}' was recorded with a different direction than the one passed to score_rows.")
        direction = self._direction.get(name)
        if direction is None:
            return  # this layer has a zero direction
        V_B = direction.B.to(dtype=dtype, device=g_o.device)
        if capture.x_proj is None:
            x_proj = _rows(capture.x).to(dtype) @ direction.A.to(dtype=dtype, device=g_h.device).T
        else:
            x_proj = _rows(capture.x_proj)
        h, g_h, g_o = _rows(capture.h.detach()).to(dtype), _rows(g_h).to(dtype), _rows(g_o).to(dtype)
        # g_h . (V_A x) + (V_B^T g_o) . h: every intermediate is (B, T, r), never (B, T, d_out).
        scores += (g_h * x_proj).sum(dim=(1, 2)) + ((g_o @ V_B) * h).sum(dim=(1, 2))

    def _score_and_keep(self, name: str, capture: _Capture, g_h: Tensor, g_o: Tensor) -> None:
        x = self._need_inputs(name, capture, "score_rows(keep=True)")
        dtype = _accumulation_dtype(x.dtype)
        scores = self._row_scores(name, capture.rows, dtype, x.device)
        x, h = _rows(x).to(dtype), _rows(capture.h.detach()).to(dtype)
        g_h, g_o = _rows(g_h).to(dtype), _rows(g_o).to(dtype)
        # Per-row gradients, B x r x (d_in + d_out): smaller than the activations whenever positions outnumber r.
        per_row = LoraGradient(A=torch.einsum("btr,btd->brd", g_h, x), B=torch.einsum("bto,btr->bor", g_o, h))
        self._kept[name] = per_row
        direction = self._direction.get(name)
        if direction is not None:
            V_A, V_B = direction.A.to(dtype=dtype, device=x.device), direction.B.to(dtype=dtype, device=x.device)
            scores += (per_row.A * V_A).sum(dim=(1, 2)) + (per_row.B * V_B).sum(dim=(1, 2))

    # ----------------------------------------------------------------------------------------------- backward passes

    def _backward(self, loss: Tensor, retain_graph: bool) -> None:
        if self._kept:
            raise RuntimeError("Per-row gradients kept by score_rows(keep=True) are still held: call release() first.")
        if not self._pending:
            raise RuntimeError("Nothing was recorded: run the forward inside `with hooks.record():`.")
        if loss.dim() != 0:
            raise ValueError(f"Expected a scalar loss, got shape {tuple(loss.shape)}.")
        if not loss.requires_grad:
            raise ValueError("The loss does not require grad; was the forward run under torch.no_grad()?")
        inputs = [capture.h for capture in self._pending.values()]
        self._in_backward = True
        try:
            # Gradients w.r.t. the lora_A outputs traverse every lora_B backward hook, and touch no param.grad.
            torch.autograd.grad(loss, inputs, retain_graph=retain_graph, allow_unused=True)
        finally:
            self._in_backward = False
            # Layers the loss does not reach have a zero gradient: nothing to add, just drop their tensors.
            self._pending.clear()

    def accumulate_gradient(
        self, loss: Tensor, into: LoraGradients | None = None, *, retain_graph: bool = False
    ) -> LoraGradients:
        """Back-propagate a recorded forward's scalar loss and add its LoRA gradient into `into` (mode a).

        `into[name].A += sum_{b,s} g_h x^T` and `into[name].B += sum_{b,s} g_o h^T`, i.e. the gradient of `loss`
        w.r.t. `lora_A.weight` / `lora_B.weight`, computed from the hooks; `param.grad` is not touched. Call it once
        per validation micro-batch with the same `into` to sum over micro-batches, then `all_reduce_(into)`.

        Args:
            loss: Scalar loss of the forward recorded (with `record()`) since the last backward.
            into: Gradients to add to; a new dict with an entry for every hooked layer when None (float32, or float64
                for float64 activations).
            retain_graph: Forwarded to `torch.autograd.grad`.

        Returns:
            `into` (or the new dict).
        """
        if into is None:
            first = next(iter(self._pending.values()), None)
            if first is None:
                raise RuntimeError("Nothing was recorded: run the forward inside `with hooks.record():`.")
            dtype, device = _accumulation_dtype(first.h.dtype), first.h.device
            into = {
                ref.name: LoraGradient(
                    A=torch.zeros(ref.lora_A.out_features, ref.lora_A.in_features, dtype=dtype, device=device),
                    B=torch.zeros(ref.lora_B.out_features, ref.lora_B.in_features, dtype=dtype, device=device),
                )
                for ref in self.layers
            }
        missing = [name for name in self._pending if name not in into]
        if missing:
            raise KeyError(f"`into` has no entry for LoRA layer(s) {missing}.")
        self._mode, self._accumulated = "accumulate", into
        try:
            self._backward(loss, retain_graph)
        finally:
            self._mode, self._accumulated = None, None
        return into

    def score_rows(
        self, loss: Tensor, direction: LoraGradients, *, keep: bool = False, retain_graph: bool = False
    ) -> Tensor:
        """Back-propagate a recorded forward's loss and return per-row inner products with `direction` (mode b).

        `scores[b] = sum_layers sum_s [g_h,bs . (V_A x_bs) + g_o,bs . (V_B h_bs)] = <grad_theta loss_b, V>`, where
        `loss = sum_b loss_b` and theta are the hooked LoRA weights. The scores are accumulated inside the `lora_B`
        backward hooks and each layer's captured tensors are freed as soon as its hook has run, so the extra memory
        is that of one micro-batch's LoRA activations (rank-r ones only, with `record(direction=V)`). Padded
        positions get a zero gradient and contribute nothing; layers missing from `direction` count as zero.

        Args:
            loss: Scalar loss (the sum of per-row losses) of the forward recorded since the last backward.
            direction: Per-layer direction V, e.g. from `accumulate_gradient` (after `all_reduce_`); must be the same
                object as in `record(direction=...)` if one was given there.
            keep: Also keep each row's LoRA gradient (B x r x (d_in + d_out) per layer, in the accumulation dtype)
                until `release()`, for `selected_gradients`. Needs a forward recorded without a direction.
            retain_graph: Forwarded to `torch.autograd.grad`.

        Returns:
            Scores of shape (B,), B = dim 0 of the activations, float32 (float64 for float64 activations).
        """
        first = next(iter(self._pending.values()), None)
        self._mode, self._direction, self._keep, self._scores = "score", direction, keep, None
        try:
            self._backward(loss, retain_graph)
            scores = self._scores
        except BaseException:
            self._kept.clear()  # half a backward's worth of per-row gradients is useless
            raise
        finally:
            self._mode, self._direction, self._keep, self._scores = None, None, False, None
        if scores is None:  # no layer is reached by the loss: every score is 0
            scores = torch.zeros(first.rows, dtype=_accumulation_dtype(first.h.dtype), device=first.h.device)
        return scores

    # ----------------------------------------------------------------------------------------------- selected rows

    def selected_gradients(self, rows: Tensor) -> LoraGradients:
        """LoRA gradients of a subset (or weighting) of the rows of the last `score_rows(..., keep=True)` (mode c).

        Returns `sum_b w_b grad loss_b` per layer from the kept per-row gradients, without another backward. Because
        selection needs the complete scores, this runs after the backward. Layers the loss did not reach are omitted
        (zero gradient).

        Args:
            rows: (B,) bool mask of selected rows, or float per-row weights (e.g. to renormalise the loss).

        Returns:
            Per-layer gradients shaped like `lora_A.weight` / `lora_B.weight`, in the accumulation dtype.
        """
        if not self._kept:
            raise RuntimeError("No kept per-row gradients: call score_rows(loss, V, keep=True) first.")
        gradients = {}
        for name, per_row in self._kept.items():
            if rows.shape != (per_row.A.shape[0],):
                raise ValueError(f"`rows` must have shape ({per_row.A.shape[0]},), got {tuple(rows.shape)}.")
            weights = rows.to(dtype=per_row.A.dtype, device=per_row.A.device)
            gradients[name] = LoraGradient(
                A=torch.einsum("b,brd->rd", weights, per_row.A), B=torch.einsum("b,bor->or", weights, per_row.B)
            )
        return gradients

    def release(self) -> None:
        """Free the per-row gradients kept by `score_rows(..., keep=True)`."""
        self._kept.clear()

    def gradient_surrogate(self, gradients: LoraGradients) -> Tensor:
        """A scalar whose backward adds `gradients` to the LoRA weights' `.grad`.

        `sum_layers trace(lora_A(G_A)) + sum(lora_B(I_r) * G_B^T)` equals `<A, G_A> + <B, G_B>` with G detached, so
        its gradient w.r.t. A is G_A and w.r.t. B is G_B. It calls the LoRA modules instead of reading their
        weights, so engine hooks (ZeRO-3 parameter gathering) run as in a normal forward; back-propagate it with the
        engine (`accelerator.backward`) to apply the selected rows' gradients without a second model backward.

        Args:
            gradients: Per-layer gradients, e.g. from `selected_gradients`.

        Returns:
            A 0-dim tensor (its value is meaningless; only its gradient matters).
        """
        terms = []
        previous, self.recording = self.recording, False
        try:
            for ref in self.layers:
                if ref.name not in gradients:
                    continue
                grad = gradients[ref.name]
                dtype = ref.lora_A.weight.dtype  # dtype only; the (possibly partitioned) data is not read
                product_A = ref.lora_A(grad.A.detach().to(dtype))  # (r, r) = G_A A^T
                rank = ref.lora_B.in_features
                # requires_grad: a full backward hook (ours) on lora_B warns when no module input requires grad.
                eye = torch.eye(rank, dtype=dtype, device=grad.B.device, requires_grad=True)
                transposed_B = ref.lora_B(eye)  # (r, d_out) = B^T
                terms.append(product_A.diagonal().sum() + (transposed_B * grad.B.detach().to(dtype).T).sum())
        finally:
            self.recording = previous
        if not terms:
            raise ValueError("`gradients` has no entry for any hooked LoRA layer.")
        return torch.stack(terms).sum()
