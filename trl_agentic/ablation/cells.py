"""Running the ablation's cells: one JSON per (task, seed, arm), resumable, each with its commit and settings.

A cell is computed once and committed (docs/ablation-cells/); an existing one is read back, and refused when its
settings differ from this run's. Adapters and trainer output go under `out` (not committed): a seed's warm-start
adapter missing there (a new machine) is trained again and must reproduce the recorded warm-start losses, else the run
stops, because every arm of a seed that names that warm start (`Arm.warm_start`) starts from that one adapter.

Every cell records the SHA of the pre-registration it ran under (the registered block of docs/ablation.md); without a
registered block nothing runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import string
import time
from pathlib import Path

from ..tasks import problem_key  # noqa: F401  (the ablation's name for it)
from . import design
from .compute import TokenPasses, stop_at_token_passes
from .design import Arm, Task

ROOT = Path(__file__).resolve().parents[2]
REGISTERED_START = "<!-- preregistration:start -->"
REGISTERED_END = "<!-- preregistration:end -->"
# Arm settings a cell derives from another cell (`_compute`): the equal-compute budget, the keep rate.
DERIVED_ARM_SETTINGS = {"token_pass_budget", "row_selection_fraction"}
# Settings of the harness itself (not of a trainer), overridable with `--set` for tests and smoke runs.
PLAN_KEYS = (
    "ablation_eval_samples",
    "ablation_spread_prompts",
    "ablation_calibration_steps",
    "ablation_lr_ladder",
    "ablation_validation_problems",
    "ablation_validation_offset",
)


# ------------------------------------------------------------------------------------------------ settings


def registered_block(doc: Path) -> str:
    """The pre-registration block of `doc` (markers included); raises when there is none."""
    text = doc.read_text() if doc.exists() else ""
    start, end = text.find(REGISTERED_START), text.find(REGISTERED_END)
    if start < 0 or end < start:
        raise RuntimeError(
            f"{doc} has no pre-registration ({REGISTERED_START} ... {REGISTERED_END}): the design, seeds, metrics and "
            "decision rule are registered and committed before the first cell runs."
        )
    return text[start : end + len(REGISTERED_END)]


def registration_sha(doc: Path) -> str:
    return hashlib.sha256(registered_block(doc).encode()).hexdigest()[:12]


def plan(task: Task, overrides: dict) -> dict:
    """The harness settings of a task: evaluation samples, spread prompts, calibration ladder."""
    return {
        "ablation_eval_samples": overrides.get("ablation_eval_samples", task.evaluation.samples),
        "ablation_spread_prompts": overrides.get("ablation_spread_prompts", task.evaluation.spread_prompts),
        "ablation_calibration_steps": list(overrides.get("ablation_calibration_steps", task.calibration_steps)),
    }


def lr_plan(task: Task, overrides: dict) -> tuple[list[float], int, int]:
    """The learning-rate ladder of a task, its number of validation problems and their offset (amendment 2; not in
    `plan`, so not in the shared settings' hash: the learning rate is an arm setting of every RL cell)."""
    e = task.evaluation
    ladder = overrides.get("ablation_lr_ladder", task.lr_ladder)
    problems = overrides.get("ablation_validation_problems", e.validation_problems)
    offset = overrides.get("ablation_validation_offset", e.validation_offset)
    return [float(lr) for lr in ladder], int(problems), int(offset)


def shared_settings(task: Task, seed: int, overrides: dict, warmstart_steps: int | None) -> dict:
    """Everything every arm of (task, seed) shares: the task's settings, `--set` overrides, the seed and the warm
    start's length."""
    settings = {**task.settings, **{k: v for k, v in overrides.items() if k not in PLAN_KEYS}, "seed": seed}
    if warmstart_steps is not None:
        settings["warmstart_steps"] = warmstart_steps
    return settings


def fingerprint(settings: dict, plan_: dict) -> str:
    text = json.dumps({"design": design.DESIGN, **settings, **plan_}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _parse(settings: dict, trl: bool = False):
    """`(TaskArguments, config, ModelConfig)`; `trl`: TRL's own `GRPOConfig`, which drops every agentic field."""
    from transformers import HfArgumentParser
    from trl import GRPOConfig, ModelConfig

    from ..config import AgenticGRPOConfig
    from ..tasks import TaskArguments

    parser = HfArgumentParser((TaskArguments, GRPOConfig if trl else AgenticGRPOConfig, ModelConfig))
    # Defaults that changed since the arms were registered are pinned to the registered ones (an arm's own wins).
    return parser.parse_dict({**design.REGISTERED_DEFAULTS, **settings}, allow_extra_keys=trl)


def cell_path(cells: Path, task: str, seed: int, name: str) -> Path:
    return cells / task / f"seed{seed}" / f"{name}.json"


def calibration_path(cells: Path, task: str, steps: int) -> Path:
    return cells / task / "calibration" / f"warmstart-{steps}.json"


def lr_path(cells: Path, task: str, learning_rate: float, arm: str) -> Path:
    """A rung's cell, named by the arm it trains (the task's `lr_ladder_arm`)."""
    return cells / task / "lr-ladder" / f"{arm}-{learning_rate:g}.json"


# ------------------------------------------------------------------------------------------------ machine


def _commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# A recomputed budget source (the same arm and seed; deterministic, so equal unless another host's arithmetic sent a
# trajectory elsewhere) still stands for the budget it gave within this.
BUDGET_MATCH = 0.05


def check_derived(cell: dict, budget: dict | None = None, keep_rate: dict | None = None) -> None:
    """A recorded cell whose compute budget (`budget`: the cell it came from) or keep rate (`keep_rate`) was derived
    from another cell must still match that cell: a source computed again would otherwise leave this arm compared with
    a run it was not derived from."""
    name = f"`{cell.get('arm')}` (seed {cell.get('seed')})"
    settings = cell.get("arm_settings", {})
    if budget is not None:
        spent, source = settings.get("token_pass_budget"), (budget.get("token_passes") or {}).get("total")
        if spent is None or source is None or abs(spent - source) > BUDGET_MATCH * source:
            raise RuntimeError(
                f"{name} was stopped at a budget of {spent} token passes, but `{budget.get('arm')}` now records "
                f"{source}: its cell was computed again. Delete this cell too, so that it gets the new budget."
            )
    if keep_rate is not None and settings.get("row_selection_fraction") != round(keep_rate.get("keep_rate", -1), 4):
        raise RuntimeError(
            f"{name} kept a fraction {settings.get('row_selection_fraction')} of rows, but `{keep_rate.get('arm')}` "
            f"now records a keep rate of {keep_rate.get('keep_rate')}: its cell was computed again. Delete this cell "
            "too, so that it gets the new rate."
        )


def has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def machine() -> dict:
    """Where and when a cell ran: wall times compare only on like machines and loads."""
    import platform

    import torch

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    cpu = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor()
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": _commit(),
        "host": platform.node(),
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "load_average_before": os.getloadavg()[0],
    }


# ------------------------------------------------------------------------------------------------ problems


def validation_rows(task_args, eval_keys: set[str]):
    """Validation problems: the task built from `task_seed + 10`, its held-out split, the held-out problems of the
    arms (`eval_keys`) removed (`trl_agentic.tasks.validation_rows`). TracIn's validation gradient and the
    learning-rate ladder read them; no verdict does."""
    from ..tasks import validation_rows as rows

    return rows(task_args, eval_keys)


def validation_slice(task_args, eval_keys: set[str], offset: int, count: int) -> list:
    """Validation problems `offset + 1` to `offset + count` (`validation_rows`): a ladder rung's, checked by the rule."""
    return list(validation_rows(task_args, eval_keys))[offset : offset + count]


def without_problems(task, keys: set[str]):
    """The task with the problems of `keys` (the held-out ones) removed from its training and warm-start sets."""

    def keep(dataset):
        return None if dataset is None else dataset.filter(lambda row: problem_key(row) not in keys)

    return dataclasses.replace(
        task, train_dataset=keep(task.train_dataset), warmstart_dataset=keep(task.warmstart_dataset)
    )


def expression_form(expression: str) -> str:
    """The shape of a calculator expression, its numbers named in order: `(12 * 40 - 7) / 3` gives `(a * b - c) / d`."""
    names = iter(string.ascii_lowercase)
    return re.sub(r"\d+(?:\.\d+)?", lambda _: next(names, "n"), expression)


def held_out_forms(settings: dict) -> tuple[list[str], list[str] | None]:
    """`(keys, forms)` of the held-out problems of a cell's `settings`, in the order `_compute` scores them
    (`build_task(...).eval_dataset`): each one's `problem_key` and form (`expression_form`; `None` for a task whose
    problems have no expression, the log search)."""
    from transformers import HfArgumentParser

    from ..tasks import TaskArguments

    (task_args,) = HfArgumentParser(TaskArguments).parse_dict(settings, allow_extra_keys=True)
    keys, forms = _held_out_forms(json.dumps(dataclasses.asdict(task_args), sort_keys=True, default=str))
    return list(keys), None if forms is None else list(forms)


@functools.cache  # one build per task's settings, not per cell
def _held_out_forms(task_args_json: str) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    from ..tasks import TaskArguments, build_task

    rows = build_task(TaskArguments(**json.loads(task_args_json))).eval_dataset
    keys = tuple(problem_key(r) for r in rows)
    if "expression" not in rows.column_names:
        return keys, None
    return keys, tuple(expression_form(e) for e in rows["expression"])


def forms_by_seed(cells: dict) -> dict:
    """`{(task, seed): forms}` (`held_out_forms`) of every (task, seed) with a cell, for `report.render_results`.
    Raises when a cell was scored on other problems than the ones its forms are read from: another number of them,
    or, for cells that record their `problems` (from `5f500de` on), other ones or another order."""
    built = {}
    for (task, seed, _), cell in sorted(cells.items()):
        if (task, seed) not in built and cell.get("settings"):
            built[task, seed] = held_out_forms(cell["settings"])
    for (task, seed, arm), cell in cells.items():
        if (task, seed) not in built:
            continue
        keys, _ = built[task, seed]
        if len(cell["sampled"]) != len(keys) or cell.get("problems", keys) != keys:
            raise RuntimeError(
                f"{task} seed {seed} `{arm}` was scored on {len(cell['sampled'])} problems other than the seed's "
                f"{len(keys)} held-out ones (in their order): its settings are not the seed's."
            )
    return {k: forms for k, (_, forms) in built.items() if forms is not None}


# ------------------------------------------------------------------------------------------------ evaluation


def _autocast(bf16: bool):
    import contextlib

    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _rollouts(model, tokenizer, task, args, rows, *, temperature: float, seed: int):
    from ..evaluation import evaluate_policy

    with _autocast(args.bf16):
        return evaluate_policy(
            model,
            tokenizer,
            rows,
            environment_factory=task.environment_factory,
            reward_funcs=task.reward_funcs[:1],
            max_completion_length=args.max_completion_length,
            max_tool_calling_iterations=args.max_tool_calling_iterations or 3,
            batch_size=16,
            temperature=temperature,
            progress=False,
            seed=seed,
            context_snapshots=getattr(args, "enable_context_snapshots", False),
            context_stub_text=getattr(args, "context_stub_text", "[deleted]"),
        )


def evaluate(model, tokenizer, task, args, rows, samples: int, seed: int) -> dict:
    """Greedy success per problem, and the mean success of `samples` samples per problem at the training temperature
    (every arm alike: our loop's evaluation semantics, a malformed call shown as an error), with their costs."""
    started = time.perf_counter()
    greedy = _rollouts(model, tokenizer, task, args, rows, temperature=0.0, seed=seed)
    greedy_seconds = time.perf_counter() - started
    started = time.perf_counter()
    expanded = [row for row in rows for _ in range(samples)]
    sampled = _rollouts(model, tokenizer, task, args, expanded, temperature=args.temperature, seed=seed)
    values = [float(r["rewards"][0]) for r in sampled.records]
    return {
        "greedy": [float(r["rewards"][0]) for r in greedy.records],
        "sampled": [sum(values[k * samples : (k + 1) * samples]) / samples for k in range(len(rows))],
        "eval_samples": samples,
        "greedy_seconds": greedy_seconds,
        "sampled_seconds": time.perf_counter() - started,
        "eval_metrics": {k: v for k, v in greedy.metrics.items() if k != "seconds"},
        "sampled_peak_context_tokens": sampled.metrics.get("mean_peak_context_tokens"),
        "sampled_completion_tokens": sampled.metrics.get("mean_completion_tokens"),
    }


def spread_check(model, tokenizer, task, args, rows, seed: int) -> dict:
    """The share of GRPO groups the policy leaves with a reward spread: each of `rows` (training prompts) sampled
    `num_generations` times at the training temperature, as a GRPO step would."""
    groups = args.num_generations
    expanded = [row for row in rows for _ in range(groups)]
    result = _rollouts(model, tokenizer, task, args, expanded, temperature=args.temperature, seed=seed)
    rewards = [float(r["rewards"][0]) for r in result.records]
    spread = sum(len(set(rewards[k * groups : (k + 1) * groups])) > 1 for k in range(len(rows)))
    return {
        "prompts": len(rows),
        "generations": groups,
        "groups_with_spread": spread,
        "fraction": spread / len(rows) if rows else 0.0,
        "mean_success": sum(rewards) / len(rewards) if rewards else 0.0,
    }


# ------------------------------------------------------------------------------------------------ cells


@dataclasses.dataclass
class Context:
    """Where a run reads and writes, and what it overrides."""

    out: Path
    cells: Path
    doc: Path
    overrides: dict
    allow_other_cpu: bool = False
    # Warm starts (adapter paths: the log search has two a seed) that, trained again in this run, failed their loss
    # check: the arms that start from them are skipped rather than trained again for nothing.
    unreproduced: set = dataclasses.field(default_factory=set)


def _read(path: Path, settings_hash: str, arm_settings: dict) -> dict | None:
    if not path.exists():
        return None
    cell = json.loads(path.read_text())
    if cell.get("settings_hash") != settings_hash:
        raise RuntimeError(
            f"{path} was computed with other settings ({cell.get('settings')}) than this run's: mixing them would "
            "compare different experiments. Delete it, or write this run's cells elsewhere (`--cells`)."
        )
    recorded = {k: v for k, v in cell.get("arm_settings", {}).items() if k in arm_settings}
    # Beyond the asked-for settings a cell may record only what `_compute` derives (a ladder rung's RL seed is not).
    extra = set(cell.get("arm_settings", {})) - set(arm_settings) - DERIVED_ARM_SETTINGS
    if (
        recorded != {k: v for k, v in arm_settings.items() if k in recorded}
        or set(arm_settings) - set(recorded)
        or extra
    ):
        raise RuntimeError(f"{path} ran with arm settings {cell.get('arm_settings')}, not {arm_settings}.")
    return cell


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)  # atomic: an interrupted write never leaves a cell that breaks the resume


