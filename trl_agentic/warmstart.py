"""Warm start: a short SFT stage on synthetic tool-use traces, before GRPO.

A small instruct model that has never seen the tool-call format gets zero reward on every rollout, so GRPO has no
signal (every group has zero reward variance). The warm start shows it the format on a few hundred generated traces
of the task, then GRPO continues training the same LoRA adapter with the tool.

A trace is the conversation the rollout loop would produce, token for token:

```
<prompt: system + tools + user question><|im_start|>assistant\\n
<tool_call>\\n{"name": "calculate", "arguments": {"expression": "64 * 16 - 275"}}\\n</tool_call><|im_end|>   (trained)
\\n<|im_start|>user\\n<tool_response>\\n749\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n            (masked)
Answer: 749<|im_end|>                                                                                      (trained)
```

The prompt is rendered with the chat template GRPO uses, the tool results are produced by running the task's real
environment on the call (errors formatted exactly as the rollout loop shows them) and appended with the same suffix
construction as TRL's `_get_tool_suffix_ids`; only the model's own tokens carry labels. The traces are imperfect on
purpose: a fraction `error_fraction` of them first make a call the calculator rejects (`47 x 523`, a trailing `=`,
implicit multiplication `47(523)`), see the error and then make the correct call. A warm-started policy therefore
still makes malformed calls now and then, which gives rollback and negative samples something to fix during GRPO.

Training is TRL's `SFTTrainer` with the LoRA config of the run, on the pre-tokenized traces (`input_ids` + `labels`).
"""

from __future__ import annotations

import copy
import json
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .envs.protocol import tool_methods, with_observation
from .rollout.rendering import ChatRenderer
from .rollout.tools import ErrorPolicy, run_tool_call


