"""Built-in tasks for the CLI and the examples: dataset + environment + reward functions, from `TaskArguments`."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from datasets import Dataset

from .field_checks import check_finite

TASKS = ("calculator", "python", "textworld", "logsearch", "bfcl")
# The tasks whose warm start uses their own solved episodes (`Task.make_traces`), not the arithmetic trace generator:
# they write no rejected calls (`warmstart_error_fraction` does nothing there).
OWN_TRACE_TASKS = ("textworld", "logsearch", "bfcl")

PYTHON_SYSTEM_PROMPT = (
    "Solve the math problem. Use the `python` tool to compute (print the result), then give the final answer on its "
    'own line as "Answer: <number>".'
)


# Fields of `TaskArguments` checked for their type (and, for the floats, finiteness) first.
_INT_FIELDS = (
    "num_train_tasks",
    "num_eval_tasks",
    "task_seed",
    "textworld_max_plan_steps",
    "warmstart_steps",
    "warmstart_batch_size",
    "heldout_eval_batch_size",
    "report_max_trajectories",
)
_FLOAT_FIELDS = (
    "bfcl_heldout_fraction",
    "textworld_heldout_fraction",
    "warmstart_learning_rate",
    "warmstart_error_fraction",
    "heldout_eval_temperature",
)


@dataclass
class TaskArguments:
    """
    Arguments that choose the task (dataset, environment and rewards) of `trl-agentic train`.

    Args:
        task (`str`, *optional*, defaults to `"calculator"`):
            `"calculator"` (arithmetic word problems with a calculator tool), `"python"` (the same problems with the
            Python sandbox tool), `"textworld"` (multi-step text world, turns in the RLVCR level format with an `act`
            tool call, docs/rlvcr.md), `"logsearch"` (sum the counts of long log files read one at a time:
            `delete_context` is needed to finish, docs/snapshots.md), `"bfcl"` (BFCL v4 multi-turn tasks,
            docs/bfcl.md) or an import path `"package.module:build"` of a function `build(task_args) -> Task`.
        num_train_tasks (`int`, *optional*, defaults to `256`):
            Number of generated training problems, at least 1 (`bfcl`: at most this many training tasks; 0 takes
            them all).
        num_eval_tasks (`int`, *optional*, defaults to `32`):
            Number of held-out problems (a different seed) for evaluation (`bfcl`: at most this many held-out tasks;
            0 takes them all). `heldout_eval` and `tracin_enabled` need at least one.
        task_difficulty (`str`, *optional*, defaults to `"medium"`):
            Difficulty of the generated arithmetic problems: `"easy"`, `"medium"` or `"hard"`.
        task_seed (`int`, *optional*, defaults to `0`):
            Seed of the task generator (held-out problems use `task_seed + 1`, warm-start rows `task_seed + 2`; with
            `tracin_enabled`, the validation prompts are held-out problems of `task_seed + 10` that the run neither
            evaluates nor trains on; BFCL: the held-out tasks of this seed's scenario split that it does not evaluate).
        sandbox_timeout (`float`, *optional*, defaults to `5.0`):
            Wall-clock limit of one Python sandbox call, in seconds.
        sandbox_isolation (`str`, *optional*, defaults to `"required"`):
            Isolation policy of the Python sandbox: `"required"` refuses to start on a machine without bubblewrap
            namespaces and memory/pids/cpu cgroups; `"best_effort"` runs with what the machine has and logs what is
            missing (see docs/reliability.md).
        extra_reward_funcs (`list[str]`, *optional*):
            Import paths `"package.module:function"` of extra reward functions (a single string is one path). A
            function with an `environment_class` attribute reads that environment (e.g. the calculator's
            `tool_use_reward`) and is refused, naming this field, for a task whose environments are not of that class.
        textworld_max_plan_steps (`int`, *optional*, defaults to `0`):
            `task: textworld`: only tasks whose shortest plan has at most this many steps (0: any). Rollouts of k
            tool rounds (`max_tool_calling_iterations`) can solve only plans of up to k steps.
        textworld_heldout_fraction (`float`, *optional*, defaults to `0.25`):
            `task: textworld`: share of the 1575 worlds (goal, where the goal object starts, start room) held out for
            evaluation, in [0, 1), within each shortest-plan length. A fixed split, the same for every `task_seed`:
            training and warm-start tasks come from the other worlds, and each held-out task is a different world, so
            `num_eval_tasks` can be at most the number of held-out worlds (394 at 0.25; 20 with
            `textworld_max_plan_steps: 3`).
        logsearch_context_deletion (`bool`, *optional*, defaults to `True`):
            `task: logsearch`: the system prompt asks to delete each file's content with `delete_context` after
            reading it, and the warm-start traces do so (one SFT example per segment). `False`: a prompt without
            deletion and traces that keep every file in one context, for a run without `delete_context` (e.g. TRL's
            trainer with a budget that holds every file). The problems are the same either way.

        > BFCL multi-turn (`task: bfcl`)

        bfcl_categories (`list[str]`, *optional*, defaults to `["base"]`):
            BFCL multi-turn categories of the tasks: `base`, `miss_func`, `miss_param`, `long_context`.
        bfcl_classes (`list[str]`, *optional*):
            Keep only tasks all of whose API classes are among these (default: every task).
        bfcl_heldout_fraction (`float`, *optional*, defaults to `0.25`):
            Share of the 200 scenarios held out for evaluation (the same scenarios in every category); training
            tasks come from the others. The split's seed is `task_seed`.
        bfcl_turn_credit (`bool`, *optional*, defaults to `False`):
            Add our per-turn partial credit (fraction of leading turns that pass the official checks) as a second
            reward function, beside the official verdict.
        bfcl_hide_excluded (`bool`, *optional*, defaults to `True`):
            Hide each task's `excluded_function`s from its tools (BFCL's own inference shows them).

        > Warm start (SFT before GRPO; built-in arithmetic tasks, `textworld` and `bfcl`)

        warmstart_steps (`int`, *optional*, defaults to `0`):
            Optimizer steps of a short SFT stage (TRL's `SFTTrainer`, same LoRA config) on synthetic tool-use traces
            of the task before GRPO; `0` skips it. GRPO then continues training the same adapter (`trainer:
            async_grpo`: the adapter is merged into a model folder the vLLM server serves, `vllm_server_start` must be
            on, and GRPO trains a new adapter on it). `bfcl`: the traces
            are the ground-truth conversations of the training tasks. `textworld`: solved episodes (shortest plans)
            in the RLVCR step format.
        warmstart_batch_size (`int`, *optional*, defaults to `8`):
            Traces per SFT step; `warmstart_steps * warmstart_batch_size` rows are drawn (seed `task_seed + 2`: an
            independent draw, so a problem can also be a training or held-out one; the ablation removes those) and
            that many traces are trained on (`logsearch`: one trace per segment, three per row with deletion, of
            which SFT sees that many). `bfcl`: the training tasks' traces, repeated as needed.
        warmstart_learning_rate (`float`, *optional*, defaults to `2e-4`):
            Peak learning rate of the SFT stage (linear decay); positive and finite.
        warmstart_error_fraction (`float`, *optional*, defaults to `0.0`):
            Fraction of traces that first make a malformed call, see the tool's error and then make the right call,
            so the warm-started policy still errs sometimes and rollback has something to fix. The arithmetic tasks
            only (`calculator`, `python`): the others' traces are their own solved episodes (a warning says so).

        > Held-out evaluation and report

        heldout_eval (`bool`, *optional*, defaults to `False`):
            Evaluate the policy on the `num_eval_tasks` held-out problems before and after GRPO with the multi-turn
            tool loop (`trl_agentic.evaluation`), with the rollout limits of training (`max_tool_calling_iterations`,
            `max_turn_tokens`, `max_tool_output_chars`, `top_p`), print the comparison and save it to
            `eval_results.json` (`trainer: async_grpo`: after training only).
        heldout_eval_base_model (`bool`, *optional*, defaults to `False`):
            Also evaluate the model before the warm start (not with `trainer: async_grpo`).
        heldout_eval_temperature (`float`, *optional*, defaults to `0.0`):
            Decoding of the held-out evaluation: `0` is greedy (deterministic), otherwise the sampling temperature.
        heldout_eval_batch_size (`int`, *optional*, defaults to `32`):
            Held-out problems rolled out together.
        write_report (`bool`, *optional*, defaults to `False`):
            Write `curves.png`, `report.html` (a browsable sample of training trajectories) and `trajectories.jsonl`
            into `output_dir` (not with `trainer: async_grpo`).
        report_max_trajectories (`int`, *optional*, defaults to `160`):
            Training rows shown in `report.html`.
    """

    task: str = field(
        default="calculator",
        metadata={"help": "calculator, python, textworld, logsearch, bfcl or 'pkg.module:build'."},
    )
    num_train_tasks: int = field(default=256, metadata={"help": "Number of generated training problems."})
    num_eval_tasks: int = field(default=32, metadata={"help": "Number of held-out problems for evaluation."})
    task_difficulty: str = field(default="medium", metadata={"help": "easy, medium or hard."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the task generator."})
    sandbox_timeout: float = field(default=5.0, metadata={"help": "Wall-clock limit of one Python sandbox call (s)."})
    sandbox_isolation: str = field(
        default="required",
        metadata={
            "help": "Python sandbox isolation: 'required' refuses to start without bubblewrap and cgroups; "
            "'best_effort' runs with what the machine has and logs what is missing."
        },
    )
    extra_reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Import paths 'pkg.module:function' of extra reward functions; one with an `environment_class` "
            "attribute is refused for a task whose environments are not of that class."
        },
    )
    textworld_max_plan_steps: int = field(
        default=0,
        metadata={"help": "Text world: only tasks whose shortest plan has at most this many steps (0: any)."},
    )
    textworld_heldout_fraction: float = field(
        default=0.25,
        metadata={
            "help": "Text world: share of worlds held out for evaluation (a fixed split; each eval task differs)."
        },
    )
    logsearch_context_deletion: bool = field(
        default=True,
        metadata={
            "help": "Log search: prompt and warm-start traces delete each file with `delete_context` after reading "
            "it; False: they keep every file in the context (a run without `delete_context`)."
        },
    )
    bfcl_categories: list[str] = field(
        default_factory=lambda: ["base"],
        metadata={"help": "BFCL categories: base, miss_func, miss_param, long_context."},
    )
    bfcl_classes: list[str] | None = field(
        default=None, metadata={"help": "Keep BFCL tasks whose API classes are all among these (default: all)."}
    )
    bfcl_heldout_fraction: float = field(
        default=0.25, metadata={"help": "Share of BFCL scenarios held out for evaluation (seed: task_seed)."}
    )
    bfcl_turn_credit: bool = field(
        default=False, metadata={"help": "Add our per-turn partial credit as a second reward function."}
    )
    bfcl_hide_excluded: bool = field(
        default=True, metadata={"help": "Hide each BFCL task's excluded functions from its tools."}
    )
    warmstart_steps: int = field(
        default=0,
        metadata={
            "help": "SFT steps on synthetic tool-use traces before GRPO, which continues the same LoRA adapter "
            "(`trainer: async_grpo`: merged into a model folder that the server started by the run, "
            "`vllm_server_start: true`, serves; GRPO trains a new adapter on it); 0 skips it."
        },
    )
    warmstart_batch_size: int = field(default=8, metadata={"help": "Traces per warm-start SFT step."})
    warmstart_learning_rate: float = field(default=2e-4, metadata={"help": "Peak learning rate of the warm start."})
    warmstart_error_fraction: float = field(
        default=0.0,
        metadata={
            "help": "Fraction of warm-start traces with a rejected tool call before the right one (the arithmetic "
            "tasks, `calculator` and `python`; the others' traces are their own solved episodes)."
        },
    )
    heldout_eval: bool = field(
        default=False,
        metadata={
            "help": "Evaluate on the held-out problems before and after GRPO (multi-turn tool loop); with `trainer: "
            "async_grpo`, after training only."
        },
    )
    heldout_eval_base_model: bool = field(
        default=False, metadata={"help": "Also evaluate the model before the warm start."}
    )
    heldout_eval_temperature: float = field(
        default=0.0, metadata={"help": "Held-out evaluation decoding: 0 = greedy, else the sampling temperature."}
    )
    heldout_eval_batch_size: int = field(default=32, metadata={"help": "Held-out problems rolled out together."})
    write_report: bool = field(
        default=False,
        metadata={"help": "Write curves.png, report.html and trajectories.jsonl into output_dir."},
    )
    report_max_trajectories: int = field(default=160, metadata={"help": "Training rows shown in report.html."})

    def __post_init__(self):
        # YAML values reach the fields unconverted (`TrlParser` converts only strings): a float in an int field failed
        # later with an error naming no field, or changed the run (a batch size of 2.5 is one batch).
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"`{name}` must be an integer, got {value!r}.")
        for name in _FLOAT_FIELDS:
            check_finite(name, getattr(self, name))
        if isinstance(self.extra_reward_funcs, str):  # one path written as a YAML string
            self.extra_reward_funcs = [self.extra_reward_funcs]
        if self.extra_reward_funcs is not None and not all(
            isinstance(p, str) and ":" in p for p in self.extra_reward_funcs
        ):
            raise ValueError(
                f"`extra_reward_funcs` must be import paths 'package.module:function', got {self.extra_reward_funcs!r}."
            )
        if self.task not in TASKS and ":" not in self.task:
            raise ValueError(f"`task` must be one of {list(TASKS)} or 'package.module:build', got {self.task!r}.")
        if self.task_difficulty not in ("easy", "medium", "hard"):
            raise ValueError(f"`task_difficulty` must be easy, medium or hard, got {self.task_difficulty!r}.")
        for name in ("num_train_tasks", "num_eval_tasks"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be non-negative, got {getattr(self, name)}.")
        if self.task in TASKS and self.task != "bfcl" and self.num_train_tasks < 1:  # bfcl: 0 takes every task
            raise ValueError(
                f"`num_train_tasks` must be at least 1 for task {self.task!r}, got {self.num_train_tasks}."
            )
        from .envs.python_sandbox import check_timeout

        check_timeout("sandbox_timeout", self.sandbox_timeout)
        if self.sandbox_isolation not in ("required", "best_effort"):
            raise ValueError(
                f"`sandbox_isolation` must be 'required' or 'best_effort', got {self.sandbox_isolation!r}."
            )
        for name in ("warmstart_steps", "report_max_trajectories", "textworld_max_plan_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be non-negative, got {getattr(self, name)}.")
        for name in ("warmstart_batch_size", "heldout_eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be at least 1, got {getattr(self, name)}.")
        if self.warmstart_learning_rate <= 0:
            raise ValueError(f"`warmstart_learning_rate` must be positive, got {self.warmstart_learning_rate}.")
        if not 0.0 <= self.warmstart_error_fraction <= 1.0:
            raise ValueError(f"`warmstart_error_fraction` must be in [0, 1], got {self.warmstart_error_fraction}.")
        if self.warmstart_error_fraction and self.task in OWN_TRACE_TASKS:
            warnings.warn(
                f"`warmstart_error_fraction` has no effect with `task: {self.task}`: its warm-start traces are the "
                "task's own solved episodes, without rejected calls (only the arithmetic tasks' generator writes them).",
                UserWarning,
                stacklevel=3,
            )
        if self.heldout_eval_temperature < 0:  # finite: checked above
            raise ValueError(f"`heldout_eval_temperature` must be >= 0, got {self.heldout_eval_temperature}.")
        if self.task == "bfcl":
            from .envs.bfcl.data import API_CLASSES, CATEGORIES

            if not self.bfcl_categories or not set(self.bfcl_categories) <= set(CATEGORIES):
                raise ValueError(f"`bfcl_categories` must be among {list(CATEGORIES)}, got {self.bfcl_categories}.")
            if self.bfcl_classes is not None and not set(self.bfcl_classes) <= set(API_CLASSES):
                raise ValueError(f"`bfcl_classes` must be among {list(API_CLASSES)}, got {self.bfcl_classes}.")
            if not 0.0 <= self.bfcl_heldout_fraction <= 1.0:
                raise ValueError(f"`bfcl_heldout_fraction` must be in [0, 1], got {self.bfcl_heldout_fraction}.")
        if self.task == "textworld":
            self._check_textworld_split()
        if self.warmstart_steps and self.task not in TASKS:
            raise ValueError(
                f"`warmstart_steps` needs a built-in task with traces ({', '.join(map(repr, TASKS))}), "
                f"got {self.task!r}."
            )

    def _check_textworld_split(self) -> None:
        """The text world's split leaves training worlds and enough held-out worlds for `num_eval_tasks`."""
        from .envs.textworld import split_worlds

        if not 0.0 <= self.textworld_heldout_fraction < 1.0:
            raise ValueError(
                f"`textworld_heldout_fraction` must be in [0, 1) (training needs worlds), got "
                f"{self.textworld_heldout_fraction}."
            )
        train, heldout = split_worlds(self.textworld_heldout_fraction, self.textworld_max_plan_steps)
        plans = (
            f" with a plan of at most {self.textworld_max_plan_steps} steps" if self.textworld_max_plan_steps else ""
        )
        if not train:
            raise ValueError(
                f"No text world{plans} is left for training (`textworld_max_plan_steps` = "
                f"{self.textworld_max_plan_steps}, `textworld_heldout_fraction` = {self.textworld_heldout_fraction:g})."
            )
        if self.num_eval_tasks > len(heldout):
            raise ValueError(
                f"`num_eval_tasks` = {self.num_eval_tasks}, but only {len(heldout)} text worlds{plans} are held out "
                f"(`textworld_heldout_fraction` = {self.textworld_heldout_fraction:g}); each held-out task is a "
                "different world, so lower `num_eval_tasks` or raise `textworld_heldout_fraction`."
            )


@dataclass
class Task:
    """Everything the trainer needs for one task."""

    train_dataset: Dataset
    eval_dataset: Dataset | None
    # A callable, or TRL's multi-environment mapping {name: factory} (rows then carry an `environment` column).
    environment_factory: Callable | dict[str, Callable] | None
    reward_funcs: list[Callable]
    tools: list[Callable] = field(default_factory=list)
    # Keyword arguments of `trl_agentic.warmstart.make_tool_traces` (None: the task has no warm start).
    warmstart_options: dict | None = None
    # Rows the warm-start traces are made from (an independent draw; the built-in tasks keep held-out problems out).
    warmstart_dataset: Dataset | None = None
    system_prompt: str | None = None
    # `make_traces(rows) -> traces` for the warm start instead of the arithmetic trace generator (e.g. BFCL's
    # ground-truth conversations, `trl_agentic.envs.bfcl.traces.ground_truth_traces`).
    make_traces: Callable | None = None
    # Extra keyword arguments of `trl_agentic.warmstart.run_warmstart` (e.g. micro-batches and gradient checkpointing
    # for long traces).
    warmstart_trainer_options: dict | None = None


def problem_key(row: dict) -> str:
    """What makes two problems the same: the calculator's expression, else the text world's world (`world_key`), else
    BFCL's scenario (`multi_turn_<category>_<n>` is scenario n in every category, its first question worded a little
    differently), else the environment's seed, else the question."""
    for column in ("expression", "world"):
        if row.get(column) is not None:
            return f"{column}={row[column]}"
    if row.get("bfcl_id") is not None:
        return f"bfcl_scenario={str(row['bfcl_id']).rsplit('_', 1)[-1]}"
    if row.get("task_seed") is not None:
        return f"task_seed={row['task_seed']}"
    return json.dumps(row["prompt"][-1]["content"], default=str)


VALIDATION_SEED_OFFSET = 10


def validation_rows(args: TaskArguments, exclude: set[str]) -> Dataset:
    """Validation problems (TracIn's validation prompts): the held-out problems of the task built from `task_seed + 10`,
    without those whose `problem_key` is in `exclude` (the problems a run evaluates, or trains on). BFCL: every
    held-out task of this `task_seed`'s scenario split (another seed's split holds out mostly this one's training
    scenarios)."""
    if args.task == "bfcl":
        source = dataclasses.replace(args, num_eval_tasks=0)  # 0 takes every held-out task
    else:
        source = dataclasses.replace(args, task_seed=args.task_seed + VALIDATION_SEED_OFFSET)
    validation = build_task(source).eval_dataset
    if validation is None:
        return Dataset.from_list([])
    return validation.filter(lambda row: problem_key(row) not in exclude)


def import_object(path: str, field: str | None = None):
    """Import `"package.module:attr"` (the current directory is importable, like TRL's scripts); with `field`, a path
    that does not import is a `ValueError` naming that field."""
    module, _, attr = path.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if field is None:
        return getattr(importlib.import_module(module), attr)
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"`{field}`: cannot import {path!r} ({type(e).__name__}: {e}).") from e


