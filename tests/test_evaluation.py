"""Held-out evaluation: the real multi-turn tool loop, the metric definitions and the prefix-cached generation."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_agentic.envs.calculator import CalculatorEnv, answer_reward, make_arithmetic_tasks
from trl_agentic.envs.protocol import tool_methods
from trl_agentic.evaluation import HFGenerationBackend, evaluate_policy, format_comparison, summarize


class ScriptedModel(torch.nn.Module):
    """A stand-in causal LM whose `generate` decides each row's next turn from its decoded context.

    Problem k (by its question) behaves as `plan[k % len(plan)]`: "right" calls the tool with the right expression then
    answers with the result, "bad-then-right" first sends a malformed expression, "no-tool" answers 0 directly,
    "wrong-copy" calls the tool right but answers the result + 1.
    """

    def __init__(self, tokenizer, rows, plan):
        super().__init__()
        self.tok, self.plan = tokenizer, plan
        self.expression = {row["prompt"][-1]["content"]: (k, row["expression"]) for k, row in enumerate(rows)}
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"max_position_embeddings": 100_000})()
        self.modes = []

    def _turn(self, text):
        question = next(q for q in self.expression if q in text)
        k, expression = self.expression[question]
        behaviour = self.plan[k % len(self.plan)]
        responses = text.count("<tool_response>")
        call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "%s"}}\n</tool_call>'
        if behaviour == "no-tool":
            return "Answer: 0"
        if responses == 0:
            return call % (expression.replace("*", "x") if behaviour == "bad-then-right" else expression)
        if behaviour == "bad-then-right" and responses == 1:
            return call % expression
        result = int(text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0])
        return f"Answer: {result + (1 if behaviour == 'wrong-copy' else 0)}"

    def generate(self, input_ids, attention_mask, generation_config, **kwargs):
        pad_token_id, [eos_token_id] = generation_config.pad_token_id, generation_config.eos_token_id
        self.modes.append(self.training)
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tok.decode([t for t, m in zip(ids, mask) if m])
            rows.append(self.tok.encode(self._turn(text), add_special_tokens=False) + [eos_token_id])
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


PLAN = ["right", "bad-then-right", "no-tool", "wrong-copy"]


def test_metrics_of_a_scripted_policy(tiny_tokenizer):
    rows = make_arithmetic_tasks(8, 11, "medium")
    model = ScriptedModel(tiny_tokenizer, rows, PLAN)
    result = evaluate_policy(
        model,
        tiny_tokenizer,
        rows,
        environment_factory=CalculatorEnv,
        reward_funcs=[answer_reward],
        max_completion_length=4096,
        batch_size=3,  # uneven chunks
        prefix_caching=False,
        progress=False,
    )
    m = result.metrics
    # right + bad-then-right answer correctly; no-tool and wrong-copy do not.
    assert m["success_rate"] == 0.5 and m["reward"] == 0.5
    # Every behaviour but no-tool ends with a successful call.
    assert m["tool_success_rate"] == 0.75 and m["no_tool_call_rate"] == 0.25
    # Calls: right 1, bad-then-right 2 (one failed), no-tool 0, wrong-copy 1 -> 4 per 4 problems, 1 failure in 4.
    assert m["tool_calls_per_problem"] == 1.0 and m["tool_failure_rate"] == 0.25
    assert m["tool_call_success_rate"] == 0.75
    by_behaviour = {PLAN[k % 4]: r for k, r in enumerate(result.records)}
    assert by_behaviour["bad-then-right"]["tool_failures"] == 1 and by_behaviour["bad-then-right"]["correct"]
    tool_messages = [x for x in by_behaviour["bad-then-right"]["messages"] if x["role"] == "tool"]
    assert tool_messages[0]["content"].startswith("{'error': \"Invalid expression")  # TRL's error rendering
    assert by_behaviour["wrong-copy"]["tool_failures"] == 0 and not by_behaviour["wrong-copy"]["correct"]
    json.dumps(result.records)  # records are plain data
    assert not any(model.modes) and model.training  # generated in eval mode, training mode restored


def test_summary_and_comparison_table():
    records = [
        {"rewards": [1.0], "reward": 1.0, "tool_calls": 2, "tool_failures": 1, "completion_tokens": 10},
        {"rewards": [0.0], "reward": 0.0, "tool_calls": 0, "tool_failures": 0, "completion_tokens": 20},
    ]
    m = summarize(records, 3.0)
    assert m["success_rate"] == 0.5 and m["tool_success_rate"] == 0.5 and m["tool_failure_rate"] == 0.5
    assert summarize([])["num_problems"] == 0
    table = format_comparison({"before GRPO": m, "after GRPO": {**m, "success_rate": 0.75}})
    assert "before GRPO" in table.splitlines()[0] and "after GRPO" in table.splitlines()[0]
    assert "50.0%" in table and "75.0%" in table


def test_prefix_cached_generation_equals_plain_generation(tiny_model_dir, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rows = make_arithmetic_tasks(5, 0, "medium")
    tools = [list(tool_methods(CalculatorEnv()).values())] * len(rows)
    outputs = {}
    for caching in (True, False):
        backend = HFGenerationBackend(
            model, tiny_tokenizer, tools, max_completion_length=12, max_iterations=1, prefix_caching=caching
        )
        contexts = [backend.render_prompt(r["prompt"], k) for k, r in enumerate(rows)]
        contexts[1] = contexts[1] + tiny_tokenizer.encode("12 * 3", add_special_tokens=False)  # uneven lengths
        outputs[caching], _ = backend.generate(contexts)
    assert outputs[True] == outputs[False]
    assert all(len(o) > 0 for o in outputs[True])


def test_a_trained_lora_policys_shared_prefix_is_computed_as_generate_computes_it(tiny_model_dir, tiny_tokenizer):
    """A policy trained with `bf16=True` keeps accelerate's autocast `forward` (set by `prepare`); PEFT's `generate`
    does not go through it (float32 here). The evaluation's shared-prefix cache must hold the keys `generate` would
    compute, not bfloat16 ones (which move them by ~1e-2)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    AcceleratorState._reset_state(True)  # another test's trainer may have set up the process without bf16
    try:
        policy = Accelerator(cpu=True, mixed_precision="bf16").prepare(get_peft_model(base, lora)).eval()
    finally:
        AcceleratorState._reset_state(True)
    assert "forward" in policy.__dict__  # the autocast wrapper the trained policy carries
    rows = make_arithmetic_tasks(2, 0, "medium")
    tools = [list(tool_methods(CalculatorEnv()).values())] * len(rows)
    backend = HFGenerationBackend(policy, tiny_tokenizer, tools, max_completion_length=4, max_iterations=1)
    prefix = backend.render_prompt(rows[0]["prompt"], 0)[:40]
    with torch.no_grad():
        cached = backend._prefix_cache(prefix).layers[0].keys[0]
        out = policy.generate(
            input_ids=torch.tensor([prefix + [0]]), max_new_tokens=1, do_sample=False, return_dict_in_generate=True
        )
    reference = out.past_key_values.layers[0].keys[0, :, : len(prefix)]
    assert cached.dtype == reference.dtype
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5)
    # Prompt tuning's `generate` adds virtual tokens the base model's forward lacks: its prefix is not cached.
    virtual = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    prompt = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), virtual)
    kwargs = dict(max_completion_length=4, max_iterations=1)
    assert backend.prefix_caching and not HFGenerationBackend(prompt, tiny_tokenizer, tools, **kwargs).prefix_caching


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_real_model_loop_runs_greedy_and_sampled(tiny_model_dir, tiny_tokenizer, temperature):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = make_arithmetic_tasks(4, 1, "medium")
    result = evaluate_policy(
        model,
        tiny_tokenizer,
        rows,
        environment_factory=CalculatorEnv,
        reward_funcs=[answer_reward],
        max_completion_length=16,
        batch_size=4,
        temperature=temperature,
        progress=False,
    )
    assert result.metrics["num_problems"] == 4 and not math.isnan(result.metrics["success_rate"])
    assert all(0 < r["completion_tokens"] <= 16 for r in result.records)


