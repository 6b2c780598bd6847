# Copyright the trl-agentic authors. Licensed under the Apache License, Version 2.0.
"""
TracIn-filtered GRPO on the calculator tool task with the embedded SmolLM2-135M-Instruct and LoRA. Runs offline on CPU.
It runs `trl-agentic train`'s pipeline (the config's warm start, then GRPO) and prints the TracIn metrics per step.

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

from trl import ModelConfig, TrlParser  # noqa: E402

from trl_agentic import AgenticGRPOConfig  # noqa: E402
from trl_agentic.cli import train  # noqa: E402
from trl_agentic.tasks import TaskArguments  # noqa: E402

TRACIN_METRICS = ("tracin/selected_ratio", "tracin/score_mean", "tracin/score_pos_frac", "tracin/score_adv_corr")


def main():
    parser = TrlParser((TaskArguments, AgenticGRPOConfig, ModelConfig))
    task_args, training_args, model_args = parser.parse_args_and_config()
    if not training_args.tracin_enabled:
        raise SystemExit("This example is about TracIn: set `tracin_enabled: true`.")
    # `trl-agentic train`'s pipeline: the warm start of the config (if any), then GRPO with held-out problems the run
    # neither evaluates nor trains on as the validation prompts of the filter (`tracin_eval_dataset`, docs/tracin.md).
    trainer = train(task_args, training_args, model_args)
    design = "fused (one backward per step)" if trainer._tracin.fused else "two-pass (scoring pass + masked step)"
    trainer.accelerator.print(f"TracIn step: {design}")

    steps = [h for h in trainer.state.log_history if "tracin/selected_ratio" in h]
    if trainer.accelerator.is_main_process:
        print("\nstep  " + "  ".join(f"{m.split('/')[1]:>14}" for m in TRACIN_METRICS) + "      val_reward    reward")
        for h in steps:
            cells = "  ".join(f"{h[m]:>14.4g}" if h.get(m) is not None else f"{'n/a':>14}" for m in TRACIN_METRICS)
            val = h.get("tracin/val_reward")
            val = f"{val:>14.4g}" if val is not None else f"{'(cached V)':>14}"
            print(f"{h['step']:>4}  {cells}  {val}  {h['reward']:>8.3f}")


if __name__ == "__main__":
    main()
