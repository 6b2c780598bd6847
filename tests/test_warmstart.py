"""Warm start: synthetic traces are exact tool conversations, laid out token for token like the GRPO rollout."""

import pytest
import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.envs.calculator import CalculatorEnv, answer_reward, make_arithmetic_tasks
from trl_agentic.errors import render_tool_error
from trl_agentic.warmstart import make_tool_traces, run_warmstart


def test_clean_traces_call_the_tool_and_answer_with_its_result():
    rows = make_arithmetic_tasks(20, 3, "medium")
    traces = make_tool_traces(rows, CalculatorEnv)
    for row, trace in zip(rows, traces):
        assert not trace["faulty"]
        call, result, answer = trace["turns"]
        assert call["tool_calls"][0]["function"] == {
            "name": "calculate",
            "arguments": {"expression": row["expression"]},
        }
        assert result == {"role": "tool", "name": "calculate", "content": row["answer"]}
        assert answer == {"role": "assistant", "content": f"Answer: {row['answer']}"}
        assert trace["prompt"] == row["prompt"]


def test_faulty_traces_show_the_real_error_then_recover():
    rows = make_arithmetic_tasks(30, 4, "medium")
    traces = make_tool_traces(rows, CalculatorEnv, error_fraction=1.0, seed=1)
    assert all(t["faulty"] for t in traces)
    bad_calls = set()
    for row, trace in zip(rows, traces):
        bad, error, good, result, answer = trace["turns"]
        expression = bad["tool_calls"][0]["function"]["arguments"]["expression"]
        bad_calls.add(expression.replace(row["expression"], "<e>"))
        # The message is what the rollout loop shows the model for this call.
        with pytest.raises(ValueError) as info:
            CalculatorEnv().calculate(expression)
        assert error["content"] == render_tool_error(str(info.value))
        assert good["tool_calls"][0]["function"]["arguments"]["expression"] == row["expression"]
        assert result["content"] == row["answer"] and answer["content"] == f"Answer: {row['answer']}"
    assert "<e> =" in bad_calls and len(bad_calls) > 3  # several kinds of mistakes


def test_error_fraction_is_respected_and_seeded():
    rows = make_arithmetic_tasks(200, 5, "medium")
    first = make_tool_traces(rows, CalculatorEnv, error_fraction=0.25, seed=7)
    again = make_tool_traces(rows, CalculatorEnv, error_fraction=0.25, seed=7)
    assert first == again
    assert sum(t["faulty"] for t in first) == 50
    assert sum(t["faulty"] for t in make_tool_traces(rows[:16], CalculatorEnv, error_fraction=0.25)) == 4


def test_python_tool_traces():
    rows = make_arithmetic_tasks(3, 0, "easy")

    class FakePython:
        def reset(self, **row):
            pass

        def python(self, code: str) -> str:
            """Run Python code.

            Args:
                code: The code.
            """
            return str(eval(code.removeprefix("print(").removesuffix(")"))) + "\n"

    traces = make_tool_traces(
        rows, FakePython, tool_name="python", argument="code", argument_template="print({expression})"
    )
    call, result, answer = traces[0]["turns"]
    assert call["tool_calls"][0]["function"]["arguments"] == {"code": f"print({rows[0]['expression']})"}
    assert answer["content"] == f"Answer: {rows[0]['answer']}"


class _Replay:
    """Scripted generation that replays the assistant turns of a trace (the same tokens tokenize_trace uses)."""

    def __init__(self, tok, turns):
        self.tok, self.turns = tok, turns

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            k = self.tok.decode(ids).count("<tool_response>")
            out.append(self.turns[k])
        return [list(t) for t in out], None


RUN_SETTINGS = {
    "plain": {},
    # The GRPO run's tools (`delete_context` first, as the trainer lists it), template arguments (Qwen3's empty think
    # block in the generation prompt) and tool-result cut: the warm start used none of them.
    "snapshots_no_thinking_cut": {
        "enable_context_snapshots": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tool_output_chars": 64,
    },
}