class _RewardingEnv(CalculatorEnv):
    """An environment that owns a reward (TRL's `get_reward`): 1 when at least one call went through."""

    def get_reward(self):
        return float(self.calls > self.failures)


def test_environment_reward_is_added_like_trl(tiny_tokenizer):
    rows = make_arithmetic_tasks(4, 11, "medium")
    result = evaluate_policy(
        ScriptedModel(tiny_tokenizer, rows, PLAN),
        tiny_tokenizer,
        rows,
        environment_factory=_RewardingEnv,
        reward_funcs=[answer_reward],
        max_completion_length=4096,
        prefix_caching=False,
        progress=False,
    )
    assert [r["rewards"] for r in result.records] == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
    assert result.metrics["success_rate"] == 0.5 and result.metrics["reward"] == 1.25


class _SecretEnv:
    """`reset` returns an observation (like the text world's first room): the only place the secret is written."""

    def reset(self, secret: int, **row):
        return f" The secret is {secret}."

    def noop(self) -> str:
        """
        Do nothing.
        """
        return "ok"


class _ReadsTheSecret(ScriptedModel):
    """Answers the secret when its context shows it, 0 otherwise."""

    def _turn(self, text):
        found = text.split("The secret is ", 1)
        return f"Answer: {found[1].split('.', 1)[0]}" if len(found) == 2 else "Answer: 0"