def _arithmetic(args: TaskArguments, system_prompt: str | None):
    """Training, held-out and warm-start rows of the arithmetic tasks: held-out problems are distinct expressions,
    and no training or warm-start row has a held-out expression. Each set is the first rows of its seed's draw that
    pass, so a draw without such repeats is the generator's own (the recorded datasets stay what they were)."""
    from .envs.calculator import make_arithmetic_tasks

    def draw(n: int, seed: int, excluded: frozenset[str], distinct: bool = False) -> Dataset:
        size, found = n, -1
        while True:  # the generator is sequential: a longer draw of a seed starts with the shorter one
            rows, seen = [], set(excluded)
            for row in make_arithmetic_tasks(size, seed, args.task_difficulty):
                if row["expression"] not in seen and len(rows) < n:
                    rows.append(row)
                    if distinct:
                        seen.add(row["expression"])
            if len(rows) == n:
                break
            # A doubling that found nothing new: the difficulty's problems are (nearly) all drawn.
            if size >= 64 * n + 1024 or (size >= 4 * n + 1024 and len(rows) == found):
                raise ValueError(
                    f"Drew {size} `task_difficulty: {args.task_difficulty}` problems from seed {seed} and found only "
                    f"{len(rows)} of the {n} needed that are not held-out problems (held out: not repeats either): "
                    "lower `num_eval_tasks` or use a harder `task_difficulty`."
                )
            size, found = 2 * size, len(rows)
        if system_prompt is not None:
            for row in rows:
                row["prompt"][0] = {"role": "system", "content": system_prompt}
        return Dataset.from_list(rows)

    evaluation = draw(args.num_eval_tasks, args.task_seed + 1, frozenset(), distinct=True)
    heldout = frozenset(row["expression"] for row in evaluation)
    warmstart = draw(args.warmstart_steps * args.warmstart_batch_size, args.task_seed + 2, heldout)
    return draw(args.num_train_tasks, args.task_seed, heldout), evaluation, warmstart