def tool_call_text(name: str, arguments: dict) -> str:
    """An assistant tool-call turn as Qwen3/Hermes templates write it (what TRL's response parser reads back)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _mistakes(expression: str) -> list[str]:
    """Plausible malformed versions of an arithmetic expression that the calculator rejects."""
    out = []
    if "*" in expression:
        out.append(expression.replace(" * ", " x ", 1))  # the multiplication sign of school maths
        out.append(re.sub(r"(\d+) \* (\d+)", r"\1(\2)", expression, count=1))  # implicit multiplication
    out.append(expression + " =")
    return out


def make_tool_traces(
    rows: Sequence[dict],
    environment_factory: Callable,
    *,
    error_fraction: float = 0.0,
    seed: int = 0,
    tool_name: str = "calculate",
    argument: str = "expression",
    argument_template: str = "{expression}",
    answer_template: str = "Answer: {result}",
    max_tool_output_chars: int | None = None,
) -> list[dict]:
    """
    Build synthetic tool-use conversations for arithmetic rows (with an `expression` and an `answer` column).

    Args:
        rows (`Sequence[dict]`):
            Task rows: a conversational `prompt`, the ground-truth `expression` and `answer`.
        environment_factory (`Callable`):
            Builds the task's environment; its tool is really called so every tool message is exact.
        error_fraction (`float`, *optional*, defaults to `0.0`):
            Fraction of traces (rounded to a whole number of traces, chosen at random) that first make a malformed
            call, get the tool's error and then make the right call.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the choice of faulty traces and mistakes.
        tool_name (`str`, *optional*, defaults to `"calculate"`):
            Name of the tool to call.
        argument (`str`, *optional*, defaults to `"expression"`):
            Name of the tool's argument that receives the expression.
        argument_template (`str`, *optional*, defaults to `"{expression}"`):
            Value of that argument; e.g. `"print({expression})"` for a Python tool.
        answer_template (`str`, *optional*, defaults to `"Answer: {result}"`):
            Final assistant message; `{result}` is the tool's result.
        max_tool_output_chars (`int`, *optional*):
            Tool results cut as the rollout loop cuts them (its `max_tool_output_chars`); None: no limit.

    Returns:
        `list[dict]`: One dict per row: `prompt` (the row's messages), `turns` (assistant and tool messages, in order),
        `faulty` (whether the trace contains a rejected call).
    """
    rng = random.Random(seed)
    # An exact share of faulty traces (not a coin flip per trace): small warm starts get the fraction asked for.
    faulty_rows = set(rng.sample(range(len(rows)), round(error_fraction * len(rows))))
    traces = []
    for index, row in enumerate(rows):
        env = environment_factory()
        prompt = with_observation(copy.deepcopy(list(row["prompt"])), env.reset(**row))  # as TRL's rollouts see it
        tools = tool_methods(env)
        if tool_name not in tools:
            raise ValueError(f"The environment has no tool {tool_name!r} (tools: {sorted(tools)}).")

        def call(expression: str, tools=tools) -> tuple[dict, dict, bool]:
            value = argument_template.format(expression=expression)
            request = {"type": "function", "function": {"name": tool_name, "arguments": {argument: value}}}
            outcome = run_tool_call(
                request, tools, {}, timeout=0, max_chars=max_tool_output_chars, policy=ErrorPolicy([], [])
            )
            assistant = {"role": "assistant", "content": "", "tool_calls": [request]}
            return assistant, {"role": "tool", "name": tool_name, "content": outcome.content}, not outcome.failed

        turns: list[dict] = []
        faulty = index in faulty_rows
        if faulty:
            candidates = _mistakes(row["expression"])
            rng.shuffle(candidates)
            for bad in candidates:
                assistant, tool, ok = call(bad)
                if not ok:  # only mistakes the tool really rejects
                    turns += [assistant, tool]
                    break
            else:
                faulty = False
        assistant, tool, ok = call(row["expression"])
        if not ok:
            raise ValueError(f"The tool rejected the ground-truth expression {row['expression']!r}: {tool['content']}")
        turns += [
            assistant,
            tool,
            {"role": "assistant", "content": answer_template.format(result=tool["content"].strip())},
        ]
        traces.append({"prompt": prompt, "turns": turns, "faulty": faulty})
        close = getattr(env, "_close", None)  # e.g. the Python sandbox's interpreter process
        if callable(close):
            close()
    return traces


def _parameters(function) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def tokenize_trace(renderer: ChatRenderer, trace: dict, tools: Sequence[Callable]) -> dict:
    """
    Tokenize a trace exactly as the rollout loop lays out a multi-turn completion.

    Args:
        renderer ([`ChatRenderer`]):
            Renders prompts and tool-result suffixes with the chat template GRPO uses.
        trace (`dict`):
            A trace of [`make_tool_traces`] (or of a task's `make_traces`): `prompt` and `turns`, assistant and tool
            messages, and, in conversations with several user turns, user messages after an assistant message
            without tool calls (masked, like the loop's user-turn tokens).
        tools (`Sequence[Callable]`):
            The environment's tools (rendered into the system prompt).

    Returns:
        `dict`: `input_ids` and `labels` (`-100` on the prompt and on the tool results).
    """
    tokenizer = renderer.tokenizer
    input_ids = renderer.prompt_ids(trace["prompt"], tools=list(tools))
    labels = [-100] * len(input_ids)
    turns = trace["turns"]
    k = 0
    while k < len(turns):
        message = turns[k]
        if message["role"] == "user" and k > 0 and turns[k - 1]["role"] == "assistant":
            # A later user turn of a multi-turn conversation: environment tokens, masked.
            suffix = renderer.user_turn_ids(message["content"])
            input_ids += suffix
            labels += [-100] * len(suffix)
            k += 1
            continue
        if message["role"] != "assistant":
            raise ValueError(f"Expected an assistant turn at position {k}, got {message['role']!r}.")
        text = message.get("content") or ""
        for request in message.get("tool_calls") or []:
            function = request["function"]
            text += ("\n" if text else "") + tool_call_text(function["name"], function["arguments"])
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        input_ids += ids
        labels += ids
        k += 1
        tool_messages = []
        while k < len(turns) and turns[k]["role"] == "tool":
            tool_messages.append(turns[k])
            k += 1
        if tool_messages:
            suffix = renderer.tool_suffix_ids(tool_messages)
            input_ids += suffix
            labels += [-100] * len(suffix)
    return {"input_ids": input_ids, "labels": labels}


@dataclass
class WarmStartResult:
    """What [`run_warmstart`] returns.

    Attributes:
        model: The model with the trained LoRA adapter (a `PeftModel`), ready for GRPO.
        log_history: `trainer.state.log_history` of the SFT run.
        seconds: Wall time of the stage.
        num_traces: Number of traces built.
        faulty_traces: How many of them contain a rejected call.
        sample_trace: The decoded first trace (to show in logs and docs).
        completion_tokens: Per trace, its tokens after the prompt (model and tool tokens, what
            `max_completion_length` bounds in a rollout), and whether it contains a rejected call.
    """

    model: object
    log_history: list[dict]
    seconds: float
    num_traces: int
    faulty_traces: int
    sample_trace: str
    completion_tokens: list[tuple[int, bool]] = ()


def _completion_tokens(example: dict) -> int:
    """Tokens after the prompt: the prompt is masked, and the first trained token opens the completion."""
    first = next((k for k, label in enumerate(example["labels"]) if label != -100), len(example["labels"]))
    return len(example["input_ids"]) - first


def warmstart_examples(
    tokenizer,
    rows: Sequence[dict],
    *,
    environment_factory: Callable,
    error_fraction: float = 0.0,
    seed: int = 0,
    trace_options: dict | None = None,
    make_traces: Callable[[Sequence[dict]], list[dict]] | None = None,
    context_snapshots: bool = False,
    template_kwargs: dict | None = None,
    max_tool_output_chars: int | None = None,
) -> tuple[list[dict], list[dict], ChatRenderer]:
    """
    The traces of a warm start and their SFT examples, rendered as the GRPO run's rollouts (arguments as in
    [`run_warmstart`]).

    Returns:
        `(traces, examples, renderer)`: each trace with the `tools` its prompt lists, its `input_ids` / `labels`, and
        the renderer used.
    """
    if make_traces is not None:
        cut = {}
        if max_tool_output_chars is not None and "max_tool_output_chars" in _parameters(make_traces):
            cut = {"max_tool_output_chars": max_tool_output_chars}
        traces = make_traces(rows, **cut)
    else:
        options = {"max_tool_output_chars": max_tool_output_chars, **(trace_options or {})}
        traces = make_tool_traces(rows, environment_factory, error_fraction=error_fraction, seed=seed, **options)
    renderer = ChatRenderer(tokenizer, template_kwargs=template_kwargs)
    default_tools = None
    if any("tools" not in trace for trace in traces):
        default_tools = list(tool_methods(environment_factory()).values())

    def rendered_tools(tools):
        if not context_snapshots:
            return tools
        from .rollout.context import delete_context

        return [delete_context, *(t for t in tools or [] if getattr(t, "__name__", None) != delete_context.__name__)]

    traces = [{**trace, "tools": rendered_tools(trace.get("tools", default_tools))} for trace in traces]
    examples = [tokenize_trace(renderer, trace, trace["tools"]) for trace in traces]
    return traces, examples, renderer


def run_warmstart(
    model,
    tokenizer,
    rows: Sequence[dict],
    *,
    environment_factory: Callable,
    peft_config,
    output_dir: str,
    max_steps: int = 40,
    batch_size: int = 8,
    micro_batch_size: int = 2,
    learning_rate: float = 2e-4,
    error_fraction: float = 0.0,
    seed: int = 0,
    use_cpu: bool = True,
    bf16: bool = False,
    callbacks: list | None = None,
    trace_options: dict | None = None,
    compact_progress: bool = True,
    make_traces: Callable[[Sequence[dict]], list[dict]] | None = None,
    gradient_checkpointing: bool = False,
    lr_scheduler_type: str = "linear",
    context_snapshots: bool = False,
    template_kwargs: dict | None = None,
    max_tool_output_chars: int | None = None,
) -> WarmStartResult:
    """
    Train a LoRA adapter with TRL's `SFTTrainer` on synthetic tool-use traces of the task.

    Args:
        model (`str` or `PreTrainedModel`):
            Model path or instance (e.g. the resolved embedded SmolLM2 folder).
        tokenizer:
            Its tokenizer (tool-calling chat template).
        rows (`Sequence[dict]`):
            Task rows the traces are made from (use problems other than the held-out evaluation ones).
        environment_factory (`Callable`):
            The task's environment (its tool produces the tool messages).
        peft_config (`peft.PeftConfig`):
            LoRA config; GRPO later continues training this adapter.
        output_dir (`str`):
            Directory of the SFT trainer (nothing is saved there unless asked for).
        max_steps (`int`, *optional*, defaults to `40`):
            Optimizer steps.
        batch_size (`int`, *optional*, defaults to `8`):
            Traces per optimizer step.
        micro_batch_size (`int`, *optional*, defaults to `2`):
            Traces per forward/backward pass (gradient accumulation makes up `batch_size`). On CPU in float32 a
            ~400-token trace of a 135M model takes ~1.3 GB of activations, so small micro-batches bound the memory at
            no cost in speed.
        learning_rate (`float`, *optional*, defaults to `2e-4`):
            Peak learning rate (linear decay, no warm-up).
        error_fraction (`float`, *optional*, defaults to `0.0`):
            See [`make_tool_traces`].
        seed (`int`, *optional*, defaults to `0`):
            Seed of the traces and of the trainer.
        use_cpu (`bool`, *optional*, defaults to `True`):
            Train on CPU.
        bf16 (`bool`, *optional*, defaults to `False`):
            bfloat16 mixed precision (autocast), as `bf16` of the GRPO stage. On a CPU with AVX512-BF16 it halves the
            step time of SmolLM2-135M (fp32 19.5 s vs bf16 9.5 s for 2 x 1400 tokens, measured here).
        callbacks (`list`, *optional*):
            Extra `TrainerCallback`s.
        trace_options (`dict`, *optional*):
            Extra keyword arguments of [`make_tool_traces`] (tool name, argument, templates).
        compact_progress (`bool`, *optional*, defaults to `True`):
            Show one compact line per step (loss, token accuracy, s/step) under the progress bar.
        make_traces (`Callable`, *optional*):
            `make_traces(rows) -> traces` instead of [`make_tool_traces`] (e.g. a task's ground-truth
            conversations); a trace may carry its own `tools` (the environment's tool methods), else those of
            `environment_factory()` are rendered.
        gradient_checkpointing (`bool`, *optional*, defaults to `False`):
            Recompute activations in the backward pass: needed for traces of several thousand tokens (e.g. BFCL's,
            whose tool schemas alone are 2-5k tokens), whose attention activations otherwise exhaust the memory.
        lr_scheduler_type (`str`, *optional*, defaults to `"linear"`):
            Learning-rate schedule over `max_steps` (`"constant"` for a run stopped by time rather than steps).
        context_snapshots (`bool`, *optional*, defaults to `False`):
            The GRPO run's `enable_context_snapshots`: `delete_context` leads every prompt's tool list, as the trainer
            renders it (TRL's `tools + environment methods`), so that the warm start trains under the GRPO prompts.
        template_kwargs (`dict`, *optional*):
            The GRPO run's `chat_template_kwargs` (e.g. `enable_thinking`), used to render the traces as the rollouts.
        max_tool_output_chars (`int`, *optional*):
            The GRPO run's `max_tool_output_chars`: tool results are cut as the rollout loop cuts them (the built-in
            traces, and a task's `make_traces` that takes this argument).

    Returns:
        [`WarmStartResult`].
    """
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    micro_batch_size = min(micro_batch_size, batch_size)
    if batch_size % micro_batch_size:
        raise ValueError(f"`batch_size` ({batch_size}) must be a multiple of `micro_batch_size` ({micro_batch_size}).")
    start = time.perf_counter()
    traces, examples, renderer = warmstart_examples(
        tokenizer,
        rows,
        environment_factory=environment_factory,
        error_fraction=error_fraction,
        seed=seed,
        trace_options=trace_options,
        make_traces=make_traces,
        context_snapshots=context_snapshots,
        template_kwargs=template_kwargs,
        max_tool_output_chars=max_tool_output_chars,
    )
    dataset = Dataset.from_list(examples)
    args = SFTConfig(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=micro_batch_size,
        gradient_accumulation_steps=batch_size // micro_batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type=lr_scheduler_type,
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=use_cpu,
        bf16=bf16,
        seed=seed,
        max_length=None,
        gradient_checkpointing=gradient_checkpointing,
        # The traces are short and of similar length: padding wastes little, packing would mix problems.
        packing=False,
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    if compact_progress:
        from .reporting import install_compact_progress

        install_compact_progress(trainer)
    trainer.train()
    first_tools = traces[0]["tools"]
    sample = tokenizer.decode(examples[0]["input_ids"][len(renderer.prompt_ids(traces[0]["prompt"], first_tools)) :])
    trained = _leave_deepspeed(trainer, output_dir) if trainer.is_deepspeed_enabled else trainer.model
    return WarmStartResult(
        model=trained,
        log_history=list(trainer.state.log_history),
        seconds=time.perf_counter() - start,
        num_traces=len(traces),
        faulty_traces=sum(t.get("faulty", False) for t in traces),
        completion_tokens=[(_completion_tokens(e), bool(t.get("faulty", False))) for e, t in zip(examples, traces)],
        sample_trace=sample,
    )


def run_task_warmstart(
    model,
    tokenizer,
    task,
    task_args,
    *,
    peft_config,
    output_dir: str,
    seed: int = 0,
    use_cpu: bool = True,
    bf16: bool = False,
    rows: Sequence[dict] | None = None,
    environment_factory: Callable | None = None,
    **kwargs,
) -> WarmStartResult:
    """
    [`run_warmstart`] with the warm-start settings of `TaskArguments` and the traces' rows, environment and tool
    options of a `trl_agentic.tasks.Task` (what `trl-agentic train` and the examples run as stage 1).

    Args:
        model, tokenizer: As in [`run_warmstart`].
        task (`Task`): Gives `warmstart_dataset`, `environment_factory` and `warmstart_options`.
        task_args (`TaskArguments`): Gives `warmstart_steps`, `warmstart_batch_size`, `warmstart_learning_rate` and
            `warmstart_error_fraction`.
        peft_config, output_dir, seed, use_cpu, bf16: As in [`run_warmstart`].
        rows (`Sequence[dict]`, *optional*): Rows to build the traces from instead of `task.warmstart_dataset`.
        environment_factory (`Callable`, *optional*): Instead of `task.environment_factory`.
        **kwargs: Other keyword arguments of [`run_warmstart`] (`callbacks`, `compact_progress`).

    Returns:
        [`WarmStartResult`].
    """
    return run_warmstart(
        model,
        tokenizer,
        list(task.warmstart_dataset if rows is None else rows),
        environment_factory=environment_factory or task.environment_factory,
        peft_config=peft_config,
        output_dir=output_dir,
        max_steps=task_args.warmstart_steps,
        batch_size=task_args.warmstart_batch_size,
        learning_rate=task_args.warmstart_learning_rate,
        error_fraction=task_args.warmstart_error_fraction,
        seed=seed,
        use_cpu=use_cpu,
        bf16=bf16,
        trace_options=task.warmstart_options,
        make_traces=getattr(task, "make_traces", None),
        **{**(getattr(task, "warmstart_trainer_options", None) or {}), **kwargs},
    )


def save_merged(model, tokenizer, folder: str) -> str:
    """
    Saves a warm-started policy as a plain model folder, its LoRA adapter merged into the weights: what a vLLM server
    serves and what the asynchronous trainer loads (it takes its model as a folder and adds its own adapter).

    Args:
        model: [`WarmStartResult.model`] (a `PeftModel`, merged in place: do not train it further) or a full model.
        tokenizer: Saved beside it (with its chat template).
        folder (`str`): Where to write.

    Returns:
        `str`: `folder`.
    """
    merged = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
    merged.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _leave_deepspeed(trainer, output_dir: str):
    """The warm-start policy as a plain `PeftModel`, and accelerate's state freed for the GRPO trainer.

    Under `accelerate launch` with a DeepSpeed config, the SFT trainer's engine owns the model (its parameters are
    partitioned under ZeRO-3) and accelerate allows one DeepSpeed plugin per process state, so building the GRPO
    trainer next raises "You cannot pass in a `deepspeed_plugin` when creating a second `Accelerator`". So the adapter
    is saved (gathered under ZeRO-3), loaded back onto a fresh copy of the base model, and the accelerator state (not
    the process group) is reset; the GRPO trainer then builds its own engine from the same launch config.
    """
    import gc
    import os

    from accelerate.state import AcceleratorState, GradientState
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = os.path.join(output_dir, "adapter")
    trainer.save_model(path)
    trainer.accelerator.wait_for_everyone()
    peft_model = trainer.model
    base_path = peft_model.peft_config[peft_model.active_adapter].base_model_name_or_path
    dtype = peft_model.get_base_model().dtype
    del trainer, peft_model
    gc.collect()
    AcceleratorState._reset_state()  # keeps PartialState: the process group and ranks stay as they are
    GradientState._reset_state()
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    return PeftModel.from_pretrained(base, path, is_trainable=True)
