"""Features-off parity with tools and environments: `AgenticGRPOTrainer` trains exactly like TRL's `GRPOTrainer`.

Generation is scripted (the tiny random model never writes a tool call): the same function serves both trainers and
decides each answer from the context alone, with variations inside a group so that advantages and updates are not
zero. Everything else is real: TRL's tool loop (ours delegates to it when no feature needs our loop), tool messages,
token ids, masks, rewards, losses and the weights after two steps, compared bit for bit.
"""

from __future__ import annotations

import asyncio
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
    turns follow from the number of tool results in the context. `turn(k, rounds, room)`, when given, writes the turn
    instead (`room`: completion tokens left before `max_completion_length`)."""

    def __init__(self, tokenizer, tool: str, always_call: bool = False, turn=None, budget: int | None = None):
        self.tok, self.tool, self.always_call, self.turn, self.budget = tokenizer, tool, always_call, turn, budget
        self.header = self.tok.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def _room(self, ids: list[int]) -> int | None:
        if self.budget is None:
            return None
        h = len(self.header)
        start = next(i + h for i in range(len(ids)) if ids[i : i + h] == self.header)  # the first assistant turn's
        return self.budget - (len(ids) - start)

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
            if self.turn is not None:
                turns = context.count("<|im_start|>assistant") - 1  # assistant turns so far
                texts.append(f"[v{k}] " + self.turn(k, turns, self._room(ids)))
                continue
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
        self.states = []  # the environments' totals when the rewards were computed
        self.__name__ = "tool_reward"

    def __call__(self, completions, environments=None, **kwargs):
        self.completions.append(json.dumps(completions, sort_keys=True))
        self.states.append([env.total for env in environments] if environments else None)
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
    turn, tools = scenario.pop("turn", None), scenario.pop("tools", None)
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
        per_device_train_batch_size=8,  # two groups of 4 per generation batch
        num_generations=4,
        max_completion_length=400,
        logging_steps=1,
        save_strategy="no",
    )
    args = config_cls(**{**values, **scenario})
    reward = Recorded()
    if tools is not None:
        kwargs = {"environment_factory": tools} if isinstance(tools, type) else {"tools": list(tools)}
    elif tool == "bump":
        kwargs = {"environment_factory": Counter}
    else:
        kwargs = {"tools": [add if tool == "add" else multiply]}
    trainer = trainer_cls(model=model_dir, reward_funcs=reward, args=args, train_dataset=_dataset(), **kwargs)
    trainer._generate_single_turn = Script(trainer._tokenizer, tool, always, turn, args.max_completion_length)
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
    return history, batches, (reward.completions, reward.states), weights


SCENARIOS = {
    "sync_tools_dapo": dict(tool="add", loss_type="dapo"),
    "async_tools_grpo": dict(tool="multiply", loss_type="grpo"),
    "environment_dr_grpo": dict(tool="bump", loss_type="dr_grpo"),
    "iteration_cap": dict(tool="add", always_call=True, max_tool_calling_iterations=2, loss_type="grpo"),
    "reference_model": dict(tool="bump", beta=0.1, loss_type="dapo"),
    "gradient_accumulation": dict(tool="add", per_device_train_batch_size=4, gradient_accumulation_steps=2),
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
    ref_completions, _ = _assert_same_training(tiny_model_dir, tmp_path, scenario)
    # The comparison can fail: tools were called and failed.
    calls = [m for c in json.loads(ref_completions[0]) for m in c if m["role"] == "tool"]
    assert calls and any(_error_text(m["content"]) for c in ref_completions for m in _tools(c))
    if scenario.get("always_call"):
        assert all(len(_tools_of(c)) == 2 for c in json.loads(ref_completions[0]))  # stopped by the iteration cap


def _assert_same_training(tiny_model_dir, tmp_path, scenario: dict) -> list[str]:
    """Trains `GRPOTrainer` and `AgenticGRPOTrainer` on `scenario` and asserts they are the same, bit for bit: tool
    messages, token ids, masks, advantages, log-probs, logged metrics and the weights after 2 steps. Returns the
    conversations TRL's reward function saw (one JSON string per call)."""
    ref = _train(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / "trl", scenario)
    ours = _train(AgenticGRPOTrainer, AgenticGRPOConfig, tiny_model_dir, tmp_path / "ours", scenario)
    history = ours[0]
    ran_ours = any("tools/truncated_turns" in h for h in history)  # logged by trl-agentic's loop only
    assert ran_ours == bool(scenario.get("ours_only")), "the scenario did not run the loop it meant to"
    ref_history, ref_batches, (ref_completions, ref_states), ref_weights = ref
    history, batches, (completions, states), weights = ours
    # Same tool messages (TRL's error rendering included) seen by the reward function, call for call.
    assert completions == ref_completions
    assert states == ref_states  # and the environments were left in the same states
    # Same tokens, masks, advantages and log-probs, bit for bit (ours only adds its own bookkeeping keys).
    assert len(batches) == len(ref_batches) >= 1
    for batch, ref_batch in zip(batches, ref_batches):
        for key in TRL_KEYS:
            assert (key in batch) == (key in ref_batch), key
            if key in ref_batch:
                assert torch.equal(batch[key], ref_batch[key]), key
        rows = ref_batch["prompt_ids"].size(0)  # our group ids are TRL's layout: row i in group i // G
        assert rows >= 8 and torch.equal(batch["group_id"], torch.arange(rows) // 4)
    # Same losses, rewards and metrics TRL logs; ours logs extra keys only.
    steps = [h for h in history if "loss" in h]
    ref_steps = [h for h in ref_history if "loss" in h]
    assert len(steps) == len(ref_steps) == 2
    for step, ref_step in zip(steps, ref_steps):
        assert {k: step[k] for k in ref_step} == ref_step
    for key, value in ref_weights.items():
        assert torch.equal(weights[key], value), key
    # The comparison can fail: advantages were non-zero, and the weights moved.
    assert any(b["advantages"].abs().sum() > 0 for b in ref_batches)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(start[k], weights[k]) for k in start)
    return ref_completions, ref_states


