"""The first ablation (issue 18), superseded by issue 37's design (`trl_agentic.ablation`); kept so that its report
re-renders from its cells: `python -m trl_agentic.ablation.first render --features rollback snapshots rlvcr tracin
--cells docs/ablation-superseded/first/cells --doc docs/ablation-superseded/first/ablation.md`. Its `run` still works
but is not what `make ablation` runs. Why it was superseded: docs/ablation.md, "Why a second design".

Its question: does each feature train a better agent than plain TRL GRPO for the same number of rollouts?

For every feature, on its live task (the config in `configs/`), and every seed:

1. **Warm start** once (SFT on the task's traces, `trl_agentic.warmstart`); the adapter is saved and every arm of the
   seed starts from it.
2. **Arms**, each from that adapter:
   - `trl`: TRL's own `GRPOTrainer` and tool loop (the control), the feature's config with every agentic field off;
   - `agentic`: `AgenticGRPOTrainer` with the feature on (same steps, same rollouts per step);
   - `sft`: more SFT on fresh traces of the task for the wall time the `agentic` arm's training took (does RL beat
     training longer on the traces?), at the GRPO arms' learning rate, constant: the SFT arm differs from the
     `agentic` arm in its training signal, not its step size. (At the warm start's peak rate, 10x the GRPO rate on
     the log search, it lost 0.3 of held-out success there; see the findings.)
3. **Held-out success** of each arm (and of the warm start itself) on the task's held-out problems, greedy, with the
   task's first reward function (`trl_agentic.evaluation.evaluate_policy`). Every arm is evaluated the same way, with
   the feature config's evaluation settings (`delete_context` offered for the log search) and our loop's semantics:
   a malformed call is shown to the model as an error and the episode goes on, where TRL's loop would end it. The
   held-out problems are removed from every training set (warm start, GRPO, TracIn validation, the SFT arm's).

"Same number of rollouts" counts training prompts × generations: rollback also regenerates failed turns, and TracIn
rolls out its validation prompts, which the `agentic` arm's wall time (and so the SFT arm's budget) includes.

One JSON per (feature, seed, arm) under `--cells` (committed: `docs/ablation-cells/`, so a run spread over several
sessions on machines that do not keep `outputs/` resumes where it stopped); an existing one is not recomputed. Adapters
and trainer output go under `--out`. A seed's warm-start adapter missing from `--out` (a new machine) is trained again
and must reproduce the recorded warm-start losses, else the run stops: every arm of a seed starts from one adapter.
Cells carry their settings; a cell of other settings is refused. `render` writes the Markdown table (means with 95 %
bootstrap intervals, seeds and the problems they share resampled together; paired differences between arms; wall
times) and a PNG of held-out success per arm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

FEATURES: dict[str, str] = {
    # feature: its live config (the `trl` arm parses it into TRL's GRPOConfig, which has no agentic field)
    "rollback": "configs/quickstart.yaml",
    "snapshots": "configs/snapshots_logsearch.yaml",
    "rlvcr": "configs/rlvcr_textworld.yaml",
    "tracin": "configs/tracin.yaml",
}
# What the ablation changes in a live config: the live configs show a feature firing in one short step; a comparison
# needs a task the arms can solve. The text world's live config has 3 tool rounds and 256 tokens, which solve ~1 in
# 128 held-out worlds (shortest plans are 2-8 steps): here, worlds of plans up to 3 steps, 4 rounds, 640 tokens.
# The log search's live warm start (12 steps) solves 0 of 128 held-out problems: the model deletes a file's result
# before writing its count down, and deletes message 3 again in the second segment instead of 7. 48 steps solve
# 11 of 16 (docs/ablation-findings.md). The text world's live config expands every step ("all", so that its one step
# shows the mechanism); the ablation measures the default, the paper's "successful_varied": in copo mode a step of a
# group without reward spread gets advantage 0 × its weight, so expanding it only costs time (~200 s a step here).
ABLATION_SETTINGS: dict[str, dict] = {
    "snapshots": {"warmstart_steps": 48},
    "rlvcr": {
        "textworld_max_plan_steps": 3,
        "max_tool_calling_iterations": 4,
        "max_completion_length": 640,
        "rlvcr_expand_steps": "successful_varied",
    },
}
ROOT = Path(__file__).resolve().parents[2]
ARMS = ("warmstart", "trl", "agentic", "sft")
PAIRS = (("agentic", "trl"), ("agentic", "sft"), ("trl", "warmstart"), ("agentic", "warmstart"))
ARM_LABELS = {
    "warmstart": "warm start only",
    "trl": "TRL GRPOTrainer (control)",
    "agentic": "AgenticGRPOTrainer, feature on",
    "sft": "more SFT, same wall time",
}


# ------------------------------------------------------------------------------------------------ statistics


def bootstrap_interval(
    values_per_seed: Sequence[Sequence[float]], *, samples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """Mean over seeds of the per-seed mean, and a percentile bootstrap interval for it.

    Seeds and problems are crossed (every seed is evaluated on the same problems, in the same order), so one resample
    draws seeds with replacement and **one** set of problems with replacement, shared by every drawn seed. Resampling
    problems independently per seed would treat a hard problem as hard for one seed only and give too narrow an
    interval.

    Args:
        values_per_seed: One list of per-problem values per seed, the same problems in the same order.
        samples: Bootstrap resamples.
        level: Coverage of the interval.
        seed: Seed of the resampling.

    Returns:
        `(mean, low, high)`.
    """
    groups = [list(v) for v in values_per_seed if len(v)]
    if not groups:
        raise ValueError("No values.")
    if len({len(g) for g in groups}) > 1:
        raise ValueError(f"Every seed must be evaluated on the same problems, got {[len(g) for g in groups]}.")
    n = len(groups[0])
    mean = sum(sum(g) / n for g in groups) / len(groups)
    rng = random.Random(seed)
    stats = []
    for _ in range(samples):
        chosen = [groups[rng.randrange(len(groups))] for _ in groups]
        problems = [rng.randrange(n) for _ in range(n)]
        stats.append(sum(sum(g[p] for p in problems) for g in chosen) / (n * len(chosen)))
    stats.sort()
    tail = (1 - level) / 2
    low = stats[max(0, math.floor(tail * samples))]
    high = stats[min(samples - 1, math.ceil((1 - tail) * samples) - 1)]
    return mean, low, high


def paired_difference(
    a_per_seed: Sequence[Sequence[float]], b_per_seed: Sequence[Sequence[float]], **kwargs
) -> tuple[float, float, float]:
    """Mean and bootstrap interval of arm A minus arm B, paired by seed and problem (both arms of a seed start from
    the same adapter and are evaluated on the same problems): far tighter than comparing two separate intervals.
    `kwargs` go to [`bootstrap_interval`]."""
    if len(a_per_seed) != len(b_per_seed):
        raise ValueError("Both arms need the same seeds.")
    diffs = []
    for a, b in zip(a_per_seed, b_per_seed, strict=True):
        if len(a) != len(b):
            raise ValueError("Both arms must be evaluated on the same problems.")
        diffs.append([x - y for x, y in zip(a, b, strict=True)])
    return bootstrap_interval(diffs, **kwargs)


# ------------------------------------------------------------------------------------------------ running


def _settings(feature: str, seed: int, steps: int, num_eval: int, overrides: dict) -> dict:
    import yaml

    settings = yaml.safe_load((ROOT / FEATURES[feature]).read_text())
    settings.update(ABLATION_SETTINGS.get(feature, {}))
    settings.update(seed=seed, max_steps=steps, num_eval_tasks=num_eval, disable_tqdm=True, **overrides)
    return {k: _number(v) for k, v in settings.items()}


def _number(value):
    """YAML 1.1 reads `1e-4` (no dot) as a string, and `parse_dict`, unlike `TrlParser`'s argparse, does not convert
    it: a float field would get a string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _parse(settings: dict, trl: bool = False):
    """`(TaskArguments, config, ModelConfig)` from a flat settings dict; `trl`: TRL's own `GRPOConfig`, whose
    dataclass drops every agentic field."""
    from transformers import HfArgumentParser
    from trl import GRPOConfig, ModelConfig

    from ..config import AgenticGRPOConfig
    from ..tasks import TaskArguments

    parser = HfArgumentParser((TaskArguments, GRPOConfig if trl else AgenticGRPOConfig, ModelConfig))
    return parser.parse_dict(settings, allow_extra_keys=trl)


