"""Shared set-up of the live tests (the embedded model through `trl-agentic train`)."""

import torch


def precision_overrides() -> list[str]:
    """`--bf16 true` where the CPU computes bfloat16 natively (AVX512-BF16), else nothing (the configs' float32).

    bf16 autocast is what a GPU user runs; on this machine it halves the warm-start and GRPO step times of SmolLM2-135M
    (fp32 19.5 s vs bf16 9.5 s for a forward+backward of 2 x 1400 tokens). Without native support it would be slower
    than float32, so those machines keep float32.
    """
    return ["--bf16", "true"] if torch.cpu._is_avx512_bf16_supported() else []