@pytest.mark.parametrize("settings", list(RUN_SETTINGS))
@pytest.mark.parametrize("faulty", [False, True])
def test_trace_tokens_equal_the_rollout_of_the_same_turns(tiny_model_dir, tiny_tokenizer, tmp_path, faulty, settings):
    """A trace replayed by the trainer's real rollout loop gives the same prompt, completion and mask."""
    from trl_agentic.warmstart import warmstart_examples

    run = RUN_SETTINGS[settings]
    rows = make_arithmetic_tasks(1, 9, "medium")
    traces, examples, renderer = warmstart_examples(
        tiny_tokenizer, rows, environment_factory=CalculatorEnv, error_fraction=float(faulty), seed=1,
        context_snapshots=run.get("enable_context_snapshots", False),
        template_kwargs=run.get("chat_template_kwargs"), max_tool_output_chars=run.get("max_tool_output_chars"),
    )  # fmt: skip
    trace, example = traces[0], examples[0]
    tools = trace["tools"]
    assert [t.__name__ for t in tools] == ["delete_context", "calculate"] * bool(run) + ["calculate"] * (not run)
    prompt_len = len(renderer.prompt_ids(trace["prompt"], tools))
    if run and faulty:  # the error message is cut as the loop cuts it
        assert "...[truncated" in tiny_tokenizer.decode(example["input_ids"][prompt_len:])
    ids, labels = example["input_ids"], example["labels"]
    # Split the trained (assistant) tokens back into turns.
    turns, current = [], []
    for tok, label in zip(ids[prompt_len:], labels[prompt_len:]):
        if label != -100:
            current.append(tok)
        elif current:
            turns.append(current)
            current = []
    turns.append(current)

    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4096,
        save_strategy="no",
        max_tool_calling_iterations=5,
        **run,
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=answer_reward,
        args=args,
        train_dataset=Dataset.from_list(rows * 2),
        environment_factory=CalculatorEnv,
    )
    assert trainer.chat_template == renderer.chat_template
    trainer._generate_single_turn = _Replay(tiny_tokenizer, turns)
    seen = []
    original = trainer._augmenter

    def capture(output, inputs, rewards_per_func, loop_result):
        seen.append(output)
        return original(output, inputs, rewards_per_func, loop_result)

    trainer._augmenter = capture
    trainer.train()
    batch = seen[0]
    prompt = batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist()
    completion = batch["completion_ids"][0][batch["completion_mask"][0].bool()].tolist()
    mask = batch["tool_mask"][0][batch["completion_mask"][0].bool()].tolist()
    assert prompt == ids[:prompt_len]
    assert completion == ids[prompt_len:]
    assert mask == [int(label != -100) for label in labels[prompt_len:]]
    assert trainer.state.log_history[0]["rewards/answer_reward/mean"] == 1.0


def test_run_warmstart_trains_a_lora_adapter(tiny_model_dir, tiny_tokenizer, tmp_path):
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows = make_arithmetic_tasks(8, 2, "medium")
    result = run_warmstart(
        model,
        tiny_tokenizer,
        rows,
        environment_factory=CalculatorEnv,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        output_dir=str(tmp_path),
        max_steps=2,
        batch_size=4,
        learning_rate=1e-2,
        error_fraction=0.5,
    )
    assert isinstance(result.model, PeftModel)
    assert result.num_traces == 8 and 0 < result.faulty_traces < 8
    losses = [e["loss"] for e in result.log_history if "loss" in e]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    lora_b = [p for n, p in result.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # LoRA B starts at zero: it was trained
    assert result.sample_trace.startswith("<tool_call>\n") and result.sample_trace.endswith("<|im_end|>")


@pytest.mark.parametrize("bf16", [False, True])
def test_run_warmstart_trains_in_the_precision_it_is_given(tiny_model_dir, tiny_tokenizer, tmp_path, bf16):
    # `trl-agentic train` passes the GRPO stage's `bf16` to the warm start (it used to be float32 whatever the config).
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback

    seen = []

    class Spy(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(args.bf16)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    run_warmstart(
        model,
        tiny_tokenizer,
        make_arithmetic_tasks(2, 2, "medium"),
        environment_factory=CalculatorEnv,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        output_dir=str(tmp_path),
        max_steps=1,
        batch_size=2,
        bf16=bf16,
        callbacks=[Spy()],
    )
    assert seen == [bf16]