def _load_adapter(model_path: str, adapter: str, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", truncation_side="left")
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return PeftModel.from_pretrained(base, adapter, is_trainable=True), tokenizer


def _evaluate(model, tokenizer, task, training_args, rows) -> list[float]:
    """Every arm alike, with the feature config's settings (`training_args` is always the `AgenticGRPOConfig`): the
    log search is solvable only with `delete_context`, which every arm learned in the warm start."""
    from ..evaluation import evaluate_policy

    result = evaluate_policy(
        model,
        tokenizer,
        rows,
        environment_factory=task.environment_factory,
        reward_funcs=task.reward_funcs[:1],
        max_completion_length=training_args.max_completion_length,
        max_tool_calling_iterations=training_args.max_tool_calling_iterations or 3,
        batch_size=16,
        temperature=0.0,
        progress=False,
        context_snapshots=training_args.enable_context_snapshots,
        context_stub_text=training_args.context_stub_text,
    )
    return [float(r["rewards"][0]) for r in result.records]


def _cell_path(cells: Path, feature: str, seed: int, arm: str) -> Path:
    return cells / feature / f"seed{seed}" / f"{arm}.json"


def _warmstart_losses(log_history: list[dict]) -> list[float]:
    return [round(float(h["loss"]), 4) for h in log_history if "loss" in h]


def _fingerprint(settings: dict) -> str:
    """A short hash of everything that defines a cell but its arm (the feature's config, seed, steps, overrides)."""
    import hashlib

    text = json.dumps({k: v for k, v in settings.items() if k != "output_dir"}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _machine() -> dict:
    """Where and when a cell ran: wall times (and the SFT arm's budget) compare only on like machines and loads."""
    import platform

    cpu = next(
        (line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": _commit(),
        "host": platform.node(),
        "cpu": cpu,
        "threads": __import__("torch").get_num_threads(),
        "load_average_before": os.getloadavg()[0],
    }


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_cell(
    feature: str,
    seed: int,
    arm: str,
    out: Path,
    *,
    steps: int,
    num_eval: int,
    overrides=None,
    cells: Path | None = None,
) -> dict:
    """Run one (feature, seed, arm) and write its JSON under `cells` (default: `out`); returns it (read back when it
    exists). Adapters and trainer output go under `out`."""
    cells = out if cells is None else cells
    path = _cell_path(cells, feature, seed, arm)
    settings = _settings(feature, seed, steps, num_eval, dict(overrides or {}))
    fingerprint = _fingerprint(settings)
    if path.exists():
        cell = json.loads(path.read_text())
        if cell.get("settings_hash") != fingerprint:
            raise RuntimeError(
                f"{path} was computed with other settings ({cell.get('settings')}) than this run's ({settings}): "
                "mixing them would compare different experiments. Delete it, or write this run's cells elsewhere "
                "(`--cells`)."
            )
        if arm == "sft" and _recorded_sft_rate(cell) != _sft_rate(settings):
            raise RuntimeError(
                f"{path} trained at learning rate {_recorded_sft_rate(cell):g}, not the GRPO arms' "
                f"{_sft_rate(settings):g} that the SFT arm uses now. Delete it to run it again."
            )
        return cell
    from ..models import resolve_model_path
    from ..tasks import build_task

    settings["output_dir"] = str(out / feature / f"seed{seed}" / f"{arm}-run")
    task_args, args, model_args = _parse(settings, trl=arm == "trl")
    task = build_task(task_args)
    eval_keys = {_problem_key(r) for r in task.eval_dataset}
    task = _without_problems(task, eval_keys)  # generators of other seeds can still draw a held-out problem
    model_path = resolve_model_path(model_args.model_name_or_path)
    dtype = getattr(__import__("torch"), model_args.dtype) if model_args.dtype not in (None, "auto") else None
    # Named by the settings: an adapter of another configuration (a test run, other overrides) is never reused.
    adapter = out / feature / f"seed{seed}" / f"warmstart-adapter-{fingerprint}"
    rows = list(task.eval_dataset)
    record: dict = {
        "feature": feature,
        "seed": seed,
        "arm": arm,
        "steps": steps,
        "num_eval": len(rows),
        "settings": {k: v for k, v in settings.items() if k != "output_dir"},
        "settings_hash": fingerprint,
        **_machine(),
    }
    if arm != "warmstart" and not (adapter / "adapter_config.json").exists():
        # A new machine: train the seed's warm start again (deterministic on CPU) and check it is the recorded one.
        recorded = run_cell(
            feature, seed, "warmstart", out, steps=steps, num_eval=num_eval, overrides=overrides, cells=cells
        )
        if not (adapter / "adapter_config.json").exists():
            _warm_start(model_path, dtype, task, task_args, model_args, args, seed, adapter, recorded)
    started = time.perf_counter()

    if arm == "warmstart":
        result, tokenizer = _warm_start(model_path, dtype, task, task_args, model_args, args, seed, adapter, None)
        record["train_seconds"] = result.seconds
        record["warmstart_losses"] = _warmstart_losses(result.log_history)
        model = result.model
    else:
        model, tokenizer = _load_adapter(model_path, str(adapter), dtype)
        if arm == "sft":
            budget = run_cell(
                feature, seed, "agentic", out, steps=steps, num_eval=num_eval, overrides=overrides, cells=cells
            )
            record["train_seconds"], record["sft_steps"] = _sft_for(
                model, tokenizer, task, task_args, args, budget, eval_keys
            )
            record["sft_learning_rate"] = args.learning_rate
            # The budget is a wall time: it compares only when both arms ran on a like machine and load.
            record["sft_budget"] = {k: budget.get(k) for k in ("train_seconds", "host", "cpu", "load_average_before")}
        else:
            trained = _train_grpo(arm, model, tokenizer, task, task_args, args, eval_keys)
            model = trained.pop("model")
            record.update(trained)
    eval_started = time.perf_counter()
    eval_args = args if arm != "trl" else _parse(settings)[1]  # TRL's config has no agentic field
    record["success"] = _evaluate(model, tokenizer, task, eval_args, rows)
    record["eval_seconds"] = time.perf_counter() - eval_started
    record["seconds"] = time.perf_counter() - started
    record["load_average_after"] = os.getloadavg()[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)  # atomic: an interrupted write never leaves a cell that breaks the resume
    return record


def _sft_rate(settings: dict) -> float:
    """The SFT arm's learning rate: the GRPO arms' (`learning_rate` of the feature's config)."""
    return float(_parse(settings)[1].learning_rate)


def _recorded_sft_rate(cell: dict) -> float:
    """The rate an SFT cell trained at; cells from before it was recorded trained at the warm start's peak rate."""
    if "sft_learning_rate" in cell:
        return float(cell["sft_learning_rate"])
    return float(_parse(cell["settings"])[0].warmstart_learning_rate)


def _problem_key(row: dict) -> str:
    """What makes two problems the same: the calculator's expression (word problems around one expression are one
    problem), else the environment's seed (text world, log search), else the question."""
    for column in ("expression", "task_seed"):
        if row.get(column) is not None:
            return f"{column}={row[column]}"
    return json.dumps(row["prompt"][-1]["content"], default=str)


def _without_problems(task, keys: set[str]):
    """The task with the problems of `keys` (the held-out ones) removed from its training and warm-start sets."""

    def keep(dataset):
        return None if dataset is None else dataset.filter(lambda row: _problem_key(row) not in keys)

    return dataclasses.replace(
        task, train_dataset=keep(task.train_dataset), warmstart_dataset=keep(task.warmstart_dataset)
    )


def _warm_start(model_path, dtype, task, task_args, model_args, args, seed, adapter: Path, recorded: dict | None):
    """SFT warm start of a seed, saved to `adapter`; with `recorded` (the seed's warm-start cell), its losses must be
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
    if recorded is not None and "warmstart_losses" in recorded:
        losses = _warmstart_losses(result.log_history)
        if len(losses) != len(recorded["warmstart_losses"]) or any(
            abs(a - b) > 1e-3 for a, b in zip(losses, recorded["warmstart_losses"], strict=False)
        ):
            raise RuntimeError(
                f"The warm start of {adapter.parent} trained again gave losses {losses}, not the recorded "
                f"{recorded['warmstart_losses']}: its arms would not start from the same adapter. Delete that seed's "
                "cells to run it again from scratch."
            )
    result.model.save_pretrained(adapter)
    return result, tokenizer


def _train_grpo(arm, model, tokenizer, task, task_args, args, eval_keys: set[str]) -> dict:
    from trl import GRPOTrainer

    from ..tasks import build_task
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
    if arm == "trl":
        trainer = GRPOTrainer(**kwargs)
    else:
        if getattr(args, "tracin_enabled", False):
            # Validation prompts from a seed of their own: never the problems the arms are evaluated on.
            validation = build_task(dataclasses.replace(task_args, task_seed=task_args.task_seed + 10)).eval_dataset
            validation = validation.filter(lambda row: _problem_key(row) not in eval_keys)
            kwargs["tracin_eval_dataset"] = validation
        trainer = AgenticGRPOTrainer(**kwargs)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    fired = {
        k: sum(h.get(k) or 0 for h in trainer.state.log_history)
        for k in (
            "rollback/attempts",
            "negatives/rows",
            "snapshots/rows",
            "rlvcr/expanded_steps",
            "tracin/num_selected",
        )
    }
    return {
        "trainer": type(trainer).__name__,
        "model": trainer.accelerator.unwrap_model(trainer.model),
        "train_seconds": seconds,
        "rewards": rewards,
        "fired": fired,
    }


def _sft_for(model, tokenizer, task, task_args, args, budget: dict, eval_keys: set[str]) -> tuple[float, int]:
    """Continue SFT on fresh traces, at the GRPO arms' learning rate, until the agentic arm's training wall time is
    spent."""
    from transformers import TrainerCallback

    from ..warmstart import run_task_warmstart

    seconds = budget["train_seconds"]

    class _StopAt(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, _args, state, control, **k):
            control.should_training_stop = time.perf_counter() - self.start >= seconds

    steps = 10 * max(task_args.warmstart_steps, 1)  # an upper bound; the callback stops earlier
    fresh = dataclasses.replace(
        task_args,
        task_seed=task_args.task_seed + 20,
        warmstart_steps=steps,
        warmstart_learning_rate=args.learning_rate,
    )
    from ..tasks import build_task

    result = run_task_warmstart(
        model,
        tokenizer,
        _without_problems(build_task(fresh), eval_keys),
        fresh,
        peft_config=None,
        output_dir=args.output_dir,
        seed=args.seed,
        use_cpu=args.use_cpu,
        bf16=args.bf16,
        callbacks=[_StopAt()],
        compact_progress=False,
        # Stopped by time, not steps: a decay over the step cap would leave the rate near its peak, arbitrarily.
        lr_scheduler_type="constant",
    )
    done = sum(1 for h in result.log_history if "loss" in h)
    if done >= steps:
        print(f"warning: the SFT arm stopped at its step cap ({steps}) before the time budget ({seconds:.0f} s)")
    return result.seconds, done


# ------------------------------------------------------------------------------------------------ report


def render(out: Path, features: Sequence[str], seeds: Sequence[int], command: str) -> tuple[str, dict]:
    """The Markdown report and the summary `{feature: {arm: (mean, low, high, seconds)}}` of the cells on disk."""
    summary: dict = {}
    expected = [(f, k, a) for f in features for k in seeds for a in ARMS]
    missing = [(f, k, a) for f, k, a in expected if not _cell_path(out, f, k, a).exists()]
    status = (
        f"**Partial: {len(expected) - len(missing)} of {len(expected)} cells** (missing: "
        + ", ".join(f"{f} seed {k} {a}" for f, k, a in missing[:12])
        + (", ..." if len(missing) > 12 else "")
        + "). Nothing below is a conclusion about a feature whose seeds are missing."
        if missing
        else f"All {len(expected)} cells."
    )
    lines = [
        "# Ablation: what each feature buys over plain TRL GRPO",
        "",
        f"Command: `{command}`. Report written {time.strftime('%Y-%m-%d')} from the cells below "
        "(`make ablation` runs the missing ones first).",
        "",
        status,
        "",
        "Held-out success (greedy, the task's first reward function) with 95 % bootstrap intervals (seeds and the "
        "problems every seed shares resampled). *Train* is the wall time of the arm's training (warm start: the SFT "
        "stage), *eval* of its evaluation, on this 2-core CPU machine.",
        "",
        "| feature | arm | seeds | problems | success | 95 % interval | train (s) | eval (s) | trained on (per seed) "
        "| fired (all seeds) |",
        "|---|---|---:|---:|---:|---|---:|---:|---|---|",
    ]
    found: dict = {}  # (feature, arm) -> {seed: cell}
    for feature in features:
        for arm in ARMS:
            by_seed = {}
            for seed in seeds:
                path = _cell_path(out, feature, seed, arm)
                if path.exists():
                    by_seed[seed] = json.loads(path.read_text())
            found[feature, arm] = by_seed
            cells = list(by_seed.values())
            if not cells:
                continue
            mean, low, high = bootstrap_interval([c["success"] for c in cells])
            train = sum(c.get("train_seconds", 0.0) for c in cells) / len(cells)
            evaluation = sum(c.get("eval_seconds", 0.0) for c in cells) / len(cells)
            fired = {}
            for c in cells:
                for k, v in (c.get("fired") or {}).items():
                    fired[k] = fired.get(k, 0) + v
            fired_text = ", ".join(f"{k} {v:g}" for k, v in fired.items() if v) or "-"
            summary.setdefault(feature, {})[arm] = (mean, low, high, train)
            lines.append(
                f"| {feature} | {ARM_LABELS[arm]} | {len(cells)} | {cells[0]['num_eval']} | {mean:.3f} | "
                f"[{low:.3f}, {high:.3f}] | {train:.0f} | {evaluation:.0f} | {_trained_on(cells)} | {fired_text} |"
            )
    every = [c for by_seed in found.values() for c in by_seed.values()]
    if every:
        dates = sorted(c["date"] for c in every if c.get("date"))
        hours = sum(c.get("seconds", 0.0) for c in every) / 3600
        commits = sorted({c["commit"] for c in every if c.get("commit")})
        lines[6:6] = [
            f"Cells recorded {dates[0]} to {dates[-1]} (commits {', '.join(commits)}): {hours:.1f} h of training and "
            "evaluation in all, the sum of the cells' times.",
            "",
        ]
    lines += [
        "",
        "Paired differences: both arms of a seed start from the same adapter and are evaluated on the same problems, "
        "so the difference is resampled per seed and problem (seeds both arms have).",
        "",
        "| feature | difference | seeds | mean | 95 % interval |",
        "|---|---|---:|---:|---|",
    ]
    for feature in features:
        for a, b in PAIRS:
            shared = sorted(set(found[feature, a]) & set(found[feature, b]))
            if not shared:
                continue
            mean, low, high = paired_difference(
                [found[feature, a][k]["success"] for k in shared], [found[feature, b][k]["success"] for k in shared]
            )
            lines.append(f"| {feature} | {a} − {b} | {len(shared)} | {mean:+.3f} | [{low:+.3f}, {high:+.3f}] |")
    return "\n".join(lines) + "\n", summary


def _trained_on(cells: list[dict]) -> str:
    """What one seed of an arm trained on: GRPO rollouts (training prompts × generations, from its settings) and the
    extra generations the agentic loop made, or SFT traces; averaged over the seeds."""
    cell = cells[0]
    settings = cell["settings"]
    if cell["arm"] in ("warmstart", "sft"):
        steps = sum(c.get("sft_steps", len(c.get("warmstart_losses", []))) for c in cells) / len(cells)
        return f"{steps * settings.get('warmstart_batch_size', 0):.0f} traces"
    from ..tracin.schedule import validation_rollout_steps, window_starts

    args = _parse(settings)[1]  # the config's defaults for fields the settings leave out
    starts = window_starts(
        cell["steps"], args.steps_per_generation, args.num_iterations, args.gradient_accumulation_steps
    )
    text = f"{len(starts) * args.generation_batch_size:g} rollouts"
    regenerated = sum((c.get("fired") or {}).get("rollback/attempts", 0) for c in cells) / len(cells)
    if regenerated:
        text += f" + {regenerated:.0f} regenerated turns"
    if cell["arm"] == "agentic" and args.tracin_enabled:
        # The control ignores the TracIn fields of the shared config; the agentic arm's schedule is the mixin's own.
        rollouts = validation_rollout_steps(starts, args.tracin_val_refresh_steps, args.tracin_val_rollout_steps)
        validation = len(rollouts) * args.tracin_val_batch_size * args.tracin_val_num_generations
        text += f" + {validation:g} TracIn validation rollouts"
    return text


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    features = list(summary)
    fig, axes = plt.subplots(1, max(len(features), 1), figsize=(4 * max(len(features), 1), 3.5), squeeze=False)
    for ax, feature in zip(axes[0], features, strict=False):
        arms = [a for a in ARMS if a in summary[feature]]
        means = [summary[feature][a][0] for a in arms]
        errors = [
            [m - summary[feature][a][1] for a, m in zip(arms, means)],
            [summary[feature][a][2] - m for a, m in zip(arms, means)],
        ]
        ax.bar(
            range(len(arms)),
            means,
            yerr=errors,
            capsize=4,
            color=["#999", "#4c72b0", "#dd8452", "#55a868"][: len(arms)],
        )
        ax.set_xticks(range(len(arms)), arms)
        ax.set_ylim(0, 1)
        ax.set_title(feature)
        ax.set_ylabel("held-out success")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_agentic.ablation", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("run", "render"), nargs="?", default="run")
    parser.add_argument("--features", nargs="+", default=list(FEATURES), choices=list(FEATURES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps per arm.")
    parser.add_argument("--num_eval", type=int, default=128, help="Held-out problems per evaluation.")
    parser.add_argument("--out", default="outputs/ablation", help="Adapters and trainer output go here.")
    parser.add_argument(
        "--cells", default=None, help="Cells (JSON) go here; existing ones are reused (default: `--out`)."
    )
    parser.add_argument("--doc", default="docs/ablation.md")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="Config overrides for every arm (YAML values)."
    )
    a = parser.parse_args(argv)
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in a.set)}
    out = Path(a.out)
    cells = Path(a.cells) if a.cells else out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.action == "run":
        for feature in a.features:
            for seed in a.seeds:
                for arm in ARMS:
                    cell = run_cell(
                        feature, seed, arm, out, steps=a.steps, num_eval=a.num_eval, overrides=overrides, cells=cells
                    )
                    print(
                        f"{feature} seed {seed} {arm}: success {sum(cell['success']) / len(cell['success']):.3f}",
                        flush=True,
                    )
    command = (
        f"python -m trl_agentic.ablation --features {' '.join(a.features)} --seeds {' '.join(map(str, a.seeds))} "
        f"--steps {a.steps} --num_eval {a.num_eval} --out {a.out} --cells {cells}"
    )
    text, summary = render(cells, a.features, a.seeds, command)
    doc = Path(a.doc)
    plot(summary, doc.with_suffix(".png"))
    text += f"\n![held-out success per arm]({doc.with_suffix('.png').name})\n"
    # What the numbers mean and why, written by hand next to the generated report (kept when it is re-rendered).
    findings = doc.with_name(doc.stem + "-findings.md")
    if findings.exists():
        text += "\n" + findings.read_text()
    doc.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