def warmstart_steps(task: Task, ctx: Context) -> tuple[int, bool, str]:
    """The task's warm-start length: fixed, or chosen by the calibration ladder (run first when incomplete)."""
    p = plan(task, ctx.overrides)
    ladder = p["ablation_calibration_steps"]
    if not ladder:
        steps = (
            ctx.overrides["warmstart_steps"]
            if "warmstart_steps" in ctx.overrides
            else task.settings.get("warmstart_steps")
        )
        if steps is None:
            raise ValueError(f"{task.name} has no calibration ladder and no `warmstart_steps`.")
        return steps, True, f"{steps} steps (fixed)"
    measured = {}
    for steps in sorted(ladder):  # in increasing steps, stopping once the rule has decided (amendment 1)
        cell = calibration_cell(task, steps, ctx)
        measured[steps] = design.Rung.of_cell(steps, cell)
        decision = design.ladder_decision(measured, ladder)
        if decision is not None:
            return decision
    raise AssertionError("a whole ladder always decides")  # ladder_decision returns a choice for a whole ladder


def calibration_cell(task: Task, steps: int, ctx: Context) -> dict:
    """One rung of the calibration ladder: a seed-0 warm start of `steps` steps, evaluated and spread-checked. It is
    the seed-0 warm-start cell when the ladder chooses it (same settings, same adapter)."""
    path = calibration_path(ctx.cells, task.name, steps)
    settings = shared_settings(task, 0, ctx.overrides, steps)
    p = plan(task, ctx.overrides)
    cell = _read(path, fingerprint(settings, p), {})
    if cell is None:
        cell = _compute(task, 0, design.arm(task.name, "warmstart"), settings, p, ctx, path, {})
    return cell


