# Copyright the trl-agentic authors. Licensed under the Apache License, Version 2.0.
"""
Tool rollback with negative samples: GRPO with a sandboxed Python interpreter as the tool, on arithmetic word problems,
with the embedded SmolLM2-135M-Instruct and LoRA. Runs offline on CPU.

When a `python` call fails with an error listed in `rollback_on_errors` (a `SyntaxError`, a `NameError`, ...), the
sandbox is restored to its state before the call, the trajectory is cut back to the start of the failed turn and only
that turn is generated again (at most `max_tool_retries` times per turn). With `save_negative_samples` the failed
trajectory is kept first, as an extra row of the same GRPO group with reward `negative_sample_reward` (at most
`max_negative_samples_per_group` per group). Sandbox failures (timeouts, crashes) are retried without a negative
sample. See docs/rollback.md.

The base model has never seen the tool-call format, so with `warmstart_steps > 0` a short SFT stage on synthetic
traces of the task comes first (`trl_agentic.warmstart.run_task_warmstart`, the warm start of `trl-agentic train`), a
fraction of them (`warmstart_error_fraction`) with a rejected call before the right one; GRPO then continues training
the same LoRA adapter. `trl-agentic train --config configs/tool_rollback.yaml` runs the same pipeline.

Usage:

```bash
python examples/tool_rollback.py --config configs/tool_rollback.yaml
python examples/tool_rollback.py --config configs/tool_rollback.yaml --max_steps 1
python examples/tool_rollback.py --config configs/tool_rollback.yaml --rollback_feedback none --warmstart_steps 0
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

# Logged once per step by the trainer (docs/rollback.md, "Metrics"); summed over the processes.
ROLLBACK_METRICS = (
    "tools/call_frequency",
    "tools/failure_frequency",
    "rollback/attempts",
    "rollback/recovered_ratio",
    "rollback/exhausted",
    "rollback/regenerated_tokens_per_failed_token",
    "negatives/saved",
    "negatives/rows",
    "negatives/mean_advantage",
    "infra/retries",
    "groups/size_mean",
)


def make_parser() -> TrlParser:
    return TrlParser((TaskArguments, AgenticGRPOConfig, ModelConfig))


def main(argv: list[str] | None = None) -> AgenticGRPOTrainer:
    task_args, training_args, model_args = make_parser().parse_args_and_config(args=argv)
    if not training_args.enable_tool_rollback:
        raise SystemExit("This example is about tool rollback: set `enable_tool_rollback: true`.")
    task = build_task(task_args)  # problems, PythonSandboxEnv (with `sandbox_timeout`), answer_reward
    model_path = resolve_model_path(model_args.model_name_or_path or "smollm2-135m")  # converted once, cached
    peft_config = get_peft_config(model_args)
    model, tokenizer = model_path, None
    if task_args.warmstart_steps:
        # Stage 1: SFT on synthetic tool-use traces. GRPO below continues this LoRA adapter (a PeftModel, so no
        # peft_config and no model_init_kwargs for the trainer).
        tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", truncation_side="left")
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=model_args.dtype)
        # The task's traces call the `python` tool with `print(<expression>)`; steps, batch, lr from `task_args`.
        warm = run_task_warmstart(
            model,
            tokenizer,
            task,
            task_args,
            peft_config=peft_config,
            output_dir=os.path.join(training_args.output_dir, "warmstart"),
            seed=training_args.seed,
            use_cpu=training_args.use_cpu,
            bf16=training_args.bf16,
        )
        print(
            f"Warm start: {warm.num_traces} traces ({warm.faulty_traces} with a rejected call first) in "
            f"{warm.seconds:.0f} s. First trace:\n{warm.sample_trace}"
        )
        model, peft_config = warm.model, None
        training_args.model_init_kwargs = None
    else:
        training_args.model_init_kwargs = {"dtype": model_args.dtype, **(training_args.model_init_kwargs or {})}

    # Stage 2: GRPO with the sandbox tool, rollback and negative samples (all switched on in `training_args`).
    trainer = AgenticGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=task.reward_funcs,
        args=training_args,
        train_dataset=task.train_dataset,
        environment_factory=task.environment_factory,
        tools=task.tools or None,
        peft_config=peft_config,
    )
    install_compact_progress(trainer)  # one line per step: reward, tool failures, rollbacks, negatives, s/step
    trainer.train()
    trainer.save_model(training_args.output_dir)

    if trainer.accelerator.is_main_process:
        print("\n" + format_metric_table(trainer.state.log_history, ROLLBACK_METRICS))
    return trainer


if __name__ == "__main__":
    main()
