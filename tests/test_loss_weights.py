"""`RowWeightedLossMixin` rescales TRL's per-row policy term when padding rows are present, and keeps the terms TRL
does not average over rows as TRL computes them: the entropy bonus (behind TRL's adaptive-entropy gate, over the
`top_entropy_quantile` mask) and the MoE router's auxiliary loss.

Expected values come from TRL's own `GRPOTrainer._compute_loss` on the same (padded) micro-batch: `L_full` with the
bonus / auxiliary loss on, `L_policy` with them switched off. With padding the loss must be

    factor * L_policy + (L_full - L_policy),   factor = rows in the micro-batch / real rows   (1 process, 1 step)

in value and in gradient (so a term whose value is right but whose gradient was cut, e.g. detached, fails too).
"""

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.batch import BatchAugmenter


def reward(completions, **kwargs):
    return [float(sum(map(ord, c[0]["content"])) % 7) / 3.0 for c in completions]


def _trainer(model_dir, tmp_path, **settings):
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        seed=3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        loss_type="grpo",
        save_strategy="no",
        **settings,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Say hi."}]] * 4})
    trainer = AgenticGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the loss reads it
    batch = trainer._generate_and_score_completions(list(dataset))
    assert batch["advantages"].abs().sum() > 0 and int(batch["num_rows_in_batch"]) == 4
    padded = BatchAugmenter._pad_rows(batch, 5)  # one zero-weight padding row: factor 5 / 4
    assert padded["completion_mask"][-1].sum() == 0
    return trainer, padded


_ENTROPY_STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


def _loss_and_grad(trainer, compute, inputs, **overrides):
    """`compute(trainer, model, inputs)` with `overrides` set on the trainer; TRL's adaptive-entropy state (which a
    training-mode call updates) is put back afterwards, so every call sees the same state."""
    saved = {k: getattr(trainer, k) for k in (*_ENTROPY_STATE, *overrides)}
    for k, v in overrides.items():
        setattr(trainer, k, v)
    try:
        loss = compute(trainer, trainer.model, inputs)
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for k, v in saved.items():
            setattr(trainer, k, v)
    grad = torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)])
    return loss.detach(), grad


def _ours(trainer, model, inputs):
    return trainer._compute_loss(model, inputs)


def _trl(trainer, model, inputs):
    return GRPOTrainer._compute_loss(trainer, model, inputs)


def _assert_policy_only_rescaled(trainer, padded, off: dict, factor: float = 5 / 4) -> float:
    """Ours == factor * L_policy + (L_full - L_policy) in value and gradient. Returns |L_full - L_policy| (the size of
    the kept term, so callers can check it was there or not)."""
    ours, ours_grad = _loss_and_grad(trainer, _ours, padded)
    full, full_grad = _loss_and_grad(trainer, _trl, padded)
    policy, policy_grad = _loss_and_grad(trainer, _trl, padded, **off)
    expected = factor * policy + (full - policy)
    expected_grad = factor * policy_grad + (full_grad - policy_grad)
    # Same terms summed in another order (float32): a tolerance far below the effect of a wrong factor (25 %).
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-7)
    scale = expected_grad.abs().max().item()
    assert scale > 0 and policy_grad.abs().max() > 1e-3 * scale
    torch.testing.assert_close(ours_grad, expected_grad, rtol=1e-4, atol=1e-6 * scale)
    # The comparison can fail: rescaling everything, or nothing, differs.
    assert (factor * full_grad - expected_grad).abs().max() > 1e-3 * scale or (full - policy).abs() == 0
    assert (full_grad - expected_grad).abs().max() > 1e-3 * scale
    return (full - policy).abs().item()


@pytest.mark.parametrize("gate", ["open", "closed"])
@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_adaptive_entropy_gate_and_top_entropy_quantile(tiny_model_dir, tmp_path, gate, quantile):
    """TRL applies the adaptive bonus only when the previous window's entropy was at or below `entropy_target`
    (`_last_world_entropy`; +inf before the first step: closed); the bonus is a mean over the `top_entropy_quantile`
    mask, which also masks the policy term. Ours keeps the bonus exactly as TRL applies it."""
    trainer, padded = _trainer(
        tiny_model_dir,
        tmp_path,
        use_adaptive_entropy=True,
        entropy_coef=0.3,
        entropy_target=1.0,
        top_entropy_quantile=quantile,
    )
    trainer._last_world_entropy = 0.5 if gate == "open" else float("inf")
    kept = _assert_policy_only_rescaled(trainer, padded, off={"_entropy_bonus_enabled": False})
    assert (kept > 1e-4) == (gate == "open"), kept  # a closed gate applies no bonus
    if quantile < 1.0:
        # The quantile mask really restricted the tokens: the full-mask bonus is another value.
        masked_bonus, _ = _loss_and_grad(trainer, _trl, padded)
        all_tokens, _ = _loss_and_grad(trainer, _trl, padded, top_entropy_quantile=1.0)
        assert masked_bonus != all_tokens


def test_static_entropy_bonus_with_top_entropy_quantile(tiny_model_dir, tmp_path):
    trainer, padded = _trainer(tiny_model_dir, tmp_path, entropy_coef=0.3, top_entropy_quantile=0.25)
    assert _assert_policy_only_rescaled(trainer, padded, off={"_entropy_bonus_enabled": False}) > 1e-4


def test_the_entropy_mask_collective_runs_once_whatever_the_factor(tiny_model_dir, tmp_path):
    """`get_high_entropy_mask` gathers over every process. Recomputing it for a micro-batch whose factor is not 1
    (here padding: 5/4) ran one collective more there than on a process whose factor is 1: ranks out of step (bnpo's
    factor depends on each rank's own tokens). TRL's own call is reused."""
    trainer, padded = _trainer(tiny_model_dir, tmp_path, entropy_coef=0.3, top_entropy_quantile=0.5)
    calls = []
    original = trainer.get_high_entropy_mask

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    trainer.get_high_entropy_mask = counted
    _assert_policy_only_rescaled(trainer, padded, off={"_entropy_bonus_enabled": False})
    calls.clear()
    trainer._compute_loss(trainer.model, padded)
    assert len(calls) == 1 and trainer.get_high_entropy_mask is counted


@pytest.fixture(scope="module")
def tiny_moe_dir(tiny_model_dir, tmp_path_factory):
    """A tiny random Qwen3-MoE with the tiny model's tokenizer; its router's auxiliary loss is on."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        # TRL asks for router logits in its loss forward only (the model's own default is off: generation with them
        # on fails in transformers 5.17's Qwen3-MoE).
        output_router_logits=False,
        router_aux_loss_coef=0.5,  # large, so the kept term is clearly visible next to the policy term
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny_moe")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
def test_moe_auxiliary_loss_is_not_rescaled(tiny_moe_dir, tmp_path, entropy_coef):
    trainer, padded = _trainer(tiny_moe_dir, tmp_path, entropy_coef=entropy_coef)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.5
    off = {"aux_loss_enabled": False, "_entropy_bonus_enabled": False}
    assert _assert_policy_only_rescaled(trainer, padded, off=off) > 1e-4