def learning_rate(task: Task, ctx: Context) -> tuple[float, str] | None:
    """The RL learning rate chosen by the task's learning-rate ladder (its rungs run first when missing); `None`
    without a ladder (the task's `learning_rate` applies). Raises when the rungs were not judged on the same
    validation problems, the planned ones."""
    ladder, problems, offset = lr_plan(task, ctx.overrides)
    if not ladder:
        return None
    cells = [lr_cell(task, lr, ctx) for lr in ladder]
    judged = {
        (c.get("validation", {}).get("offset"), tuple(c.get("validation", {}).get("problems", ()))) for c in cells
    }
    if judged != {(offset, tuple(planned_validation(task, ctx, offset, problems)))}:
        raise RuntimeError(
            f"The learning-rate ladder's rungs ({', '.join(str(lr_path(ctx.cells, task.name, lr, task.lr_ladder_arm)) for lr in ladder)}) "
            f"were not all judged on the planned {problems} validation problems from offset {offset}."
        )
    return design.choose_learning_rate([design.LrRung.of_cell(c) for c in cells])


def planned_validation(task: Task, ctx: Context, offset: int, count: int) -> list[str]:
    """The keys of the validation problems the ladder's rungs must have been judged on."""
    from ..tasks import build_task

    steps, _, _ = warmstart_steps(task, ctx)
    task_args = _parse({**shared_settings(task, 0, ctx.overrides, steps), "output_dir": str(ctx.out)})[0]
    eval_keys = {problem_key(r) for r in build_task(task_args).eval_dataset}
    return [problem_key(r) for r in validation_slice(task_args, eval_keys, offset, count)]


