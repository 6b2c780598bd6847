"""Shared set-up of the live tests (the embedded model through `trl-agentic train`)."""

import torch


def precision_overrides() -> list[str]:
    """`--bf16 true` where the CPU computes bfloat16 natively (AVX512-BF16), else nothing (the configs' float32).

    bf16 autocast is what a GPU user runs. Here it speeds up the warm starts, which are compute-bound: a SmolLM2-135M
    LoRA forward+backward of 2 x 1400 tokens takes 9.6 s instead of 19.5 s, and the RLVCR warm-start step ~19 s instead
    of ~25 s (~12 s with tcmalloc). The GRPO steps, mostly token-by-token generation of a few rows, did not get faster
    (RLVCR: 210 s either way). Without native support bf16 would be slower than float32, so those machines keep float32.
    """
    return ["--bf16", "true"] if torch.cpu._is_avx512_bf16_supported() else []
