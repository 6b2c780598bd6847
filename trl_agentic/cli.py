"""Command line: `trl-agentic train --config configs/<x>.yaml [--field value ...]` (also `python -m trl_agentic`).

Arguments are parsed with TRL's `TrlParser` into `TaskArguments`, `AgenticGRPOConfig` and TRL's `ModelConfig`, the
convention of `trl grpo --config`: a YAML file gives the values, command-line flags override them. Every config is
validated while it is parsed, so a bad value fails before any model is loaded. Works under
`accelerate launch ... -m trl_agentic train --config ...`.
"""

from __future__ import annotations

import sys

USAGE = """usage: trl-agentic <command> [options]

commands:
  train --config CONFIG.yaml [--field value ...]   train with AgenticGRPOTrainer (fields of TaskArguments,
                                                   AgenticGRPOConfig and trl.ModelConfig)
"""

DEFAULT_MODEL = "smollm2-135m"


def make_parser():
    from trl import ModelConfig, TrlParser

    from .config import AgenticGRPOConfig
    from .tasks import TaskArguments

    return TrlParser((TaskArguments, AgenticGRPOConfig, ModelConfig), prog="trl-agentic train")


def train(task_args, training_args, model_args):
    """Build the task and the trainer, train, save (and push to the Hub when `push_to_hub`)."""
    from trl import get_peft_config

    from .models import resolve_model_path
    from .tasks import build_task
    from .trainer import AgenticGRPOTrainer

    task = build_task(task_args)
    model_path = resolve_model_path(model_args.model_name_or_path or DEFAULT_MODEL)
    model_init_kwargs = dict(training_args.model_init_kwargs or {})
    model_init_kwargs.setdefault("dtype", model_args.dtype)
    training_args.model_init_kwargs = model_init_kwargs
    trainer = AgenticGRPOTrainer(
        model=model_path,
        reward_funcs=task.reward_funcs,
        args=training_args,
        train_dataset=task.train_dataset,
        eval_dataset=task.eval_dataset if training_args.eval_strategy != "no" else None,
        environment_factory=task.environment_factory,
        tools=task.tools or None,
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return trainer


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command != "train":
        print(f"trl-agentic: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    task_args, training_args, model_args = make_parser().parse_args_and_config(args=rest)
    train(task_args, training_args, model_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