def lr_cell(task: Task, lr: float, ctx: Context) -> dict:
    """One rung of the learning-rate ladder: the task's `lr_ladder_arm` trained at `lr` from seed 0's warm start of
    that arm with the ladder's own RL seed, evaluated on the validation problems only (the rule's; never on the
    held-out ones)."""
    steps, _, _ = warmstart_steps(task, ctx)
    settings = shared_settings(task, 0, ctx.overrides, steps)
    p = plan(task, ctx.overrides)
    arm_ = design.arm(task.name, task.lr_ladder_arm)
    arm_settings = {**arm_.overrides, "learning_rate": lr, "seed": design.LR_LADDER_RL_SEED}
    path = lr_path(ctx.cells, task.name, lr, arm_.name)
    cell = _read(path, fingerprint(settings, p), arm_settings)
    if cell is None:
        _, problems, offset = lr_plan(task, ctx.overrides)
        cell = _compute(task, 0, arm_, settings, p, ctx, path, arm_settings, (offset, problems), held_out=False)
    return cell


def run_cell(task: Task, seed: int, arm_: Arm, ctx: Context) -> dict:
    """Run one (task, seed, arm), or read it back; returns the cell."""
    steps, _, _ = warmstart_steps(task, ctx)
    settings = shared_settings(task, seed, ctx.overrides, steps)
    p = plan(task, ctx.overrides)
    arm_settings = dict(arm_.overrides)
    chosen = learning_rate(task, ctx) if arm_.trainer != "warmstart" else None
    if chosen is not None:
        arm_settings["learning_rate"] = chosen[0]
    path = cell_path(ctx.cells, task.name, seed, arm_.name)
    cell = _read(path, fingerprint(settings, p), arm_settings)
    if cell is not None:
        sources = {"budget": arm_.compute_budget_from, "keep_rate": arm_.keep_rate_from}
        paths = {k: cell_path(ctx.cells, task.name, seed, n) for k, n in sources.items() if n is not None}
        check_derived(cell, **{k: json.loads(q.read_text()) for k, q in paths.items() if q.exists()})
        return cell
    if arm_.name == "warmstart" and seed == 0 and p["ablation_calibration_steps"]:
        cell = calibration_cell(task, steps, ctx)  # the chosen rung is seed 0's warm start
        _write(path, cell)
        return cell
    return _compute(task, seed, arm_, settings, p, ctx, path, arm_settings)


