"""Helpers of the asynchronous TracIn filter's tests (`tests/test_async_tracin*.py`)."""

from __future__ import annotations

import torch


def lora_model(tiny_model_dir):
    """The tiny random Qwen3 in float64 with a LoRA adapter (r=4 on q/v) initialised away from zero, so that every
    LoRA weight has a gradient."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager", dtype=torch.float64)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    return get_peft_model(base, config).double()
