"""End to end on the tiny model: scripted tool failures → rollbacks → negative rows in the batch → training."""

import json
from collections import Counter

import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rollout.types import RowKind


class CounterEnv:
    def reset(self, **kwargs):
        self.total = 0

    def add(self, n: int) -> str:
        """
        Add a number to the total.

        Args:
            n: The number to add.
        """
        if not isinstance(n, int):
            raise TypeError(f"n must be an integer, got {type(n).__name__}")
        self.total += n
        return str(self.total)


def total_reward(environments, **kwargs):
    return [float(env.total) for env in environments]


def _call(n):
    return f"<tool_call>\n{json.dumps({'name': 'add', 'arguments': {'n': n}})}\n</tool_call><|im_end|>"


class ScriptedGeneration:
    """Stands in for `_generate_single_turn`: the k-th time a context is seen decides the answer, so rollouts of one
    group differ (some fail) and regenerations (which re-send the same context) get a fresh answer."""

    FIRST = [_call("x"), _call(1), _call(2), "No tool needed.<|im_end|>"]

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.seen = Counter()
        self.batch_sizes = []

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self.batch_sizes.append(len(prompt_ids))
        out = []
        for ids in prompt_ids:
            key = tuple(ids)
            k = self.seen[key]
            self.seen[key] += 1
            text = self.tok.decode(ids)
            if "<tool_response>" in text:
                out.append("Done.<|im_end|>")
            else:
                out.append(self.FIRST[k] if k < len(self.FIRST) else _call(3))
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


def test_negative_rows_reach_the_batch_and_are_trained_on(tiny_model_dir, tiny_tokenizer, tmp_path):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Add something."}]] * 8})
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=2,
        learning_rate=5e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=512,
        logging_steps=1,
        save_strategy="no",
        enable_tool_rollback=True,
        save_negative_samples=True,
        max_negative_samples_per_group=2,
        max_tool_retries=2,
        negative_sample_reward=-1.0,
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=total_reward,
        args=args,
        train_dataset=dataset,
        environment_factory=CounterEnv,
    )
    generation = ScriptedGeneration(tiny_tokenizer)
    trainer._generate_single_turn = generation
    batches = []
    original = trainer._augmenter.__call__

    def capture(*a, **k):
        batch = original(*a, **k)
        batches.append(batch)
        return batch

    trainer._augmenter = capture
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()

    batch = batches[0]
    kinds = batch["row_kind"]
    negative = kinds == RowKind.NEGATIVE
    # One group of 4: one rollout failed once (TypeError) → one negative row, parent's group, reward -1.
    assert negative.sum().item() == 1
    assert (batch["group_id"][negative] == batch["group_id"][kinds == RowKind.REGULAR][0]).all()
    assert batch["advantages"][negative].item() < 0
    # The negative row's trainable tokens are exactly the failed call (tool result masked out).
    neg_ids = batch["completion_ids"][negative][0]
    neg_mask = (batch["completion_mask"] * batch["tool_mask"])[negative][0].bool()
    assert tiny_tokenizer.decode(neg_ids[neg_mask]) == _call("x")
    # Regeneration shared one batched call with the continuations of the other rollouts.
    assert generation.batch_sizes[:3] == [4, 3, 1]
    # The rows were padded to a multiple of steps_per_generation and the loss normaliser counts every real token.
    assert batch["prompt_ids"].size(0) % args.steps_per_generation == 0
    assert batch["num_items_in_batch"].item() == (batch["completion_mask"] * batch["tool_mask"]).sum().item()
    metrics = [h for h in trainer.state.log_history if "negatives/rows" in h]
    assert metrics and metrics[0]["negatives/rows"] == 1.0 and metrics[0]["rollback/attempts"] == 1.0
    moved = [k for k, v in trainer.model.named_parameters() if not torch.equal(before[k], v)]
    assert moved
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(torch.isfinite(torch.tensor(losses)))
