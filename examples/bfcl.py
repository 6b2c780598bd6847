# Copyright the trl-agentic authors. Licensed under the Apache License, Version 2.0.
"""
BFCL v4 multi-turn with GRPO: the embedded SmolLM2-135M-Instruct and LoRA on the Berkeley Function Calling
Leaderboard's multi-turn tasks, scored by the official checker, with rollback of failed API calls and negative samples.
Runs offline on CPU (the tasks, the API classes and the checker come from the `bfcl-eval` package).

Each task is a conversation with several user requests against stateful APIs (a trading bot, a car, a file system,
...). The environment (`trl_agentic.envs.bfcl`) instantiates the task's APIs from its initial state, exposes their
functions as tools with the official schemas (one environment class per tool group: TRL's multi-environment mode),
sends the next user request when the assistant ends its turn, and the official checker compares the API states and
results with the ground truth's at the end. With `warmstart_steps > 0` a short SFT on the ground-truth conversations
of the training tasks comes first. Held-out scenarios are evaluated before and after GRPO, per category. See
docs/bfcl.md.

Usage:

```bash
python examples/bfcl.py --config configs/bfcl.yaml
python examples/bfcl.py --config configs/bfcl.yaml --max_steps 1 --num_eval_tasks 4
```
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is embedded: never touch the Hub

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer  # noqa: E402
from trl_agentic.envs.bfcl.evaluate import evaluate_bfcl, format_results  # noqa: E402
from trl_agentic.models import resolve_model_path  # noqa: E402
from trl_agentic.reporting import format_metric_table, install_compact_progress  # noqa: E402
from trl_agentic.tasks import TaskArguments, build_task  # noqa: E402
from trl_agentic.warmstart import run_task_warmstart  # noqa: E402

METRICS = (
    "rewards/bfcl_reward/mean",
    "rewards/bfcl_turn_credit/mean",
    "tools/call_frequency",
    "tools/failure_frequency",
    "rollback/attempts",
    "rollback/recovered_ratio",
    "negatives/saved",
)


def make_parser() -> TrlParser:
    return TrlParser((TaskArguments, AgenticGRPOConfig, ModelConfig))


def held_out(policy, tokenizer, task, task_args, training_args, stage: str) -> dict:
    """BFCL accuracy per category of the held-out tasks, with the official checker."""
    results = evaluate_bfcl(
        policy,
        tokenizer,
        list(task.eval_dataset),
        hide_excluded=task_args.bfcl_hide_excluded,
        max_completion_length=training_args.max_completion_length,
        max_turn_tokens=min(256, training_args.max_completion_length),
        max_tool_calling_iterations=training_args.max_tool_calling_iterations or 24,
        batch_size=task_args.heldout_eval_batch_size,
        temperature=task_args.heldout_eval_temperature,
        seed=training_args.seed,
        desc=f"held-out {stage}",
    )
    print(f"\nHeld-out BFCL accuracy {stage}:\n{format_results(results)}", flush=True)
    return results


def main(argv: list[str] | None = None) -> AgenticGRPOTrainer:
    task_args, training_args, model_args = make_parser().parse_args_and_config(args=argv)
    if task_args.task != "bfcl":
        raise SystemExit("This example is about BFCL: set `task: bfcl`.")
    task = build_task(task_args)  # training / held-out scenarios, one environment class per tool group
    model_path = resolve_model_path(model_args.model_name_or_path or "smollm2-135m")  # converted once, cached
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", truncation_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=model_args.dtype)
    peft_config = get_peft_config(model_args)
    if task_args.warmstart_steps:
        # Stage 1: SFT on the ground-truth conversations of the training tasks (never the held-out scenarios); GRPO
        # then continues this LoRA adapter.
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
            compact_progress=not training_args.disable_tqdm,
        )
        losses = [h["loss"] for h in warm.log_history if "loss" in h]
        print(
            f"Warm start: {warm.num_traces} traces, loss {losses[0]:.3f} -> {losses[-1]:.3f} in {warm.seconds:.0f} s."
        )
        model, peft_config = warm.model, None
        # Kept, so that a run cut off later (GRPO on CPU is slow) can be evaluated or continued from the warm start.
        model.save_pretrained(os.path.join(training_args.output_dir, "warmstart-adapter"))
    trainer = AgenticGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=task.reward_funcs,
        args=training_args,
        train_dataset=task.train_dataset,
        environment_factory=task.environment_factory,
        peft_config=peft_config,
    )
    install_compact_progress(trainer)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    results = {}
    path = os.path.join(training_args.output_dir, "bfcl_eval.json")

    def save_results():  # after each evaluation: a run cut off during GRPO keeps the numbers before it
        if results and trainer.accelerator.is_main_process:
            os.makedirs(training_args.output_dir, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=2)
            print(f"wrote {path}")

    if task_args.heldout_eval and task.eval_dataset is not None:
        results["before"] = held_out(policy, trainer.processing_class, task, task_args, training_args, "before GRPO")
        save_results()
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if task_args.heldout_eval and task.eval_dataset is not None:
        results["after"] = held_out(policy, trainer.processing_class, task, task_args, training_args, "after GRPO")
        save_results()
    if trainer.accelerator.is_main_process:
        print("\n" + format_metric_table(trainer.state.log_history, METRICS))
    return trainer


if __name__ == "__main__":
    main()