def build_task(args: TaskArguments) -> Task:
    """Build the dataset, environment factory and reward functions of a task."""
    extra = [import_object(p, "extra_reward_funcs") for p in args.extra_reward_funcs or []]
    task = _build_task(args, extra)
    _check_reward_environments(task, extra)
    return task


def _check_reward_environments(task: Task, extra: list[Callable]) -> None:
    """An extra reward that reads one environment class (its `environment_class` attribute, e.g. the calculator's
    `tool_use_reward`) fails here, naming the field, when the task's environments are another class: otherwise it would
    fail at the first reward, after the model loaded."""
    factory = task.environment_factory
    factories = list(factory.values()) if isinstance(factory, dict) else [factory]
    classes = [getattr(f, "func", f) for f in factories]  # a functools.partial names its class in `func`
    for reward in extra:
        needed = getattr(reward, "environment_class", None)
        if needed is None:
            continue
        wrong = [c for c in classes if not (isinstance(c, type) and issubclass(c, needed))]
        if wrong:
            names = ", ".join(getattr(c, "__name__", repr(c)) for c in wrong)
            raise ValueError(
                f"`extra_reward_funcs`: `{reward.__name__}` reads the calls of a `{needed.__name__}`, but this task's "
                f"environments are {names}: use it with `task: calculator`, or give a reward for this task."
            )


