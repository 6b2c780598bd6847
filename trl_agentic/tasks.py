"""Built-in tasks for the CLI and the examples: dataset + environment + reward functions, from `TaskArguments`."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from datasets import Dataset

TASKS = ("calculator", "python", "textworld")

PYTHON_SYSTEM_PROMPT = (
    "Solve the math problem. Use the `python` tool to compute (print the result), then give the final answer on its "
    'own line as "Answer: <number>".'
)


@dataclass
class TaskArguments:
    """
    Arguments that choose the task (dataset, environment and rewards) of `trl-agentic train`.

    Args:
        task (`str`, *optional*, defaults to `"calculator"`):
            `"calculator"` (arithmetic word problems with a calculator tool), `"python"` (the same problems with the
            Python sandbox tool), `"textworld"` (multi-step text world) or an import path `"package.module:build"` of
            a function `build(task_args) -> Task`.
        num_train_tasks (`int`, *optional*, defaults to `256`):
            Number of generated training problems.
        num_eval_tasks (`int`, *optional*, defaults to `32`):
            Number of held-out problems (a different seed) for evaluation.
        task_difficulty (`str`, *optional*, defaults to `"medium"`):
            Difficulty of the generated arithmetic problems: `"easy"`, `"medium"` or `"hard"`.
        task_seed (`int`, *optional*, defaults to `0`):
            Seed of the task generator (held-out problems use `task_seed + 1`).
        sandbox_timeout (`float`, *optional*, defaults to `5.0`):
            Wall-clock limit of one Python sandbox call, in seconds.
        extra_reward_funcs (`list[str]`, *optional*):
            Import paths `"package.module:function"` of extra reward functions.
    """

    task: str = field(default="calculator", metadata={"help": "calculator, python, textworld or 'pkg.module:build'."})
    num_train_tasks: int = field(default=256, metadata={"help": "Number of generated training problems."})
    num_eval_tasks: int = field(default=32, metadata={"help": "Number of held-out problems for evaluation."})
    task_difficulty: str = field(default="medium", metadata={"help": "easy, medium or hard."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the task generator."})
    sandbox_timeout: float = field(default=5.0, metadata={"help": "Wall-clock limit of one Python sandbox call (s)."})
    extra_reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Import paths 'pkg.module:function' of extra reward functions."}
    )

    def __post_init__(self):
        if self.task not in TASKS and ":" not in self.task:
            raise ValueError(f"`task` must be one of {list(TASKS)} or 'package.module:build', got {self.task!r}.")
        if self.task_difficulty not in ("easy", "medium", "hard"):
            raise ValueError(f"`task_difficulty` must be easy, medium or hard, got {self.task_difficulty!r}.")
        for name in ("num_train_tasks", "num_eval_tasks"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be non-negative, got {getattr(self, name)}.")
        if self.sandbox_timeout <= 0:
            raise ValueError(f"`sandbox_timeout` must be positive, got {self.sandbox_timeout}.")


@dataclass
class Task:
    """Everything the trainer needs for one task."""

    train_dataset: Dataset
    eval_dataset: Dataset | None
    environment_factory: Callable | None
    reward_funcs: list[Callable]
    tools: list[Callable] = field(default_factory=list)


def import_object(path: str):
    """Import `"package.module:attr"` (the current directory is importable, like TRL's scripts)."""
    module, _, attr = path.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module), attr)


def _arithmetic(args: TaskArguments, system_prompt: str | None):
    from .envs.calculator import make_arithmetic_tasks

    def build(n, seed):
        rows = make_arithmetic_tasks(n, seed, args.task_difficulty)
        if system_prompt is not None:
            for row in rows:
                row["prompt"][0] = {"role": "system", "content": system_prompt}
        return Dataset.from_list(rows)

    return build(args.num_train_tasks, args.task_seed), build(args.num_eval_tasks, args.task_seed + 1)


def build_task(args: TaskArguments) -> Task:
    """Build the dataset, environment factory and reward functions of a task."""
    extra = [import_object(p) for p in args.extra_reward_funcs or []]
    if args.task == "calculator":
        from .envs.calculator import CalculatorEnv, answer_reward

        train, evaluation = _arithmetic(args, None)
        return Task(train, evaluation, CalculatorEnv, [answer_reward, *extra])
    if args.task == "python":
        from functools import partial

        from .envs.calculator import answer_reward
        from .envs.python_sandbox import PythonSandboxEnv

        train, evaluation = _arithmetic(args, PYTHON_SYSTEM_PROMPT)
        return Task(
            train, evaluation, partial(PythonSandboxEnv, timeout=args.sandbox_timeout), [answer_reward, *extra]
        )
    if args.task == "textworld":
        from .envs.textworld import TextWorldToolEnv, make_textworld_tasks

        train = Dataset.from_list(make_textworld_tasks(args.num_train_tasks, args.task_seed))
        evaluation = Dataset.from_list(make_textworld_tasks(args.num_eval_tasks, args.task_seed + 1))
        return Task(train, evaluation, TextWorldToolEnv, list(extra))
    return import_object(args.task)(args)
