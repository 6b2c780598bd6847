"""Zero-weight padding rows change no loss: per-row loss types are rescaled, token-normalised ones are unaffected."""

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.batch import BatchAugmenter


def reward(completions, **kwargs):
    return [float(sum(map(ord, c[0]["content"])) % 7) for c in completions]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_padding_row_does_not_change_the_loss(tiny_model_dir, tmp_path, loss_type):
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
        loss_type=loss_type,
        save_strategy="no",
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Say hi."}]] * 4})
    trainer = AgenticGRPOTrainer(model=tiny_model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the loss reads it
    batch = trainer._generate_and_score_completions(list(dataset))
    assert batch["advantages"].abs().sum() > 0
    padded = BatchAugmenter._pad_rows(batch, batch["prompt_ids"].size(0) + 1)
    assert padded["row_kind"][-1].item() == 3 and padded["completion_mask"][-1].sum() == 0
    # At ratio 1 the loss value is ~0 (group-centred advantages); its gradient is what training uses.
    grads = []
    for inputs in (batch, padded):
        trainer.model.zero_grad()
        trainer._compute_loss(trainer.model, inputs).backward()
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5 * grads[0].abs().max().item())


def _rows(batch: dict, index) -> dict:
    index = torch.as_tensor(index)
    return {k: v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


def _grad(trainer, loss) -> torch.Tensor:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)])


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "dr_grpo", "luspo"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_every_real_row_weighs_the_same_across_micro_batches(tiny_model_dir, tmp_path, loss_type, entropy_coef):
    """Two micro-batches, one with 3 real rows, one with 1 real row and 2 padding rows: the accumulated gradient is the
    plain mean of the 4 rows' own terms (computed one row at a time with TRL's loss), plus TRL's entropy bonus of each
    micro-batch unchanged. TRL's per-micro-batch mean would weigh the lone row 3x more than the others."""
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        seed=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        loss_type=loss_type,
        importance_sampling_level="sequence" if loss_type == "luspo" else "token",
        entropy_coef=entropy_coef,
        save_strategy="no",
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Say hi."}]] * 4})
    trainer = AgenticGRPOTrainer(model=tiny_model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(list(dataset))
    assert batch["advantages"].abs().sum() > 0 and int(batch["num_rows_in_batch"]) == 4
    padded = BatchAugmenter._pad_rows(batch, 6)
    micro_batches = [_rows(padded, [0, 1, 2]), _rows(padded, [3, 4, 5])]
    # The per-row losses use the micro-batch's row count: give both micro-batches 3 slots (the padding keeps 6 / 2).
    trainer.args.steps_per_generation = 2

    trainer.current_gradient_accumulation_steps = 2
    ours = sum(_grad(trainer, trainer._compute_loss(trainer.model, mb)) for mb in micro_batches)

    # Plain computation: row r's term is TRL's loss of a batch holding row r alone (no accumulation, no entropy).
    trainer.current_gradient_accumulation_steps = 1
    saved = trainer.entropy_coef, trainer._entropy_bonus_enabled
    trainer.entropy_coef, trainer._entropy_bonus_enabled = 0.0, False
    policy = sum(
        _grad(trainer, GRPOTrainer._compute_loss(trainer, trainer.model, _rows(batch, [r]))) for r in range(4)
    )
    policy = policy / 4
    trainer.entropy_coef, trainer._entropy_bonus_enabled = saved
    expected = policy
    if entropy_coef:
        # TRL's entropy bonus per micro-batch (its policy term vanishes with zero advantages), accumulated over 2.
        trainer.current_gradient_accumulation_steps = 2
        for mb in micro_batches:
            bonus_only = {**mb, "advantages": torch.zeros_like(mb["advantages"])}
            expected = expected + _grad(trainer, GRPOTrainer._compute_loss(trainer, trainer.model, bonus_only))
    assert policy.abs().max() > 1e-6
    # Float32 sums in another order: an absolute floor relative to the gradient's scale (an element near zero after
    # cancellation has no meaningful relative error); TRL's weighting differs by >= 1e-3 of that scale (below).
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    # TRL's own per-micro-batch mean differs (the comparison can fail).
    trainer.current_gradient_accumulation_steps = 2
    trl = sum(_grad(trainer, GRPOTrainer._compute_loss(trainer, trainer.model, mb)) for mb in micro_batches)
    assert (trl - expected).abs().max() > 1e-3 * expected.abs().max()


def _own_token_logps(model, rows: dict) -> torch.Tensor:
    """Per-token log-probs of the completions from our own forward pass and log-softmax (temperature 1)."""
    input_ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    width = rows["completion_ids"].size(1)
    logits = logits[:, -width - 1 : -1, :].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, rows["completion_ids"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("features", ["on", "off"])
def test_bnpo_weighs_every_real_token_the_same_across_micro_batches(tiny_model_dir, tmp_path, features):
    """Issue 35, item 4. A lopsided split, 4 real rows | 1 real row + 3 padding rows: with a feature that reshapes
    batches on, the accumulated bnpo gradient equals a hand-written one in which every real token weighs 1 / N (N the
    real tokens of both micro-batches). 009b255 kept TRL's per-micro-batch normaliser, so the lone row's tokens weighed
    about 4x more. With every feature off it stays TRL's bnpo (checked the other way round)."""
    extra = {"advantage_estimator": "trl_agentic.estimators:grpo_estimator"} if features == "on" else {}
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        seed=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        loss_type="bnpo",
        save_strategy="no",
        **extra,
    )
    assert args.agentic_features_enabled == (features == "on")
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {w}."}] for w in ("hi", "yes")] * 4})
    trainer = AgenticGRPOTrainer(model=tiny_model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(list(dataset))
    real = _rows(batch, [0, 1, 2, 3, 4])
    padded = BatchAugmenter._pad_rows(real, 8)
    mask = real["completion_mask"] * real["tool_mask"] if "tool_mask" in real else real["completion_mask"]
    padded["num_rows_in_batch"] = torch.tensor(5)
    padded["num_items_in_batch"] = mask.sum()
    micro_batches = [_rows(padded, [0, 1, 2, 3]), _rows(padded, [4, 5, 6, 7])]
    assert real["advantages"].abs().sum() > 0 and int(micro_batches[1]["completion_mask"][1:].sum()) == 0

    trainer.current_gradient_accumulation_steps = 2
    ours = sum(_grad(trainer, trainer._compute_loss(trainer.model, mb)) for mb in micro_batches)

    # Hand-written: at ratio 1 the clipped surrogate's gradient is -A * grad log p per trained token.
    logps = _own_token_logps(trainer.model, real)
    weights = mask.float()
    if features == "on":
        weights = weights / mask.sum()  # every real token of the generation batch weighs the same
    else:  # TRL: each micro-batch divided by its own tokens, averaged over the 2 accumulation steps
        weights[:4] = weights[:4] / mask[:4].sum() / 2
        weights[4:] = weights[4:] / mask[4:].sum() / 2
    expected = _grad(trainer, -(real["advantages"].unsqueeze(1) * weights * logps).sum())
    assert expected.abs().max() > 1e-6
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    # The two weightings differ here (the comparison can fail): the lone row is 1 of 5 rows but not 1/2 of the tokens.
    share = mask[4].sum() / mask.sum()
    assert abs(share.item() - 0.5) > 0.2
