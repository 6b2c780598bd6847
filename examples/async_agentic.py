# Copyright the trl-agentic authors. Licensed under the Apache License, Version 2.0.
"""
The agentic features on TRL's asynchronous trainer: `AsyncAgenticGRPOTrainer` trains SmolLM2-135M-Instruct + LoRA on
the calculator task with rollback and negative samples, while a vLLM server (started here, LoRA enabled) generates the
rollouts asynchronously. Each trajectory runs trl-agentic's rollout loop inside TRL's rollout worker; adapters are
synced to the server under versioned names after every step. See docs/async.md.

Needs vLLM (TRL's rollout worker imports it): run with the interpreter of `.venv-vllm`.

```bash
.venv-vllm/bin/python examples/async_agentic.py --config configs/async_calculator.yaml
.venv-vllm/bin/python examples/async_agentic.py --config configs/async_calculator.yaml --max_steps 1
```
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is embedded: never touch the Hub
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl import TrlParser, get_peft_config  # noqa: E402

from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer  # noqa: E402
from trl_agentic.async_grpo.server import VLLMServer  # noqa: E402
from trl_agentic.cli import TrainerArguments, async_model_config  # noqa: E402
from trl_agentic.models import resolve_model_path  # noqa: E402
from trl_agentic.tasks import TaskArguments, build_task  # noqa: E402

METRICS = ("reward", "rollback/attempts_total", "negatives/rows_total", "sample/staleness_max", "perf/step_s")


def main():
    # TRL's ModelConfig without `dtype` / `trust_remote_code`, which AsyncGRPOConfig has too.
    parser = TrlParser((TaskArguments, AsyncAgenticGRPOConfig, async_model_config(), TrainerArguments))
    task_args, args, model_args, _ = parser.parse_args_and_config()
    if task_args.warmstart_steps:
        raise SystemExit(
            "`warmstart_steps`: run this config with `trl-agentic train --config ...`, which warm-starts, merges the "
            "adapter and serves the merged model (docs/async.md)."
        )
    task = build_task(task_args)
    model = resolve_model_path(model_args.model_name_or_path)
    peft_config = get_peft_config(model_args)
    server = None
    if args.vllm_server_start:
        os.makedirs(args.output_dir, exist_ok=True)
        server = VLLMServer(
            model,
            max_lora_rank=peft_config.r,
            max_loras=args.max_staleness + 2,
            log_path=os.path.join(args.output_dir, "vllm-server.log"),
            dtype=str(args.dtype).removeprefix("torch."),  # the trainer's
        ).start()
        args.vllm_server_base_url = server.url
    try:
        trainer = AsyncAgenticGRPOTrainer(
            model=model,
            reward_funcs=task.reward_funcs,
            args=args,
            train_dataset=task.train_dataset,
            environment_factory=task.environment_factory,
            tools=task.tools or None,
            peft_config=peft_config,
        )
        trainer.train()
        trainer.save_model(args.output_dir)
    finally:
        if server is not None:
            server.stop()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print({name: entry.get(name) for name in METRICS})


if __name__ == "__main__":
    main()