def _build_task(args: TaskArguments, extra: list[Callable]) -> Task:
    if args.task == "calculator":
        from .envs.calculator import SYSTEM_PROMPT, CalculatorEnv, answer_reward

        train, evaluation, warmstart = _arithmetic(args, None)
        options = {"tool_name": "calculate", "argument": "expression"}
        return Task(
            train,
            evaluation,
            CalculatorEnv,
            [answer_reward, *extra],
            warmstart_options=options,
            warmstart_dataset=warmstart,
            system_prompt=SYSTEM_PROMPT,
        )
    if args.task == "python":
        from functools import partial

        from .envs.calculator import answer_reward
        from .envs.python_sandbox import PythonSandboxEnv
        from .envs.sandbox_isolation import resolve_isolation

        resolve_isolation(args.sandbox_isolation)  # a machine the policy refuses fails now, before any model loads
        train, evaluation, warmstart = _arithmetic(args, PYTHON_SYSTEM_PROMPT)
        options = {"tool_name": "python", "argument": "code", "argument_template": "print({expression})"}
        return Task(
            train,
            evaluation,
            partial(PythonSandboxEnv, timeout=args.sandbox_timeout, isolation=args.sandbox_isolation),
            [answer_reward, *extra],
            warmstart_options=options,
            warmstart_dataset=warmstart,
            system_prompt=PYTHON_SYSTEM_PROMPT,
        )
    if args.task == "textworld":
        from functools import partial

        from .envs.textworld import TextWorldToolEnv
        from .envs.textworld_traces import make_level_rows, textworld_level_traces

        # The environment acts only on `act` tool calls, so the prompts ask for RLVCR steps whose action is that call
        # (`rlvcr_action_tag: tool_call`), not for `<action>` blocks; the warm start shows solved episodes so written.
        # Training and warm-start rows come from the training worlds, held-out rows from the held-out ones (each a
        # different world): a fixed split (`split_worlds`), so no seed's held-out world is another seed's training one.
        def rows(n: int, seed: int, split: str) -> Dataset:
            return Dataset.from_list(
                make_level_rows(n, seed, args.textworld_max_plan_steps, split, args.textworld_heldout_fraction)
            )

        return Task(
            rows(args.num_train_tasks, args.task_seed, "train"),
            rows(args.num_eval_tasks, args.task_seed + 1, "heldout"),
            TextWorldToolEnv,
            list(extra),
            warmstart_dataset=rows(args.warmstart_steps * args.warmstart_batch_size, args.task_seed + 2, "train"),
            make_traces=partial(textworld_level_traces, seed=args.task_seed),
            # Traces of ~1-1.5k tokens: one per micro-batch. Their activations (~2-3 GB in float32) fit without
            # recomputation, which would make each step ~30 % slower.
            warmstart_trainer_options={"micro_batch_size": 1},
        )
    if args.task == "logsearch":
        from functools import partial

        from .envs.calculator import answer_reward
        from .envs.log_search import LogSearchEnv, log_search_traces, make_log_rows

        deletion = args.logsearch_context_deletion
        return Task(
            Dataset.from_list(make_log_rows(args.num_train_tasks, args.task_seed, context_deletion=deletion)),
            Dataset.from_list(make_log_rows(args.num_eval_tasks, args.task_seed + 1, context_deletion=deletion)),
            LogSearchEnv,
            [answer_reward, *extra],
            # Each row gives one SFT example per segment (3 for 2 files; 1 without deletion).
            warmstart_dataset=Dataset.from_list(
                make_log_rows(
                    args.warmstart_steps * args.warmstart_batch_size, args.task_seed + 2, context_deletion=deletion
                )
            ),
            make_traces=partial(log_search_traces, context_deletion=deletion),
        )
    if args.task == "bfcl":
        return _bfcl(args, extra)
    return import_object(args.task, "task")(args)


