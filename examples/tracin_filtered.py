# Copyright the trl-agentic authors. Licensed under the Apache License, Version 2.0.
"""
TracIn-filtered GRPO on the calculator tool task with the embedded SmolLM2-135M-Instruct and LoRA. Runs offline on CPU.

Every `tracin_val_refresh_steps` optimizer steps, held-out problems are rolled out through the trainer's own tool loop
(`tracin_val_num_generations` completions each), and the gradient V of the GRPO loss on them is taken w.r.t. the LoRA
weights. Each training row is scored by the inner product of its own LoRA gradient with V, and only the selected rows
(`tracin_selection`) are trained on. See docs/tracin.md.

Usage:

```bash
python examples/tracin_filtered.py --config configs/tracin.yaml
python examples/tracin_filtered.py --config configs/tracin.yaml --max_steps 1 --tracin_selection top_fraction
```
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is embedded: never touch the Hub

from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer  # noqa: E402
from trl_agentic.models import resolve_model_path  # noqa: E402
from trl_agentic.tasks import TaskArguments, build_task  # noqa: E402

TRACIN_METRICS = ("tracin/selected_ratio", "tracin/score_mean", "tracin/score_pos_frac", "tracin/score_adv_corr")


def main():
    parser = TrlParser((TaskArguments, AgenticGRPOConfig, ModelConfig))
    task_args, training_args, model_args = parser.parse_args_and_config()
    if not training_args.tracin_enabled:
        raise SystemExit("This example is about TracIn: set `tracin_enabled: true`.")
    task = build_task(task_args)
    model_init_kwargs = dict(training_args.model_init_kwargs or {})
    model_init_kwargs.setdefault("dtype", model_args.dtype)
    training_args.model_init_kwargs = model_init_kwargs
    trainer = AgenticGRPOTrainer(
        model=resolve_model_path(model_args.model_name_or_path or "smollm2-135m"),
        reward_funcs=task.reward_funcs,
        args=training_args,
        train_dataset=task.train_dataset,
        tracin_eval_dataset=task.eval_dataset,  # held-out problems: the validation prompts of the filter
        environment_factory=task.environment_factory,
        tools=task.tools or None,
        peft_config=get_peft_config(model_args),
    )
    design = "fused (one backward per step)" if trainer._tracin.fused else "two-pass (scoring pass + masked step)"
    trainer.accelerator.print(f"TracIn step: {design}")
    trainer.train()

    steps = [h for h in trainer.state.log_history if "tracin/selected_ratio" in h]
    if trainer.accelerator.is_main_process:
        print("\nstep  " + "  ".join(f"{m.split('/')[1]:>14}" for m in TRACIN_METRICS) + "      val_reward    reward")
        for h in steps:
            cells = "  ".join(f"{h[m]:>14.4g}" if h.get(m) is not None else f"{'n/a':>14}" for m in TRACIN_METRICS)
            val = h.get("tracin/val_reward")
            val = f"{val:>14.4g}" if val is not None else f"{'(cached V)':>14}"
            print(f"{h['step']:>4}  {cells}  {val}  {h['reward']:>8.3f}")
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    main()
