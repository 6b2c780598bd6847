# Copyright the trl-agentic authors. Licensed under the Apache License, Version 2.0.
"""
The quickstart in Python: SmolLM2-135M-Instruct (embedded, offline) + LoRA learns to use a calculator tool on
arithmetic word problems. The same pipeline as `make demo` (`trl-agentic train --config configs/quickstart.yaml`),
written out stage by stage with the library's API:

1. warm start: TRL's `SFTTrainer` on synthetic traces in the exact tool-call format (`trl_agentic.warmstart`);
2. held-out evaluation with the multi-turn tool loop (`trl_agentic.evaluation`);
3. GRPO with the tool, rollback and negative samples (`AgenticGRPOTrainer`), continuing the warm-start adapter;
4. held-out evaluation again;
5. outputs: the LoRA adapter, `eval_results.json`, `curves.png`, `report.html`, `trajectories.jsonl`.

Usage:

```bash
python examples/quickstart.py --config configs/quickstart.yaml
python examples/quickstart.py --config configs/quickstart.yaml --max_steps 4 --num_eval_tasks 16
```
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is embedded: never touch the Hub

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer  # noqa: E402
from trl_agentic.evaluation import evaluate_policy, format_comparison  # noqa: E402
from trl_agentic.models import resolve_model_path  # noqa: E402
from trl_agentic.reporting import TrajectoryRecorder, install_compact_progress, plot_curves, write_report  # noqa: E402
from trl_agentic.tasks import TaskArguments, build_task  # noqa: E402
from trl_agentic.warmstart import run_task_warmstart  # noqa: E402


def evaluate(model, tokenizer, task, task_args, args, stage):
    result = evaluate_policy(
        model,
        tokenizer,
        list(task.eval_dataset),
        environment_factory=task.environment_factory,
        reward_funcs=task.reward_funcs,
        max_completion_length=args.max_completion_length,
        # Training's rollout limits (None: no limit, 0: no tool call, as TRL reads them).
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        max_turn_tokens=args.max_turn_tokens,
        batch_size=task_args.heldout_eval_batch_size,
        temperature=task_args.heldout_eval_temperature,  # 0: greedy; the quickstart samples like training (0.8)
        top_p=args.top_p,
        seed=args.seed,
        desc=f"eval {stage}",
    )
    print(
        f"[{stage}] success {result.metrics['success_rate']:.1%}, tool failures {result.metrics['tool_failure_rate']:.1%}"
    )
    return result


def main():
    parser = TrlParser((TaskArguments, AgenticGRPOConfig, ModelConfig))
    task_args, args, model_args = parser.parse_args_and_config()
    task = build_task(task_args)  # problems, CalculatorEnv, answer_reward, and rows for the warm-start traces

    model_path = resolve_model_path(model_args.model_name_or_path or "smollm2-135m")  # converted once, cached
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=model_args.dtype or "float32")

    # 1. Warm start: the model has never seen the tool-call format; SFT shows it on synthetic traces of the task.
    # Steps, batch size, learning rate and error fraction come from `task_args`, the traces from the task; device and
    # precision from the training config. `--warmstart_steps 0` skips it.
    peft_config = get_peft_config(model_args)
    if task_args.warmstart_steps:
        warm = run_task_warmstart(
            model,
            tokenizer,
            task,
            task_args,
            peft_config=peft_config,
            output_dir=os.path.join(args.output_dir, "warmstart"),
            seed=args.seed,
            use_cpu=args.use_cpu,
            bf16=args.bf16,
        )
        print(f"Warm start: {warm.num_traces} traces in {warm.seconds:.0f} s. First trace:\n{warm.sample_trace}")
        model, peft_config = warm.model, None  # GRPO continues training the warm-start adapter (a PeftModel)

    # 2. Held-out evaluation before GRPO.
    before = evaluate(model, tokenizer, task, task_args, args, "before GRPO")

    # 3. GRPO, on the warm-start LoRA adapter (or a new one on the base model without a warm start).
    args.model_init_kwargs = None
    trainer = AgenticGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=task.reward_funcs,
        args=args,
        train_dataset=task.train_dataset,
        environment_factory=task.environment_factory,
        peft_config=peft_config,
    )
    recorder = TrajectoryRecorder(tokenizer).attach(trainer)  # training rows for report.html
    install_compact_progress(trainer)  # one line per step: reward, tool failures, rollbacks, negatives, s/step
    trainer.train()
    trainer.save_model(args.output_dir)  # the LoRA adapter (warm start + GRPO) for the base model

    # 4. Held-out evaluation after GRPO.
    after = evaluate(trainer.accelerator.unwrap_model(trainer.model), tokenizer, task, task_args, args, "after GRPO")

    # 5. Outputs.
    results = {"before GRPO": before.metrics, "after GRPO": after.metrics}
    with open(os.path.join(args.output_dir, "eval_results.json"), "w") as f:
        json.dump({"eval": results}, f, indent=2)
    plot_curves(trainer.state.log_history, os.path.join(args.output_dir, "curves.png"), eval_results=results)
    recorder.save_jsonl(os.path.join(args.output_dir, "trajectories.jsonl"))
    write_report(
        os.path.join(args.output_dir, "report.html"),
        recorder.trajectories,
        eval_results=results,
        eval_records={"before GRPO": before.records, "after GRPO": after.records},
        max_trajectories=task_args.report_max_trajectories,
        system_prompt=task.system_prompt,
    )
    print(format_comparison(results))


if __name__ == "__main__":
    main()
