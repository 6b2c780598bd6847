"""Zero-weight padding rows change no loss: per-row loss types are rescaled, token-normalised ones are unaffected."""

import pytest
import torch
from datasets import Dataset

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
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)