def _bfcl(args: TaskArguments, extra: list[Callable]) -> Task:
    """BFCL multi-turn tasks: training and held-out scenarios, one environment class per tool group (TRL's
    multi-environment mode), the official checker's verdict as the reward (docs/bfcl.md)."""
    from functools import partial

    from .envs.bfcl.dataset import environment_factories, make_rows, sample_rows, select_tasks, split_scenarios
    from .envs.bfcl.reward import bfcl_reward, bfcl_turn_credit
    from .envs.bfcl.traces import ground_truth_traces

    train_ids, heldout_ids = split_scenarios(args.bfcl_heldout_fraction, args.task_seed)

    def rows(scenarios, limit, seed):
        tasks = select_tasks(args.bfcl_categories, classes=args.bfcl_classes, scenarios=scenarios)
        return sample_rows(make_rows(tasks, hide_excluded=args.bfcl_hide_excluded), limit, seed)

    train = rows(train_ids, args.num_train_tasks, args.task_seed)
    evaluation = rows(heldout_ids, args.num_eval_tasks, args.task_seed + 1)
    if not train:
        raise ValueError(
            "No BFCL training task matches `bfcl_categories` and `bfcl_classes` outside the held-out scenarios "
            f"(`bfcl_heldout_fraction` = {args.bfcl_heldout_fraction:g}"
            f"{': every scenario is held out' if args.bfcl_heldout_fraction >= 1 else ''})."
        )
    factories = environment_factories(train + evaluation, hide_excluded=args.bfcl_hide_excluded)
    rewards = [bfcl_reward, *([bfcl_turn_credit] if args.bfcl_turn_credit else []), *extra]
    return Task(
        Dataset.from_list(train),
        Dataset.from_list(evaluation) if evaluation else None,
        factories,
        rewards,
        # Warm start: the ground-truth conversations of the training tasks (never the held-out scenarios).
        warmstart_dataset=Dataset.from_list(train),
        make_traces=partial(ground_truth_traces, hide_excluded=args.bfcl_hide_excluded),
        # Traces of 3-6k tokens: one per micro-batch, activations recomputed (the attention of a 4k-token trace
        # takes over 0.5 GB per layer otherwise).
        warmstart_trainer_options={"micro_batch_size": 1, "gradient_checkpointing": True},
    )
