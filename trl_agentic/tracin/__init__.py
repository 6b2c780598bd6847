"""TracIn-filtered GRPO: per-row LoRA gradient inner products with a validation direction, and row selection."""

from .hooks import LoraGhostHooks
from .influence import lora_influence_scores
from .layers import LoraModuleRef, find_lora_layers, lora_parameters, validate_tracin_model
from .lora_gradient import LoraGradient, LoraGradients, all_reduce_, lora_gradient_dot
from .selection import SELECTION_MODES, select_rows

__all__ = [
    "SELECTION_MODES",
    "LoraGhostHooks",
    "LoraGradient",
    "LoraGradients",
    "LoraModuleRef",
    "all_reduce_",
    "find_lora_layers",
    "lora_gradient_dot",
    "lora_influence_scores",
    "lora_parameters",
    "select_rows",
    "validate_tracin_model",
]
