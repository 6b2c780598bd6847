# Copyright the trl-agentic authors. Licensed under the Apache License, Version 2.0.
"""
Context snapshots: GRPO where the model can delete earlier messages from its own context with the built-in
`delete_context` tool, on arithmetic word problems with a calculator tool, with the embedded SmolLM2-135M-Instruct and
LoRA. Runs offline on CPU.

With `enable_context_snapshots` the trainer adds `delete_context(message_ids)` to the tools. Every successful call
closes the trajectory so far as a training row (a *snapshot*), replaces the deleted messages by `context_stub_text`,
re-renders the shorter conversation as a new prompt and continues the rollout from there: one rollout becomes one or
more training rows, each trained under the context its tokens were sampled in (at most `max_snapshots_per_episode`
closed segments are kept). See docs/snapshots.md.

What the model is asked to delete here: a failed tool call and its error message, once a later call has succeeded
(rollback is off, so failed calls stay in the context). The system prompt describes `delete_context` with an example
call. The warm start (`trl_agentic.warmstart.run_task_warmstart`, as in `trl-agentic train`) teaches the tool-call format
on synthetic traces, a fraction of them with a rejected call first, under the same prompts as GRPO (the hint, and the
`delete_context` schema next to the task's tool): warm-started on the task's plain prompts, the model mostly stops
calling any tool once the hint and the second tool are in its prompt.

Be aware: the small base model rarely calls `delete_context` (it is not in the warm-start traces and nothing rewards
it; the warm-start traces never delete), so most steps of a short run log `snapshots/rows = 0`: the example shows the
set-up, the metrics and the cost. A reward for deleting (`snapshot_reward_func`) or warm-start traces that delete
would make it more frequent.
`--task textworld --warmstart_steps 0` runs the household text world instead (longer episodes of `act` calls, where
deleting old observations is the natural use), but without a warm start (that task has none) the base model almost
never writes a tool call at all: none of 12 samples of a first turn called `act` in a probe.

Usage:

```bash
python examples/context_snapshots.py --config configs/context_snapshots.yaml
python examples/context_snapshots.py --config configs/context_snapshots.yaml --max_steps 1
python examples/context_snapshots.py --config configs/context_snapshots.yaml --snapshot_advantage row
```
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is embedded: never touch the Hub

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer  # noqa: E402
from trl_agentic.models import resolve_model_path  # noqa: E402
from trl_agentic.reporting import format_metric_table, install_compact_progress  # noqa: E402
from trl_agentic.tasks import TaskArguments, build_task  # noqa: E402
from trl_agentic.warmstart import run_task_warmstart  # noqa: E402

# Appended to the system message of every GRPO prompt. Messages are numbered as `delete_context` counts them: 0 is the
# system message, 1 the question, then the assistant's tool calls and the tool results alternate.
DELETE_CONTEXT_HINT = """

You can remove messages you no longer need from your context with the `delete_context` tool. Messages are numbered \
from 0 (this system message) and 1 (the question); each of your tool calls and each tool result is a message too. \
When a tool call failed and a later call succeeded, delete the failed call and its error before you answer. For \
example, if your call (message 2) failed (message 3) and your next call (message 4) succeeded (message 5), call:
<tool_call>
{"name": "delete_context", "arguments": {"message_ids": [2, 3]}}
</tool_call>"""

TEXTWORLD_HINT = """

You can remove old observations from your context with the `delete_context` tool. Messages are numbered from 0 (this \
system message) and 1 (the first observation); each of your actions and each observation is a message too. For \
example, after your second action, delete your first action and its observation:
<tool_call>
{"name": "delete_context", "arguments": {"message_ids": [2, 3]}}
</tool_call>"""

SNAPSHOT_METRICS = (
    "tools/call_frequency",
    "tools/failure_frequency",
    "snapshots/rows",
    "snapshots/per_episode_mean",
    "context/tokens_freed",
    "groups/size_mean",
    "groups/size_max",
)


def make_parser() -> TrlParser:
    return TrlParser((TaskArguments, AgenticGRPOConfig, ModelConfig))


def with_hint(row: dict, hint: str) -> dict:
    prompt = [dict(message) for message in row["prompt"]]
    if prompt[0]["role"] == "system":
        prompt[0]["content"] += hint
    else:
        prompt.insert(0, {"role": "system", "content": hint.strip()})
    return {"prompt": prompt}


def main(argv: list[str] | None = None) -> AgenticGRPOTrainer:
    task_args, training_args, model_args = make_parser().parse_args_and_config(args=argv)
    if not training_args.enable_context_snapshots:
        raise SystemExit("This example is about context snapshots: set `enable_context_snapshots: true`.")
    task = build_task(task_args)
    hint = TEXTWORLD_HINT if task_args.task == "textworld" else DELETE_CONTEXT_HINT
    train_dataset = task.train_dataset.map(with_hint, fn_kwargs={"hint": hint})

    model_path = resolve_model_path(model_args.model_name_or_path or "smollm2-135m")  # converted once, cached
    peft_config = get_peft_config(model_args)
    model, tokenizer = model_path, None
    if task_args.warmstart_steps:
        # SFT on synthetic traces of the task (none of them deletes anything); GRPO continues this LoRA adapter.
        tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", truncation_side="left")
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=model_args.dtype)
        warm = run_task_warmstart(
            model,
            tokenizer,
            task,
            task_args,
            rows=task.warmstart_dataset.map(with_hint, fn_kwargs={"hint": hint}),  # the GRPO prompts' system message
            context_snapshots=True,  # and their tools: `delete_context` first, as the trainer lists it
            template_kwargs=training_args.chat_template_kwargs,
            max_tool_output_chars=training_args.max_tool_output_chars,
            peft_config=peft_config,
            output_dir=os.path.join(training_args.output_dir, "warmstart"),
            seed=training_args.seed,
            use_cpu=training_args.use_cpu,
            bf16=training_args.bf16,
        )
        print(f"Warm start: {warm.num_traces} traces ({warm.faulty_traces} with a rejected call first).")
        model, peft_config = warm.model, None
        training_args.model_init_kwargs = None
    else:
        training_args.model_init_kwargs = {"dtype": model_args.dtype, **(training_args.model_init_kwargs or {})}

    # The trainer adds `delete_context` to the tools: the prompts render its schema next to the task's tool.
    trainer = AgenticGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=task.reward_funcs,  # textworld: [] (the environment's `get_reward` is used)
        args=training_args,
        train_dataset=train_dataset,
        environment_factory=task.environment_factory,
        tools=task.tools or None,
        peft_config=peft_config,
    )
    install_compact_progress(trainer)
    trainer.train()
    trainer.save_model(training_args.output_dir)

    if trainer.accelerator.is_main_process:
        print("\n" + format_metric_table(trainer.state.log_history, SNAPSHOT_METRICS))
    return trainer


if __name__ == "__main__":
    main()