def _tools(recorded: str) -> list[dict]:
    return [m for c in json.loads(recorded) for m in _tools_of(c)]


def _tools_of(completion: list[dict]) -> list[dict]:
    return [m for m in completion if m["role"] == "tool"]


# ---------------------------------------------------------------------------------------------------------------------
# trl-agentic's own loop renders exactly as TRL's `_tool_call_loop` in the cases its re-implementation has to get right:
# the order of a turn's sync and async results, list results, concurrent async calls, and the completion budget. Each
# scenario turns on a feature that needs our loop but is never triggered (a time limit nothing reaches, rollback on an
# error type nothing raises).

NOT_TRIGGERED = {
    "timeout": dict(tool_timeout=30.0),
    "rollback": dict(enable_tool_rollback=True, save_negative_samples=True, rollback_on_errors=["NeverRaisedError"]),
}


def _calls(*calls: tuple[str, dict], end: str = "<|im_end|>") -> str:
    blocks = [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls]
    return "\n".join(blocks) + end


async def square(x: int) -> str:
    """
    Square a number, slowly.

    Args:
        x: The number (not 3).
    """
    await asyncio.sleep(0)
    if x == 3:
        raise ValueError("3 is unlucky")
    return str(x * x)


def shout(word: str) -> str:
    """
    Upper-case a word.

    Args:
        word: The word.
    """
    return word.upper()


def _async_then_sync(k: int, turns: int, room) -> str:
    # An async call before a sync one: TRL puts the sync result first, then the async results in call order.
    if turns >= 2 or k % 3 == 2:
        return "Done.<|im_end|>"
    return _calls(("square", {"x": k + turns}), ("shout", {"word": f"w{k}"}), ("square", {"x": k + 1}))


def lookup(key: str) -> list:
    """
    Look a key up.

    Args:
        key: The key.
    """
    if key == "k2":
        raise KeyError(key)
    return [{"type": "text", "text": f"value of {key}"}, {"type": "text", "text": "(cached)"}]


def _list_result(k: int, turns: int, room) -> str:
    if turns >= 1 or k % 4 == 3:
        return "Done.<|im_end|>"
    return _calls(("lookup", {"key": f"k{k % 3}"}), ("shout", {"word": "x"}))


_RUNNING: list[str] = []


async def probe(tag: str) -> str:
    """
    Report how many probes run at once.

    Args:
        tag: A name for this probe.
    """
    _RUNNING.append(tag)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    seen = len(_RUNNING)  # 2 when the turn's two calls run concurrently (TRL gathers them), 1 one after the other
    await asyncio.sleep(0)
    _RUNNING.remove(tag)
    if tag.endswith("3"):
        raise RuntimeError(f"{tag} broke")
    return f"{tag}: {seen} running"


def _concurrent(k: int, turns: int, room) -> str:
    if turns >= 2 or k % 3 == 2:
        return "Done.<|im_end|>"
    return _calls(("probe", {"tag": f"a{k + turns}"}), ("probe", {"tag": f"b{k}"}))


def _bad_arguments(k: int, turns: int, room) -> str:
    # Arguments that are not an object, which TRL's parser passes through: TRL's `tool(**arguments)` raises Python's
    # TypeError for them (an empty string included), an async tool's among the sync results.
    if turns >= 1 or k % 4 == 3:
        return "Done.<|im_end|>"
    bad = ['"w1"', '""', "[1, 2]"][k % 3]
    blocks = [f'<tool_call>\n{{"name": "{name}", "arguments": {bad}}}\n</tool_call>' for name in ("square", "shout")]
    return "\n".join([*blocks, _calls(("shout", {"word": "ok"}), end="")]) + "<|im_end|>"


class Tape:
    """A stateful environment with a long-output tool, for the completion budget."""

    def reset(self, **row):
        self.total = 0

    def bump(self, n: int) -> str:
        """
        Add to the tape.

        Args:
            n: An even number.
        """
        if n % 2:
            raise ValueError(f"{n} is odd")
        self.total += n
        return str(self.total)

    def fill(self, n: int) -> str:
        """
        A long output.

        Args:
            n: Its length.
        """
        self.total += 100
        return "." * n


