"""The ablation's equal-compute unit (amendment 3): token passes counted by a hook, checked against counts made
independently (attention masks, generated lengths, TRL's own `num_tokens`)."""

import pytest
import torch

from trl_agentic.ablation import compute


@pytest.fixture
def lora_model(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))


def _batch():
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 13, 14]])
    return ids, (ids != 0).long()


def test_forwards_count_their_unpadded_tokens_and_a_backward_counts_twice(lora_model):
    """Through the PEFT model, as the trainers call it; the counter sits on the base model's decoder."""
    ids, mask = _batch()
    with compute.TokenPasses(lora_model) as counter:
        with torch.no_grad():
            lora_model(input_ids=ids, attention_mask=mask)
        assert (counter.forward_tokens, counter.backward_tokens) == (int(mask.sum()), 0) == (10, 0)
        lora_model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        lora_model(input_ids=ids[:1])  # no mask: every position
    assert counter.forward_tokens == 10 and counter.backward_tokens == 10 + 5
    assert counter.total == 10 + compute.BACKWARD_FACTOR * 15 == counter.record()["total"]
    with torch.no_grad():
        lora_model(input_ids=ids, attention_mask=mask)  # detached: not counted
    assert counter.total == 40
    with compute.TokenPasses(lora_model), pytest.raises(ValueError, match="2-D attention mask"):
        lora_model(input_ids=ids, attention_mask=mask[:, :2])  # a mask the unit cannot read is refused, not guessed


def test_generation_counts_its_prefill_and_each_decoded_token_once(lora_model):
    """`k` new tokens: the prefill forward (the unpadded prompt tokens) yields the first, then k - 1 forwards of one
    new position per row (the cache holds the rest). Rows that finished still run in the batch and are counted."""
    ids, mask = _batch()
    k = 6
    with compute.TokenPasses(lora_model) as counter, torch.no_grad():
        out = lora_model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0
        )
    assert out.shape[1] == ids.shape[1] + k
    assert counter.forward_tokens == int(mask.sum()) + len(ids) * (k - 1) and counter.backward_tokens == 0


@pytest.mark.parametrize(("budget", "steps"), [(10**12, 2), (1, 1)])
def test_the_budget_stops_training_and_never_outlasts_max_steps(tiny_model_dir, tmp_path, budget, steps):
    """A budget not yet spent leaves `max_steps` in charge; a spent one stops after the first step. TRL's training
    forward and backward is exactly its `num_tokens` (prompt and completion tokens of its batches; with tools,
    `num_tokens` leaves the tool results out, which the forward processes)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=2, save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=4, logging_steps=1,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 32})
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=lambda completions, **k: [float(len(c[0]["content"])) for c in completions],
        args=args,
        train_dataset=dataset,
    )
    counter = compute.TokenPasses(trainer.model)
    trainer.add_callback(compute.stop_at_token_passes(budget, counter))
    with counter:
        trainer.train()
    assert trainer.state.global_step == steps
    assert len(counter.per_step) == steps and counter.per_step[-1] == counter.total
    assert counter.per_step == sorted(counter.per_step) and counter.per_step[0] > 0
    num_tokens = max(h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h)
    assert counter.backward_tokens == num_tokens
    # Generation: each row's prompt once, then at most 4 decoded positions per row (the batch runs to its longest).
    prompt_tokens = num_tokens - sum(
        h["completions/mean_length"] * 4 for h in trainer.state.log_history if "completions/mean_length" in h
    )
    assert prompt_tokens <= counter.forward_tokens <= prompt_tokens + steps * 4 * 4
