"""Tiny float64 LoRA causal LMs, GRPO-like batches and losses, and brute-force per-sample gradients for TracIn tests."""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

VOCAB = 64


@dataclass
class GrpoBatch:
    """Prompt + completion rows: left-padded prompts, right-padded completions."""

    input_ids: torch.Tensor  # (B, P + C)
    attention_mask: torch.Tensor  # (B, P + C)
    completion_mask: torch.Tensor  # (B, C), float
    advantages: torch.Tensor  # (B,)
    prompt_len: int

    def rows(self, index) -> GrpoBatch:
        return replace(
            self,
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            completion_mask=self.completion_mask[index],
            advantages=self.advantages[index],
        )


def make_lora_model(
    arch: str = "qwen3", lora_dropout: float = 0.1, target_modules="all-linear", seed: int = 0, **lora_kwargs
):
    """A 2-layer, hidden-32, vocab-64 causal LM in float64 with LoRA (r=4, alpha=8) and non-zero random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model = model.to(torch.float64)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout, target_modules=target_modules, **lora_kwargs)
    model = get_peft_model(model, config)
    # PEFT zero-initialises B, which would make every lora_A gradient 0 and the test blind to the A terms.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    model.train()
    return model


def make_batch(
    seed: int,
    prompt_pads: list[int],
    completion_lens: list[int],
    advantages: list[float],
    prompt_len: int = 4,
    completion_len: int = 6,
) -> GrpoBatch:
    generator = torch.Generator().manual_seed(seed)
    n_rows = len(prompt_pads)
    input_ids = torch.randint(1, VOCAB, (n_rows, prompt_len + completion_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    completion_mask = torch.zeros(n_rows, completion_len, dtype=torch.float64)
    for row, (pad, length) in enumerate(zip(prompt_pads, completion_lens)):
        attention_mask[row, :pad] = 0
        input_ids[row, :pad] = 0
        completion_mask[row, :length] = 1.0
    attention_mask[:, prompt_len:] = completion_mask.long()
    input_ids[:, prompt_len:] = torch.where(completion_mask.bool(), input_ids[:, prompt_len:], 0)
    return GrpoBatch(
        input_ids, attention_mask, completion_mask, torch.tensor(advantages, dtype=torch.float64), prompt_len
    )


def train_batch() -> GrpoBatch:
    """8 rows with left padding, short completions, and one all-padding row (row 5)."""
    return make_batch(
        seed=3,
        prompt_pads=[0, 2, 1, 0, 3, 0, 1, 0],
        completion_lens=[6, 4, 6, 2, 5, 0, 3, 6],
        advantages=[1.2, -0.7, 0.4, -1.5, 0.9, 0.0, -0.3, 0.8],
    )


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    grouped = rewards.view(-1, group_size)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)


def val_batch() -> GrpoBatch:
    """2 prompts x 3 generations with group-normalised (non-zero) advantages."""
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.0, 1.0, 1.0], dtype=torch.float64)
    advantages = group_advantages(rewards, group_size=3)
    assert (advantages.abs() > 0.1).all()
    return make_batch(
        seed=5,
        prompt_pads=[0, 0, 0, 1, 1, 1],
        completion_lens=[6, 3, 5, 4, 6, 2],
        advantages=advantages.tolist(),
    )


def completion_logps(model, batch: GrpoBatch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logits = logits[:, batch.prompt_len - 1 : -1]
    completion_ids = batch.input_ids[:, batch.prompt_len :]
    return logits.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def per_sample_policy_losses(
    logps: torch.Tensor,
    batch: GrpoBatch,
    loss_type: str,
    n_rows: int | None = None,
    max_completion_length: int = 8,
    num_items: float | None = None,
) -> torch.Tensor:
    """Row shares ell_i of TRL 1.16's GRPO loss at ratio 1; sum_i ell_i is the loss of `loss_type`.

    `n_rows` / `num_items` default to this batch's own counts; pass global ones to cut a batch into micro-batches.
    """
    mask = batch.completion_mask
    n_rows = logps.shape[0] if n_rows is None else n_rows
    per_token = -torch.exp(logps - logps.detach()) * batch.advantages.unsqueeze(1)
    row_sum = (per_token * mask).sum(-1)
    if loss_type == "grpo":  # per-sequence token mean, mean over sequences
        return row_sum / mask.sum(-1).clamp(min=1.0) / n_rows
    if loss_type == "bnpo":  # local token count
        return row_sum / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":  # B * max_completion_length
        return row_sum / (n_rows * max_completion_length)
    if loss_type == "dapo":  # global token count (num_items_in_batch)
        return row_sum / (mask.sum() if num_items is None else num_items)
    raise ValueError(loss_type)


def seeded(seed: int, fn):
    """A closure that reseeds before its forward, so every call sees the same LoRA dropout masks."""

    def closure(model):
        torch.manual_seed(seed)
        return fn(model)

    return closure


def grpo_val_loss(model, batch: GrpoBatch | None = None) -> torch.Tensor:
    batch = val_batch() if batch is None else batch
    return per_sample_policy_losses(completion_logps(model, batch), batch, "grpo").sum()


def lora_param_list(model) -> list[torch.nn.Parameter]:
    from trl_agentic.tracin import lora_parameters

    return [param for _, A, B in lora_parameters(model) for param in (A, B)]


def flat_grad(loss: torch.Tensor, params, retain_graph: bool = True) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def brute_force_scores(model, per_sample_losses, val_loss) -> torch.Tensor:
    """One backward per sample: score_i = <autograd.grad(ell_i), autograd.grad(L_val)> over the LoRA weights."""
    params = lora_param_list(model)
    direction = flat_grad(val_loss(model), params, retain_graph=False)
    losses = per_sample_losses(model)
    return torch.stack([flat_grad(loss, params) @ direction for loss in losses])


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-8) -> None:
    scale = expected.abs().max().clamp(min=1e-30)
    error = (actual - expected).abs().max() / scale
    assert error <= rtol, f"relative error {error:.3e} > {rtol:.0e}\nactual={actual}\nexpected={expected}"


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny float64 models run faster on one thread, and the 2-core machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kit() -> SimpleNamespace:
    """The helpers above, as one fixture (conftest modules are not importable by name)."""
    return SimpleNamespace(
        make_lora_model=make_lora_model,
        make_batch=make_batch,
        train_batch=train_batch,
        val_batch=val_batch,
        completion_logps=completion_logps,
        per_sample_policy_losses=per_sample_policy_losses,
        seeded=seeded,
        grpo_val_loss=grpo_val_loss,
        lora_param_list=lora_param_list,
        flat_grad=flat_grad,
        brute_force_scores=brute_force_scores,
        assert_close_relative=assert_close_relative,
    )