def test_the_observation_reset_returns_joins_the_prompt_as_in_trl(tiny_tokenizer):
    """TRL appends what `env.reset` returns to the last prompt message before generating: the evaluated model sees it
    too (the text world's first observation), and reward functions get that prompt."""
    rows = [
        {"prompt": [{"role": "user", "content": f"Problem {k}: what is the secret?"}], "secret": 10 + k}
        for k in range(3)
    ]
    seen = []

    def secret_reward(completions, prompts, secret, **kwargs):
        seen.extend(p[-1]["content"] for p in prompts)
        return [float(c[-1]["content"] == f"Answer: {s}") for c, s in zip(completions, secret)]

    result = evaluate_policy(
        _ReadsTheSecret(tiny_tokenizer, [], PLAN),
        tiny_tokenizer,
        rows,
        environment_factory=_SecretEnv,
        reward_funcs=[secret_reward],
        max_completion_length=256,
        prefix_caching=False,
        progress=False,
    )
    assert result.metrics["success_rate"] == 1.0
    assert seen == [f"Problem {k}: what is the secret? The secret is {10 + k}." for k in range(3)]
    assert rows[0]["prompt"][-1]["content"] == "Problem 0: what is the secret?"  # the row is left as it was


def test_with_observation_follows_trl_for_text_and_multimodal_content():
    from trl_agentic.envs.protocol import with_observation

    user = [{"role": "system", "content": "s"}, {"role": "user", "content": "Look."}]
    assert with_observation(user, None) == user
    assert with_observation(user, " A room.")[-1] == {"role": "user", "content": "Look. A room."}
    image = [{"type": "image", "image": "x.png"}]
    assert with_observation(user, image)[-1]["content"] == [{"type": "text", "text": "Look."}, *image]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Look."}]}]
    assert with_observation(parts, " A room.")[-1]["content"] == [
        {"type": "text", "text": "Look."},
        {"type": "text", "text": " A room."},
    ]
    assert user[-1]["content"] == "Look." and parts[0]["content"] == [{"type": "text", "text": "Look."}]


class _DeletesThenAnswers(ScriptedModel):
    """Deletes the user message, then answers; records the tool names its prompt lists."""

    def _turn(self, text):
        if "<tool_response>" not in text:  # the first turn: the prompt alone
            listed = [name for name in ("calculate", "delete_context") if f'"name": "{name}"' in text]
            self.seen_tools = sorted(listed, key=lambda name: text.index(f'"name": "{name}"'))  # in the prompt's order
            return '<tool_call>\n{"name": "delete_context", "arguments": {"message_ids": [1]}}\n</tool_call>'
        return "Answer: 0"


@pytest.mark.parametrize("snapshots", [False, True])
def test_evaluation_offers_delete_context_as_training_does(tiny_tokenizer, snapshots):
    """With `context_snapshots` the prompt lists `delete_context` first (TRL's order: the trainer adds it to `tools`)
    and a call deletes the message; without it the call is an unknown tool."""
    rows = make_arithmetic_tasks(2, 11, "medium")
    model = _DeletesThenAnswers(tiny_tokenizer, rows, PLAN)
    result = evaluate_policy(
        model,
        tiny_tokenizer,
        rows,
        environment_factory=CalculatorEnv,
        reward_funcs=[answer_reward],
        max_completion_length=1024,
        prefix_caching=False,
        progress=False,
        context_snapshots=snapshots,
        context_stub_text="[gone]",
    )
    for record in result.records:
        [tool] = [m for m in record["messages"] if m["role"] == "tool"]
        if snapshots:
            assert tool["content"] == "Deleted messages [1]." and record["tool_failures"] == 0
        else:
            assert "delete_context" in tool["content"] and record["tool_failures"] == 1
    assert model.seen_tools == (["delete_context", "calculate"] if snapshots else ["calculate"])


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_generation_in_chunks_equals_one_call_per_turn(tiny_model_dir, tiny_tokenizer, chunk):
    """Rows still generating after `chunk_tokens` continue in a smaller call: greedy, the tokens are those of one call
    per turn, with rows ending (at their first end-of-turn token) at different lengths and the budget cut kept."""
    import copy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rows = make_arithmetic_tasks(6, 3, "medium")
    tools = [list(tool_methods(CalculatorEnv()).values())] * len(rows)

    def run(tokenizer, chunk_tokens):
        backend = HFGenerationBackend(
            model, tokenizer, tools, max_completion_length=20, max_iterations=1, chunk_tokens=chunk_tokens
        )
        contexts = [backend.render_prompt(r["prompt"], k) for k, r in enumerate(rows)]
        contexts[2] = contexts[2] + tiny_tokenizer.encode("12 * 3", add_special_tokens=False)  # uneven lengths
        ids, _ = backend.generate(contexts)
        return ids, backend.generated_tokens

    plain, _ = run(tiny_tokenizer, None)
    # The random tiny model never ends a turn by itself: make a token it emits at different positions the end of
    # turn, so that rows stop at different lengths (some in the first chunk, some later, some never).
    positions = {}
    for row in plain:
        for at, token in enumerate(row):
            positions.setdefault(token, set()).add(at)
    eos = max(positions, key=lambda t: (len(positions[t]), -min(positions[t])))
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    assert tokenizer.eos_token_id == eos and tokenizer.pad_token_id != eos
    one_call, tokens_one = run(tokenizer, None)
    chunked, tokens_chunked = run(tokenizer, chunk)
    assert chunked == one_call and tokens_chunked == tokens_one == sum(len(r) for r in one_call)
    lengths = {len(r) for r in one_call}
    assert len(lengths) > 1 and max(lengths) <= 20
    assert all(r[-1] == eos or len(r) == 20 for r in one_call) and all(eos not in r[:-1] for r in one_call)