def _compute(
    task: Task,
    seed: int,
    arm_: Arm,
    settings: dict,
    p: dict,
    ctx: Context,
    path: Path,
    arm_settings: dict,
    validation: tuple[int, int] | None = None,
    held_out: bool = True,
) -> dict:
    """Train and evaluate one cell and write it. `validation`: `(offset, count)` of validation problems to evaluate
    on too; `held_out=False`: not on the held-out problems (a ladder rung)."""
    import torch

    from ..models import resolve_model_path
    from ..tasks import build_task

    if settings.get("bf16") and not has_avx512_bf16():
        raise RuntimeError("The registered design runs in bfloat16 autocast, which needs a CPU with AVX512-BF16.")
    settings_hash = fingerprint(settings, p)
    arm_settings = dict(arm_settings)
    deps = {}
    if arm_.compute_budget_from:
        deps["budget"] = run_cell(task, seed, design.arm(task.name, arm_.compute_budget_from), ctx)
        passes = (deps["budget"].get("token_passes") or {}).get("total")
        if not passes:
            raise RuntimeError(
                f"`{arm_.compute_budget_from}` (seed {seed}) was recorded without token passes (before amendment 3): "
                f"`{arm_.name}`'s budget is unknown. Delete that cell so that it is computed again with the count."
            )
        arm_settings["token_pass_budget"] = passes
    if arm_.keep_rate_from:
        source = run_cell(task, seed, design.arm(task.name, arm_.keep_rate_from), ctx)
        arm_settings["row_selection_fraction"] = round(source["keep_rate"], 4)
    warm = None
    # The warm start this arm is (a `warmstart` arm) or trains from (`arm_.warm_start`, amendment 4).
    warm_name = arm_.name if arm_.trainer == "warmstart" else arm_.warm_start
    if arm_.trainer != "warmstart":
        warm = run_cell(task, seed, design.arm(task.name, warm_name), ctx)
    full = {**settings, **{k: v for k, v in arm_settings.items() if k != "token_pass_budget"}}
    full["output_dir"] = str(ctx.out / task.name / f"seed{seed}" / f"{path.stem}-run")
    task_args, args, model_args = _parse(full, trl=arm_.trainer == "trl")
    built = build_task(task_args)
    eval_keys = {problem_key(r) for r in built.eval_dataset}
    built = without_problems(built, eval_keys)  # generators of other seeds can still draw a held-out problem
    rows = list(built.eval_dataset)
    model_path = resolve_model_path(model_args.model_name_or_path)
    dtype = getattr(torch, model_args.dtype) if model_args.dtype not in (None, "auto") else None
    # Named by the shared settings: an adapter of another configuration is never reused.
    adapter = ctx.out / task.name / f"seed{seed}" / f"{warm_name}-adapter-{settings_hash}"
    record: dict = {
        "design": design.DESIGN,
        "task": task.name,
        "seed": seed,
        "arm": arm_.name,
        "trainer": arm_.trainer,
        "settings": settings,
        "settings_hash": settings_hash,
        "plan": p,
        "arm_settings": arm_settings,
        "preregistration": registration_sha(ctx.doc),
        **machine(),
    }
    if warm is not None and not (adapter / "adapter_config.json").exists():
        if not ctx.allow_other_cpu:  # before 25 minutes of training that another CPU kind has not reproduced
            check_warm_start_host(warm, adapter.parent, record["cpu"])
        if adapter in ctx.unreproduced:
            raise WarmStartMismatchError(f"The warm start {adapter} already failed its loss check in this run.")
        try:
            _warm_start(model_path, dtype, built, task_args, model_args, args, seed, adapter, warm)
        except WarmStartMismatchError:
            ctx.unreproduced.add(adapter)
            raise
    started = time.perf_counter()
    # TRL's config has no agentic field; the warm start is evaluated as it was trained (the log search's deletions).
    eval_args = _parse({**full, **arm_.eval_overrides})[1] if arm_.trainer != "agentic" else args
    if arm_.trainer == "warmstart":
        result, tokenizer = _warm_start(model_path, dtype, built, task_args, model_args, args, seed, adapter, None)
        model = result.model
        lengths = [n for n, _ in result.completion_tokens]
        faulty = [n for n, bad in result.completion_tokens if bad]
        budget = args.max_completion_length  # the task's (per segment with snapshots): every arm's at most
        record.update(
            train_seconds=result.seconds,
            warmstart_steps=task_args.warmstart_steps,
            warmstart_losses=[round(float(h["loss"]), 4) for h in result.log_history if "loss" in h],
            trace_tokens={
                "max": max(lengths, default=0),
                "max_faulty": max(faulty, default=0),
                "max_clean": max((n for n, bad in result.completion_tokens if not bad), default=0),
                "budget": budget,
            },
        )
        if record["trace_tokens"]["max"] > budget:
            raise RuntimeError(
                f"The warm start's traces need up to {record['trace_tokens']['max']} completion tokens and the budget "
                f"(`max_completion_length`) is {budget}: a demonstrated behaviour could never score. Fit the budget."
            )
        spread_rows = list(built.train_dataset)[: p["ablation_spread_prompts"]]
        record["spread_check"] = spread_check(model, tokenizer, built, eval_args, spread_rows, seed)
    else:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", truncation_side="left")
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        model = PeftModel.from_pretrained(base, str(adapter), is_trainable=True)
        trained = _train(arm_, model, tokenizer, built, task_args, args, eval_keys, arm_settings)
        model = trained.pop("model")
        record.update(trained)
        # Kept (not committed) so that a later question about a trained policy needs no training again.
        model.save_pretrained(ctx.out / task.name / f"seed{seed}" / f"{path.stem}-adapter-{settings_hash}")
        if "budget" in deps:
            record["compute_budget"] = {
                k: deps["budget"].get(k) for k in ("token_passes", "train_seconds", "commit", "date")
            }
    if held_out:
        record.update(evaluate(model, tokenizer, built, eval_args, rows, p["ablation_eval_samples"], seed))
        record["problems"] = [problem_key(r) for r in rows]  # what `sampled[i]` and `greedy[i]` were scored on
    if validation is not None:
        offset, count = validation
        validation_set = validation_slice(task_args, eval_keys, offset, count)
        if len(validation_set) < count:
            raise RuntimeError(f"Only {len(validation_set)} validation problems from offset {offset}, not {count}.")
        record["validation"] = evaluate(
            model, tokenizer, built, eval_args, validation_set, p["ablation_eval_samples"], seed
        )
        record["validation"].update(offset=offset, problems=[problem_key(r) for r in validation_set])
    record["seconds"] = time.perf_counter() - started
    record["load_average_after"] = os.getloadavg()[0]
    _write(path, record)
    return record


