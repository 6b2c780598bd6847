"""Features-off parity with tools and environments: `AgenticGRPOTrainer` trains exactly like TRL's `GRPOTrainer`.

Generation is scripted (the tiny random model never writes a tool call): the same function serves both trainers and
decides each answer from the context alone, with variations inside a group so that advantages and updates are not
zero. Everything else is real: TRL's tool loop (ours delegates to it when no feature needs our loop), tool messages,
token ids, masks, rewards, losses and the weights after two steps, compared bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer

TOPICS = ["apples", "boats", "cards", "dunes"]


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"


def add(a: int, b: int) -> str:
    """
    Add two integers.

    Args:
        a: First number.
        b: Second number.
    """
    if a < 0:
        raise ValueError("a must be non-negative")
    return str(a + b)


async def multiply(a: int, b: int) -> str:
    """
    Multiply two integers.

    Args:
        a: First number.
        b: Second number.
    """
    if b == 0:
        raise ZeroDivisionError("b must not be zero (for this test)")
    return str(a * b)


class Counter:
    """A stateful environment whose tool raises sometimes (odd numbers)."""

    def reset(self, **row):
        self.total = 0

    def bump(self, n: int) -> str:
        """
        Add to the counter.

        Args:
            n: An even number.
        """
        if n % 2:
            raise ValueError(f"{n} is odd")
        self.total += n
        return str(self.total)


class Script:
    """`_generate_single_turn` for both trainers: the k-th copy of a prompt in a first-turn call gets variant k; later
    turns follow from the number of tool results in the context."""

    def __init__(self, tokenizer, tool: str, always_call: bool = False):
        self.tok, self.tool, self.always_call = tokenizer, tool, always_call

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        seen: dict[tuple, int] = {}
        texts = []
        for ids in prompt_ids:
            context = self.tok.decode(ids)
            rounds = context.count("<tool_response>")
            variant = seen.get(tuple(ids), 0)
            seen[tuple(ids)] = variant + 1
            if rounds == 0:
                k = variant + sum(map(ord, context)) % 3
            else:
                k = int(context.split("[v")[-1].split("]")[0]) + rounds
            if self.always_call or (rounds < 2 and k % 3 != 2):
                a = -1 if k % 4 == 3 else k
                texts.append(f"[v{k}] " + _call(self.tool, **self._args(a, k)))
            else:
                texts.append(f"[v{k}] Done after {rounds} calls.<|im_end|>")
        return [self.tok.encode(t, add_special_tokens=False) for t in texts], None

    def _args(self, a: int, k: int) -> dict:
        if self.tool == "bump":
            return {"n": k}
        if self.tool == "multiply":
            return {"a": a, "b": k % 3}
        return {"a": a, "b": k}


def _error_text(content) -> bool:
    """TRL's rendering of a raised tool error (these scenarios' tools never return text like it)."""
    return isinstance(content, str) and content.startswith("{'error': ")


class Recorded:
    """Reward function recording what TRL passes to it (the tool messages as the model saw them)."""

    def __init__(self):
        self.completions = []
        self.__name__ = "tool_reward"

    def __call__(self, completions, environments=None, **kwargs):
        self.completions.append(json.dumps(completions, sort_keys=True))
        rewards = []
        for k, messages in enumerate(completions):
            tools = [m for m in messages if m["role"] == "tool"]
            ok = sum(not _error_text(m["content"]) for m in tools)  # TRL's loop gives text only
            state = environments[k].total if environments else 0
            rewards.append(ok - 0.5 * (len(tools) - ok) + 0.1 * state + 0.01 * len(messages))
        return rewards


def _dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count {t}."}] for t in TOPICS] * 4})


def _train(trainer_cls, config_cls, model_dir, out_dir, scenario: dict):
    scenario = dict(scenario)
    tool, always = scenario.pop("tool"), scenario.pop("always_call", False)
    ours_only = scenario.pop("ours_only", {})
    if trainer_cls is AgenticGRPOTrainer:
        scenario.update(ours_only)
    values = dict(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=11,
        max_steps=2,
        learning_rate=5e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=400,
        logging_steps=1,
        save_strategy="no",
    )
    args = config_cls(**{**values, **scenario})
    reward = Recorded()
    kwargs = {"environment_factory": Counter} if tool == "bump" else {"tools": [add if tool == "add" else multiply]}
    trainer = trainer_cls(model=model_dir, reward_funcs=reward, args=args, train_dataset=_dataset(), **kwargs)
    trainer._generate_single_turn = Script(trainer._tokenizer, tool, always)
    batches = []
    original = trainer._generate_and_score_completions

    def keep(inputs):
        batch = original(inputs)
        batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return batch

    trainer._generate_and_score_completions = keep
    trainer.train()
    history = [
        {k: v for k, v in h.items() if k not in ("step_time", "train_runtime")} for h in trainer.state.log_history
    ]
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return history, batches, reward.completions, weights


SCENARIOS = {
    "sync_tools_dapo": dict(tool="add", loss_type="dapo"),
    "async_tools_grpo": dict(tool="multiply", loss_type="grpo"),
    "environment_dr_grpo": dict(tool="bump", loss_type="dr_grpo"),
    "iteration_cap": dict(tool="add", always_call=True, max_tool_calling_iterations=2, loss_type="grpo"),
    "reference_model": dict(tool="bump", beta=0.1, loss_type="dapo"),
    "gradient_accumulation": dict(tool="add", per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "num_iterations": dict(tool="multiply", num_iterations=2, loss_type="grpo"),
    # A time limit needs trl-agentic's loop (TRL has none): with nothing hanging, ours must be TRL's, bit for bit, so
    # turning a robustness field or a feature on does not change what the model reads.
    "our_loop_sync_tools": dict(tool="add", loss_type="dapo", ours_only=dict(tool_timeout=30.0)),
    "our_loop_environment_cap": dict(
        tool="bump", always_call=True, max_tool_calling_iterations=2, ours_only=dict(tool_timeout=30.0)
    ),
}
TRL_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "advantages",
    "num_items_in_batch",
    "old_per_token_logps",
    "ref_per_token_logps",
)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_features_off_with_tools_matches_grpo_trainer(tiny_model_dir, tmp_path, name):
    scenario = SCENARIOS[name]
    ref = _train(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / "trl", scenario)
    ours = _train(AgenticGRPOTrainer, AgenticGRPOConfig, tiny_model_dir, tmp_path / "ours", scenario)
    history = ours[0]
    ran_ours = any("tools/truncated_turns" in h for h in history)  # logged by trl-agentic's loop only
    assert ran_ours == bool(scenario.get("ours_only")), "the scenario did not run the loop it meant to"
    ref_history, ref_batches, ref_completions, ref_weights = ref
    history, batches, completions, weights = ours
    # Same tool messages (TRL's error rendering included) seen by the reward function, call for call.
    assert completions == ref_completions
    # Same tokens, masks, advantages and log-probs, bit for bit (ours only adds its own bookkeeping keys).
    assert len(batches) == len(ref_batches) >= 1
    for batch, ref_batch in zip(batches, ref_batches):
        for key in TRL_KEYS:
            assert (key in batch) == (key in ref_batch), key
            if key in ref_batch:
                assert torch.equal(batch[key], ref_batch[key]), key
    # Same losses, rewards and metrics TRL logs; ours logs extra keys only.
    steps = [h for h in history if "loss" in h]
    ref_steps = [h for h in ref_history if "loss" in h]
    assert len(steps) == len(ref_steps) == 2
    for step, ref_step in zip(steps, ref_steps):
        assert {k: step[k] for k in ref_step} == ref_step
    for key, value in ref_weights.items():
        assert torch.equal(weights[key], value), key
    # The comparison can fail: tools were called and failed, advantages were non-zero, and the weights moved.
    calls = [m for c in json.loads(ref_completions[0]) for m in c if m["role"] == "tool"]
    assert calls and any(_error_text(m["content"]) for c in ref_completions for m in _tools(c))
    assert any(b["advantages"].abs().sum() > 0 for b in ref_batches)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(start[k], weights[k]) for k in start)
    if scenario.get("always_call"):
        assert all(len(_tools_of(c)) == 2 for c in json.loads(ref_completions[0]))  # stopped by the iteration cap


def _tools(recorded: str) -> list[dict]:
    return [m for c in json.loads(recorded) for m in _tools_of(c)]


def _tools_of(completion: list[dict]) -> list[dict]:
    return [m for m in completion if m["role"] == "tool"]
