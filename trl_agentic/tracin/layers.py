"""Discovery and validation of the PEFT LoRA layers whose parameters the TracIn influence scores cover."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LoraModuleRef:
    """One LoRA-adapted linear layer of the active adapter.

    Args:
        name: Qualified module name of the `LoraLayer` inside the model (e.g. `base_model.model.model.layers.0.self_attn.q_proj`).
        layer: The PEFT `LoraLayer` wrapping the base linear layer.
        lora_A: `layer.lora_A[adapter]`, an `nn.Linear(d_in -> r)` whose weight is A (r x d_in).
        lora_B: `layer.lora_B[adapter]`, an `nn.Linear(r -> d_out)` whose weight is B (d_out x r).
    """

    name: str
    layer: nn.Module
    lora_A: nn.Linear
    lora_B: nn.Linear


def _lora_layer_class() -> type:
    # Imported lazily so that `trl_agentic` stays importable without peft.
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def active_lora_adapter(model: nn.Module) -> str:
    """Name of the single active LoRA adapter of `model`.

    Args:
        model: A module containing PEFT `LoraLayer`s (a `PeftModel`, or a transformers model with a loaded adapter).

    Returns:
        The adapter name shared by all LoRA layers.

    Raises:
        ValueError: If there is no LoRA layer, or more than one adapter is active.
    """
    lora_layer_cls = _lora_layer_class()
    active: set[str] = set()
    for module in model.modules():
        if isinstance(module, lora_layer_cls):
            active.update(module.active_adapters)
    if not active:
        raise ValueError(f"{type(model).__name__} has no PEFT LoRA layer, so there are no LoRA parameters to score.")
    if len(active) > 1:
        raise ValueError(
            f"TracIn scores the parameters of one adapter, but {sorted(active)} are active. "
            "Call `model.set_adapter(name)` first."
        )
    return active.pop()


# PEFT LoRA layers whose forward merges B @ A into a weight instead of calling `lora_B(lora_A(x))` (peft 0.21).
_WEIGHT_LEVEL_LAYERS = ("ParamWrapper", "MultiheadAttention")


def find_lora_layers(model: nn.Module, adapter_name: str | None = None) -> list[LoraModuleRef]:
    """List the LoRA linear layers of one adapter, in module order, and reject layouts the hooks cannot score.

    The influence hooks rebuild gradients from the inputs and outputs of `lora_A` / `lora_B`, which is exact only for
    vanilla LoRA linears `y = W0 x + s * B(A(dropout(x)))`. DoRA and other variants add terms that depend on the
    weights directly, embedding LoRA has no `lora_A` module, and a LoRA bias would need its own score term.

    Args:
        model: A module containing PEFT `LoraLayer`s.
        adapter_name: The adapter to use; defaults to the single active adapter.

    Returns:
        One `LoraModuleRef` per LoRA layer that carries `adapter_name` (possibly empty).

    Raises:
        ValueError: On an embedding / convolution LoRA layer, a layer that never calls its lora_A module
            (`target_parameters`, multi-head attention), a LoRA variant (DoRA, ...), `lora_bias=True`, or a merged
            adapter.
    """
    lora_layer_cls = _lora_layer_class()
    adapter = active_lora_adapter(model) if adapter_name is None else adapter_name
    refs = []
    for name, module in model.named_modules():
        if not isinstance(module, lora_layer_cls):
            continue
        if adapter in getattr(module, "lora_embedding_A", {}):
            raise ValueError(f"LoRA layer '{name}' is an embedding LoRA, which TracIn influence does not support.")
        if adapter not in module.lora_A:
            continue
        if type(module).__name__ in _WEIGHT_LEVEL_LAYERS:
            raise ValueError(
                f"LoRA layer '{name}' is a PEFT {type(module).__name__} (e.g. `LoraConfig(target_parameters=...)` on "
                "MoE experts), whose forward builds its weight from lora_A/lora_B without calling them: the hooks "
                "never see it, so its rows' influence would be left out and the fused step would not train it. "
                "TracIn supports LoRA on linear modules (`target_modules`)."
            )
        lora_A, lora_B = module.lora_A[adapter], module.lora_B[adapter]
        if type(lora_A) is not nn.Linear or type(lora_B) is not nn.Linear:
            raise ValueError(
                f"LoRA layer '{name}' uses {type(lora_A).__name__} adapters; TracIn influence supports linear LoRA only."
            )
        if adapter in getattr(module, "lora_variant", {}):
            variant = type(module.lora_variant[adapter]).__name__
            raise ValueError(
                f"LoRA layer '{name}' uses the LoRA variant {variant} (e.g. DoRA), whose gradient is not determined by "
                "the lora_A/lora_B activations; TracIn influence supports vanilla LoRA only."
            )
        if lora_B.bias is not None:
            raise ValueError(f"LoRA layer '{name}' has a LoRA bias (`lora_bias=True`), which TracIn does not score.")
        if module.merged:
            raise ValueError(f"LoRA layer '{name}' is merged into its base weight; unmerge the adapter first.")
        refs.append(LoraModuleRef(name=name, layer=module, lora_A=lora_A, lora_B=lora_B))
    return refs


def lora_parameters(model: nn.Module, adapter_name: str | None = None) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """The LoRA weights covered by the influence scores.

    Args:
        model: A module containing PEFT `LoraLayer`s.
        adapter_name: The adapter to use; defaults to the single active adapter.

    Returns:
        `(layer_name, A, B)` per LoRA layer, with A = `lora_A[adapter].weight` (r x d_in) and
        B = `lora_B[adapter].weight` (d_out x r), in module order.
    """
    return [(ref.name, ref.lora_A.weight, ref.lora_B.weight) for ref in find_lora_layers(model, adapter_name)]


def validate_tracin_model(model: nn.Module) -> list[LoraModuleRef]:
    """Check that `model` is a PEFT LoRA model whose influence scores the hooks can compute exactly.

    Args:
        model: The (unwrapped) policy model.

    Returns:
        The LoRA layers of the active adapter.

    Raises:
        ValueError: If `model` is not a `peft.PeftModel`, carries LoRA on `lm_head` (TRL 1.16 computes log-probs from
            `lm_head.weight` directly and refuses it), has no LoRA layer for the active adapter, has a layout
            rejected by `find_lora_layers`, or has trainable parameters besides the LoRA A/B weights
            (`modules_to_save`, `bias="all"/"lora_only"`, `trainable_token_indices`, hand-unfrozen weights).
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise ValueError(
            f"TracIn influence needs a peft.PeftModel with LoRA adapters, got {type(model).__name__}. "
            "Pass a `peft_config` (LoraConfig) to the trainer or wrap the model with `peft.get_peft_model`."
        )
    lora_layer_cls = _lora_layer_class()
    output_embeddings = model.get_output_embeddings()
    lm_head_lora = [
        name
        for name, module in model.named_modules()
        if isinstance(module, lora_layer_cls) and (module is output_embeddings or name.split(".")[-1] == "lm_head")
    ]
    if lm_head_lora:
        raise ValueError(
            f"LoRA on the LM head ({lm_head_lora[0]}) is not supported: TRL 1.16 computes log-probabilities from "
            "`lm_head.weight` directly, so the adapter would never be trained. Remove 'lm_head' from `target_modules`."
        )
    adapter = active_lora_adapter(model)
    refs = find_lora_layers(model, adapter)
    if not refs:
        raise ValueError(f"The active adapter '{adapter}' has no LoRA linear layer, so there is nothing to score.")
    extra = non_lora_trainable_parameters(model, refs)
    if extra:
        raise ValueError(
            f"TracIn scores and trains the LoRA A/B weights only, but {len(extra)} other parameter(s) are trainable "
            f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}): {_trainable_setting(model, adapter)}. "
            "Their gradients would be left out of the scores and the update. Remove that setting (TracIn needs "
            "`modules_to_save=None`, `bias='none'`, `trainable_token_indices=None`) or disable `tracin_enabled`."
        )
    return refs