def _warm_start(model_path, dtype, task, task_args, model_args, args, seed, adapter: Path, recorded: dict | None):
    """The seed's SFT warm start, saved to `adapter`; with `recorded` (the seed's warm-start cell), its losses must be
    the recorded ones."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import get_peft_config

    from ..warmstart import run_task_warmstart

    set_seed(seed)  # the LoRA initialisation too: a new machine must get the same adapter
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", truncation_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    result = run_task_warmstart(
        model,
        tokenizer,
        task,
        task_args,
        peft_config=get_peft_config(model_args),
        output_dir=str(adapter) + "-run",
        seed=seed,
        use_cpu=args.use_cpu,
        bf16=args.bf16,
        compact_progress=False,
    )
    if recorded is not None:
        losses = [round(float(h["loss"]), 4) for h in result.log_history if "loss" in h]
        check_warm_start_losses(losses, recorded, adapter.parent, machine()["cpu"])
    result.model.save_pretrained(adapter)
    return result, tokenizer


class WarmStartHostError(RuntimeError):
    """The seed's warm start was recorded on another CPU kind, so training it again here would not reproduce it."""


class WarmStartMismatchError(RuntimeError):
    """The seed's warm start, trained again, did not give its recorded losses: its arms cannot be paired."""


def check_warm_start_host(recorded: dict, seed_dir: Path, cpu: str) -> None:
    """Raise [`WarmStartHostError`] when the seed's warm-start cell names a CPU kind other than `cpu`.

    The arms of a seed train from its warm start, which is not kept between sessions and so is trained again; bfloat16
    kernels round differently on another CPU kind (seed 5's AMD EPYC cell did not reproduce on an Intel Xeon, with any
    ISA cap tried), and `check_warm_start_losses` would stop the run only after the training.
    """
    where = recorded.get("cpu")
    if where and where != cpu:
        raise WarmStartHostError(
            f"The warm start of {seed_dir} was recorded on `{where}` and this host is `{cpu}`: trained again here it "
            "would not give the recorded losses, so its arms would not start from the same adapter. Run this seed on "
            "a host of the recorded kind, pass `--allow-other-cpu` to train it and let the loss check decide, or "
            "delete that seed's cells to run it again."
        )