def _budget(k: int, turns: int, room: int) -> str:
    """Under `max_completion_length=160`: a tool result that does not fit (dropped, the rollout ends there), a turn
    cut by the budget, and a turn whose tool call ends exactly at the budget without an end of turn (TRL still runs
    the call, then drops its result: no room)."""
    if turns == 0:
        kind = k % 4
        if kind == 0:
            return _calls(("fill", {"n": 400}))  # its result cannot fit
        if kind == 3:
            return "Nothing to do.<|im_end|>"
        return _calls(("bump", {"n": k}))  # odd k: an error result (fits)
    if turns == 1 and k % 2 == 0:
        return "z" * 400  # cut to the room left
    if turns == 1:
        call = _calls(("bump", {"n": 2}), end="")
        pad = room - len(call.encode()) - len(f"[v{k}] ".encode())  # byte-level tokenizer: one token per byte
        assert pad >= 0, room
        return "y" * pad + call  # ends exactly at the budget, no end-of-turn token
    return "Done.<|im_end|>"


LOOP_SCENARIOS = {
    "async_then_sync_timeout": dict(tools=[square, shout], turn=_async_then_sync, ours_only=NOT_TRIGGERED["timeout"]),
    "async_then_sync_rollback": dict(
        tools=[square, shout], turn=_async_then_sync, ours_only=NOT_TRIGGERED["rollback"], loss_type="grpo"
    ),
    "list_result": dict(tools=[lookup, shout], turn=_list_result, ours_only=NOT_TRIGGERED["timeout"]),
    "concurrent_async": dict(tools=[probe], turn=_concurrent, ours_only=NOT_TRIGGERED["rollback"]),
    "bad_arguments": dict(tools=[square, shout], turn=_bad_arguments, ours_only=NOT_TRIGGERED["timeout"]),
    "budget_timeout": dict(
        tools=Tape, turn=_budget, max_completion_length=160, ours_only=NOT_TRIGGERED["timeout"], loss_type="grpo"
    ),
    "budget_rollback": dict(tools=Tape, turn=_budget, max_completion_length=160, ours_only=NOT_TRIGGERED["rollback"]),
}


@pytest.mark.parametrize("name", list(LOOP_SCENARIOS))
def test_our_loop_renders_as_trl(tiny_model_dir, tmp_path, name):
    scenario = {"tool": None, **LOOP_SCENARIOS[name]}
    recorded, states = _assert_same_training(tiny_model_dir, tmp_path, scenario)
    conversations = [c for call in recorded for c in json.loads(call)]
    rounds = [r for c in conversations for r in _tool_rounds(c)]
    # The scenario reached what it is about (in TRL's run; ours is the same).
    if name.startswith("async_then_sync"):
        assert any([m["name"] for m in r] == ["shout", "square", "square"] for r in rounds), rounds
        assert any(_error_text(m["content"]) for r in rounds for m in r)
    elif name == "list_result":
        assert any(isinstance(m["content"], list) for r in rounds for m in r)
        assert any(_error_text(m["content"]) for r in rounds for m in r)
    elif name == "concurrent_async":
        contents = [m["content"] for r in rounds for m in r]
        assert any(c.endswith("2 running") for c in contents) and any(_error_text(c) for c in contents)
    elif name == "bad_arguments":
        contents = [m["content"] for r in rounds for m in r]
        assert any("argument after ** must be a mapping, not str" in c for c in contents)
        assert sum("must be a mapping" in c for c in contents) > sum(c == "OK" for c in contents) > 0
    else:
        # A tool result that could not fit (dropped: the conversation ends with the call), a turn cut by the budget,
        # and a turn cut right after a complete call, which TRL ran (its bump is in the environment's total) and
        # whose result it dropped.
        assert [{"n": 400}] in [
            [c["function"]["arguments"] for c in conv[-1].get("tool_calls", [])] for conv in conversations
        ]
        assert any(conv[-1]["content"].endswith("z" * 20) and "tool_calls" not in conv[-1] for conv in conversations)
        totals = [t for call_states in states for t in call_states]
        cut_calls = [
            (conv, total)
            for conv, total in zip(conversations, totals)
            if conv[-1]["role"] == "assistant" and conv[-1].get("tool_calls") and "yyy" in conv[-1]["content"]
        ]
        assert cut_calls
        for conv, total in cut_calls:
            assert total == 2 + 2 and conv[-2]["content"] == "2"  # the first bump's result, then the cut turn's bump


def _tool_rounds(conversation: list[dict]) -> list[list[dict]]:
    """The tool messages of each round of a conversation (consecutive tool messages)."""
    rounds, current = [], []
    for message in conversation + [{"role": "end"}]:
        if message["role"] == "tool":
            current.append(message)
        elif current:
            rounds.append(current)
            current = []
    return rounds