def test_chunk_tokens_must_be_positive(tiny_tokenizer):
    with pytest.raises(ValueError, match="chunk_tokens"):
        HFGenerationBackend(None, tiny_tokenizer, [[]], max_completion_length=8, max_iterations=1, chunk_tokens=0)


def test_summary_of_no_problems_has_every_metric_undefined():
    """No problems: every rate is NaN (not missing, which crashed the CLI's report line), the counts are 0."""
    record = {"rewards": [1.0], "reward": 1.0, "tool_calls": 1, "tool_failures": 0, "completion_tokens": 3}
    empty = summarize([], 2.0)
    assert set(empty) == set(summarize([record]))
    assert empty["num_problems"] == 0 and empty["seconds"] == 2.0
    assert all(math.isnan(v) for k, v in empty.items() if k not in ("num_problems", "seconds"))
    assert "nan%" in format_comparison({"after training": empty})


class FiveCallsModel(ScriptedModel):
    """Calls the tool with the right expression five times, then answers with the result."""

    def _turn(self, text):
        question = next(q for q in self.expression if q in text)
        _, expression = self.expression[question]
        if text.count("<tool_response>") < 5:
            call = {"name": "calculate", "arguments": {"expression": expression}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return "Answer: " + text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]


@pytest.mark.parametrize("limit", [None, 0, 2, 7])
def test_tool_round_limit_is_trls(tiny_tokenizer, limit):
    """`max_tool_calling_iterations` as TRL's GRPOTrainer reads it: None is no limit, 0 runs no tool call."""
    rows = make_arithmetic_tasks(2, 3, "easy")
    result = evaluate_policy(
        FiveCallsModel(tiny_tokenizer, rows, []),
        tiny_tokenizer,
        rows,
        environment_factory=CalculatorEnv,
        reward_funcs=[answer_reward],
        max_completion_length=4096,
        max_tool_calling_iterations=limit,
        prefix_caching=False,
        progress=False,
    )
    expected = 5 if limit is None else min(5, limit)
    assert [r["tool_calls"] for r in result.records] == [expected] * len(rows)
    assert result.metrics["success_rate"] == (1.0 if expected == 5 else 0.0)


def test_tool_results_are_cut_as_in_training(tiny_tokenizer):
    """`max_tool_output_chars` cuts every tool result the model reads, as training's loop does (`rollout.tools.
    truncate`): the calculator's results, over 2 characters, become the marker alone."""
    from trl_agentic.rollout.tools import truncate

    rows = make_arithmetic_tasks(2, 3, "easy")
    common = dict(
        environment_factory=CalculatorEnv,
        reward_funcs=[answer_reward],
        max_completion_length=4096,
        max_tool_calling_iterations=1,
        prefix_caching=False,
        progress=False,
    )
    full = evaluate_policy(FiveCallsModel(tiny_tokenizer, rows, []), tiny_tokenizer, rows, **common)
    cut = evaluate_policy(
        FiveCallsModel(tiny_tokenizer, rows, []), tiny_tokenizer, rows, max_tool_output_chars=2, **common
    )

    def results(result):
        return [m["content"] for r in result.records for m in r["messages"] if m["role"] == "tool"]

    assert len(results(full)) == len(rows) and all(len(text) > 2 for text in results(full))
    assert results(cut) == [truncate(text, 2) for text in results(full)]
