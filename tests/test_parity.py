"""Features-off parity: AgenticGRPOTrainer trains exactly like TRL's GRPOTrainer (same losses, rewards, weights)."""

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer


def reward_len(completions, **kwargs):
    # Varies across completions of a group, so advantages are non-zero and the weights move.
    return [float(len(c[0]["content"]) % 7) for c in completions]


def _dataset():
    prompts = [[{"role": "user", "content": f"Say something about {w}."}] for w in ["cats", "rain", "tea", "jazz"]]
    return Dataset.from_dict({"prompt": prompts * 2})


def _train(trainer_cls, config_cls, model_dir, out_dir, **extra):
    args = config_cls(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=123,
        max_steps=2,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        logging_steps=1,
        save_strategy="no",
        **extra,
    )
    trainer = trainer_cls(model=model_dir, reward_funcs=reward_len, args=args, train_dataset=_dataset())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return losses, rewards, weights


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_features_off_matches_grpo_trainer(tiny_model_dir, tmp_path, loss_type):
    ref = _train(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / "trl", loss_type=loss_type)
    ours = _train(AgenticGRPOTrainer, AgenticGRPOConfig, tiny_model_dir, tmp_path / "ours", loss_type=loss_type)
    assert len(ref[0]) == 2 and ref[0] == ours[0]
    assert ref[1] == ours[1]
    assert ref[2].keys() == ours[2].keys()
    for name in ref[2]:
        assert torch.equal(ref[2][name], ours[2][name]), name
    # The comparison can fail: training changed the weights and the rewards had variance.
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(start[k], ours[2][k]) for k in start)