def check_warm_start_losses(losses: list[float], recorded: dict, seed_dir: Path, cpu: str) -> None:
    """Raise [`WarmStartMismatchError`] unless a warm start trained again gave the recorded cell's losses (within 1e-3).

    Another CPU kind rounds differently (seed 5's cell, recorded on an AMD EPYC, did not reproduce on an Intel Xeon),
    so the error names both CPUs: the fix is then a host of the recorded kind, not deleting the seed's cells.
    """
    expected = recorded.get("warmstart_losses", [])
    if len(losses) == len(expected) and all(abs(a - b) <= 1e-3 for a, b in zip(losses, expected)):
        return
    where = recorded.get("cpu", "an unrecorded CPU")
    hint = (
        f"it was recorded on `{where}` and this host is `{cpu}`: run this seed on a host of the recorded kind, "
        if where != cpu
        else "it was recorded on this CPU kind, so something else changed: "
    )
    raise WarmStartMismatchError(
        f"The warm start of {seed_dir} trained again gave losses {losses}, not the recorded {expected}, so its arms "
        f"would not start from the same adapter; {hint}or delete that seed's cells to run it again."
    )


def _train(arm_: Arm, model, tokenizer, task, task_args, args, eval_keys: set[str], arm_settings: dict) -> dict:
    """GRPO from the warm start: TRL's trainer for `trl`, ours otherwise; stopped at a budget of token passes
    (`compute`) for the equal-compute arms. Returns the trained model and what the run recorded."""
    from trl import GRPOTrainer

    from ..trainer import AgenticGRPOTrainer

    kwargs = dict(
        model=model,
        reward_funcs=task.reward_funcs,
        args=args,
        train_dataset=task.train_dataset,
        environment_factory=task.environment_factory,
        tools=task.tools or None,
        processing_class=tokenizer,
    )
    counter = TokenPasses(model)
    budget = arm_settings.get("token_pass_budget")
    callbacks = [stop_at_token_passes(budget, counter)]  # records the count per step; stops only with a budget
    if arm_.trainer == "trl":
        trainer = GRPOTrainer(**kwargs, callbacks=callbacks)
    else:
        if getattr(args, "tracin_enabled", False):
            # Validation prompts from a seed of their own: never the problems the arms are evaluated on.
            kwargs["tracin_eval_dataset"] = validation_rows(task_args, eval_keys)
        trainer = AgenticGRPOTrainer(**kwargs, callbacks=callbacks)
    started = time.perf_counter()
    with counter:  # training only: the evaluation after it is every arm's same cost
        trainer.train()
    seconds = time.perf_counter() - started
    history = trainer.state.log_history
    steps = [h for h in history if "reward" in h]  # one generation per optimizer step (spg = accumulation steps)
    rollouts_per_step = args.generation_batch_size
    fired = {
        key: sum(h.get(key) or 0 for h in history)
        for key in (
            "rollback/attempts",
            "negatives/rows",
            "snapshots/rows",
            "tracin/num_selected",
            "selection/num_kept",
        )
    }
    ratios = [h["tracin/selected_ratio"] for h in history if h.get("tracin/selected_ratio") is not None]
    record = {
        "trainer_class": type(trainer).__name__,
        "model": trainer.accelerator.unwrap_model(trainer.model),
        "train_seconds": seconds,
        "steps_done": trainer.state.global_step,
        "rewards": [h["reward"] for h in steps],
        "spread_per_step": [1.0 - h["frac_reward_zero_std"] for h in steps if "frac_reward_zero_std" in h],
        "rollouts": rollouts_per_step * len(steps),
        # Tokens the model generated in training (TRL's `completions/mean_length`: tool results, `tool_mask` 0, are not
        # in it).
        "completion_tokens": sum(h.get("completions/mean_length", 0.0) * rollouts_per_step for h in steps),
        "num_tokens": max((h.get("num_tokens", 0) for h in history), default=0),
        "token_passes": counter.record(),  # the equal-compute unit (amendment 3, `compute`)
        "fired": fired,
    }
    if getattr(args, "tracin_enabled", False):
        record["keep_rate"] = sum(ratios) / len(ratios) if ratios else 1.0
        record["validation_rollouts"] = _validation_rollouts(args, trainer.state.global_step)
    return record


def _validation_rollouts(args, steps: int) -> int:
    from ..tracin.schedule import validation_rollout_steps, window_starts

    starts = window_starts(steps, args.steps_per_generation, args.num_iterations, args.gradient_accumulation_steps)
    due = validation_rollout_steps(starts, args.tracin_val_refresh_steps, args.tracin_val_rollout_steps)
    return len(due) * args.tracin_val_batch_size * args.tracin_val_num_generations