def non_lora_trainable_parameters(model: nn.Module, refs: list[LoraModuleRef]) -> list[str]:
    """Names of the trainable parameters that are not the A/B weights of `refs`.

    PEFT makes such parameters trainable for `modules_to_save` (full copies of modules), `bias="all"` /
    `"lora_only"` (biases of the base layers) and `trainable_token_indices` (embedding rows); users can unfreeze
    others by hand. The influence hooks see none of them.
    """
    covered = {id(ref.lora_A.weight) for ref in refs} | {id(ref.lora_B.weight) for ref in refs}
    return [name for name, param in model.named_parameters() if param.requires_grad and id(param) not in covered]


def _trainable_setting(model: nn.Module, adapter: str) -> str:
    """The PEFT setting that made non-LoRA parameters trainable, for the error message."""
    config = getattr(model, "peft_config", {}).get(adapter)
    settings = []
    if getattr(config, "modules_to_save", None):
        settings.append(f"`modules_to_save={list(config.modules_to_save)}`")
    if getattr(config, "bias", "none") != "none":
        settings.append(f"`bias={config.bias!r}`")
    if getattr(config, "trainable_token_indices", None):
        settings.append(f"`trainable_token_indices={config.trainable_token_indices!r}`")
    return " and ".join(settings) if settings else "parameters unfrozen outside the LoRA config"
