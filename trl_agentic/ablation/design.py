"""The pre-registered design of the ablation (issue 37): tasks, arms, comparisons, seeds, metrics and the decision rule.

Pure data and pure functions (no model, no file): `trl_agentic.ablation.cells` runs what is declared here, and
`trl_agentic.ablation.report` renders it. [`design_markdown`] is the design as the pre-registration in
docs/ablation.md states it; the report refuses to render when the two differ (the design changed after it was
registered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import stats

# v2 with amendment 1 (hard calculator problems); in every cell's settings hash: cells of another design never mix.
# Amendment 2 (the RL learning rate from a ladder) changes no shared setting: the rate is an arm setting of every RL
# cell (`arm_settings.learning_rate`), so the warm-start cells keep their hash and RL cells without it are refused.
DESIGN = "v2.1"
AMENDMENT = 5
# Cells recorded under an earlier registration that the amendments since left valid, by trainer or arm name:
# amendment 2 changed only the RL arms, so the calibration and warm-start cells of amendment 1's registration stay
# (their settings hash is unchanged too); amendment 3 changed only the equal-compute budget (`tracin`,
# `max_variance`). `random` takes `tracin`'s keep rate: its cell stands while `tracin`'s, under amendment 3, records
# that rate (`cells.check_derived`, on every read). Amendment 4 changed only the log search's control (`trl_fit`, from a
# warm start of its own, `warmstart_fit`): every calculator cell and the log search's `warmstart` stay (its `snapshots`
# stayed too, until amendment 5 changed its rate). An entry is a trainer, an arm, a task, or `task:arm`; the first two
# were made for the calculator and name it, so that a log search cell under them (the retired `trl_fit`, on the shared
# warm start) is not carried. Amendment 5 changed only the log search's RL learning rate (a ladder, as the
# calculator's): its two warm starts stay; no RL cell of the log search under an earlier registration does.
CARRIED_REGISTRATIONS = {
    "ecf7de194cad": ("calculator:warmstart",),
    "458ecf0d147b": tuple(
        f"calculator:{a}" for a in ("warmstart", "trl", "feedback", "rollback", "rollback_episodes", "rft", "random")
    ),
    "ab69c86244f5": ("calculator", "logsearch:warmstart"),
    "0166d9ab5755": ("calculator", "logsearch:warmstart", "logsearch:warmstart_fit"),
}
# Library defaults the arms were registered under and that changed since, pinned for every agentic arm (an arm's own
# setting wins): `rollback` is "`group_baseline: all_rows` (the default)", and after `rollback_episodes − rollback`'s
# verdict the library's default became "episodes" (docs/concepts.md). No arm's data path changes.
REGISTERED_DEFAULTS = {"group_baseline": "all_rows"}

# ------------------------------------------------------------------------------------------------ decision rule

MIN_EFFECT = 0.10  # the minimum effect worth detecting, in held-out success (sampled, the primary metric)
ALPHA = 0.05  # two-sided; the intervals are 95 %
POWER = 0.8
PLANNING_SD = 0.06  # assumed sd of a per-seed paired difference (see the pre-registration for why)
SPREAD_MIN = 0.6  # the warm start must leave at least this share of GRPO groups with a reward spread
PLATEAU_DELTA = 0.05  # oracle SFT has plateaued when twice the steps add less than this (sampled success)


# ------------------------------------------------------------------------------------------------ tasks

_MODEL = {
    "model_name_or_path": "smollm2-135m",
    "dtype": "float32",  # weights in float32, computation in bfloat16 autocast (`bf16`)
    "use_peft": True,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "lora_target_modules": "all-linear",
    "use_cpu": True,
    "bf16": True,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "log_completions": False,
    "disable_tqdm": True,
}
CALCULATOR_ERRORS = [
    "ValueError",
    "ZeroDivisionError",
    "TypeError",
    "SyntaxError",
    "NameError",
    "ToolCallParseError",
    "ToolNotFoundError",
]


@dataclass(frozen=True)
class EvalPlan:
    """How every arm of a task is evaluated.

    Attributes:
        problems: Held-out problems (`num_eval_tasks`), removed from every training set.
        samples: Samples per problem at the training temperature (the primary metric is their mean success).
        spread_prompts: Training prompts of the warm start's spread check, each sampled `num_generations` times.
        validation_problems: Validation problems of the learning-rate ladder (`task_seed + 10`, the TracIn
            validation source, held-out problems removed), each sampled `samples` times and greedily.
        validation_offset: The validation problems skipped before those (amendment 2's exploratory check had seen
            the first 64).
    """

    problems: int
    samples: int
    spread_prompts: int
    validation_problems: int = 0
    validation_offset: int = 0


@dataclass(frozen=True)
class Task:
    """One task of the ablation and the settings every arm of it shares.

    Attributes:
        name: Folder of its cells.
        settings: `TaskArguments`, `AgenticGRPOConfig` and `ModelConfig` fields shared by its arms.
        seeds: The pre-registered seeds.
        extra_seeds: Seeds the pre-registered extension may add (see the pre-registration).
        evaluation: [`EvalPlan`].
        calibration_steps: Warm-start lengths of the calibration ladder (seed 0); empty: `warmstart_steps` is fixed.
        lr_ladder: RL learning rates of the learning-rate ladder (seed 0, arm `lr_ladder_arm`, amendment 2; the log
            search's, amendment 5); empty: the task's `learning_rate` is fixed.
        lr_ladder_arm: The arm the ladder trains from seed 0's warm start of that arm (`Arm.warm_start`): the
            task's control.
    """

    name: str
    settings: dict
    seeds: tuple[int, ...]
    extra_seeds: tuple[int, ...]
    evaluation: EvalPlan
    calibration_steps: tuple[int, ...] = ()
    lr_ladder: tuple[float, ...] = ()
    lr_ladder_arm: str = "trl"


CALCULATOR = Task(
    name="calculator",
    settings={
        **_MODEL,
        "task": "calculator",
        "task_difficulty": "hard",
        "num_train_tasks": 512,
        "num_eval_tasks": 128,
        "task_seed": 0,
        "warmstart_batch_size": 4,
        "warmstart_learning_rate": 3e-4,
        "warmstart_error_fraction": 0.25,
        "max_steps": 16,
        "learning_rate": 3e-4,  # as first registered; each RL cell's own rate is in its `arm_settings`
        "lr_scheduler_type": "constant",
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 4,  # 4 micro-batches of 8: one generation batch of 32 = 4 prompts x 8
        "num_generations": 8,
        "max_completion_length": 192,
        "max_tool_calling_iterations": 3,
        "temperature": 0.8,
        "gradient_checkpointing": False,
    },
    seeds=(0, 1, 2, 3, 4),
    extra_seeds=(5, 6, 7),
    evaluation=EvalPlan(problems=128, samples=4, spread_prompts=32, validation_problems=64, validation_offset=64),
    calibration_steps=(32, 64, 128, 256),
    lr_ladder=(3e-5, 1e-4, 3e-4),
)

LOGSEARCH = Task(
    name="logsearch",
    settings={
        **_MODEL,
        "task": "logsearch",
        "num_train_tasks": 256,
        "num_eval_tasks": 64,
        "task_seed": 0,
        "warmstart_steps": 48,
        "warmstart_batch_size": 4,
        "warmstart_learning_rate": 1e-3,
        "max_steps": 8,
        "learning_rate": 3e-4,  # as first registered; each RL cell's own rate is in its `arm_settings` (amendment 5)
        "lr_scheduler_type": "constant",
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,  # one generation batch of 16 = 2 prompts x 8
        "num_generations": 8,
        "max_completion_length": 320,  # per segment: one file fits, two do not
        "max_tool_calling_iterations": 6,
        "temperature": 0.8,
        "gradient_checkpointing": True,
    },
    seeds=(0, 1, 2),
    extra_seeds=(),
    evaluation=EvalPlan(problems=64, samples=2, spread_prompts=16, validation_problems=64, validation_offset=0),
    lr_ladder=(3e-5, 1e-4, 3e-4),
    lr_ladder_arm="trl_fit",
)

TASKS = {task.name: task for task in (CALCULATOR, LOGSEARCH)}


# ------------------------------------------------------------------------------------------------ arms


@dataclass(frozen=True)
class Arm:
    """One arm: how it trains from the seed's warm start.

    Attributes:
        name: Its cell's file name.
        label: What the report calls it.
        trainer: `"warmstart"` (the seed's SFT warm start itself), `"trl"` (TRL's `GRPOTrainer` and tool loop, with
            TRL's `GRPOConfig`: no agentic field) or `"agentic"` (`AgenticGRPOTrainer`).
        overrides: Settings of this arm on top of the task's.
        compute_budget_from: Stop training once the named arm's token passes (`compute`) are spent: equal compute
            (amendment 3; a budget in seconds before it).
        keep_rate_from: `row_selection_fraction` is the named arm's mean TracIn keep rate (same seed).
        what: One line for the pre-registration.
        eval_overrides: Settings of its evaluation only (the log search's warm start is evaluated, and
            spread-checked, with `delete_context`, as its traces taught).
        warm_start: The `"warmstart"`-trainer arm whose adapter this arm trains from (amendment 4: the log search's
            control has a warm start of its own, on traces without `delete_context`).
    """

    name: str
    label: str
    trainer: str
    overrides: dict = field(default_factory=dict)
    compute_budget_from: str | None = None
    keep_rate_from: str | None = None
    what: str = ""
    eval_overrides: dict = field(default_factory=dict)
    warm_start: str = "warmstart"


ROLLBACK = {
    "enable_tool_rollback": True,
    "max_tool_retries": 2,
    "save_negative_samples": True,
    "max_negative_samples_per_group": 2,
    "rollback_on_errors": CALCULATOR_ERRORS,
}

ARMS: dict[str, tuple[Arm, ...]] = {
    "calculator": (
        Arm("warmstart", "warm start only", "warmstart", what="SFT on oracle traces, steps from the calibration"),
        Arm("trl", "TRL GRPOTrainer (control)", "trl", what="TRL's trainer and tool loop: a malformed call ends"),
        Arm(
            "feedback",
            "TRL + malformed-call feedback",
            "agentic",
            {"malformed_tool_call_feedback": True},
            what="our loop (token-identical to TRL's otherwise) with the malformed call shown as an error",
        ),
        Arm(
            "rollback",
            "rollback + negatives",
            "agentic",
            dict(ROLLBACK),
            what="rollback, 2 retries, up to 2 negative rows per group, `group_baseline: all_rows` (the default)",
        ),
        Arm(
            "rollback_episodes",
            "rollback + negatives, episodes baseline",
            "agentic",
            {**ROLLBACK, "group_baseline": "episodes"},
            what="the same with `group_baseline: episodes`",
        ),
        Arm(
            "rft",
            "RFT (self-training on own successes)",
            "agentic",
            {"row_selection": "successful", "row_selection_threshold": 1.0},
            what="the same rollouts (TRL's loop), SFT on the successful ones (`row_selection: successful`)",
        ),
        Arm(
            "tracin",
            "TracIn, equal compute",
            "agentic",
            {"tracin_enabled": True, "tracin_val_batch_size": 2, "tracin_val_num_generations": 8},
            compute_budget_from="trl",
            what="TracIn (library schedule), stopped once the control's token passes are spent",
        ),
        Arm(
            "random",
            "random row filter, TracIn's keep rate",
            "agentic",
            {"row_selection": "random"},
            keep_rate_from="tracin",
            what="a random share of the rows, the share TracIn kept in the same seed",
        ),
        Arm(
            "max_variance",
            "max-variance subsampling (PODS), equal compute",
            "agentic",
            {
                "row_selection": "max_variance",
                "row_selection_keep": 8,
                "num_generations": 16,
                "per_device_train_batch_size": 16,
            },
            compute_budget_from="trl",
            what="16 rollouts per prompt, the 8 of largest reward variance trained on, stopped at the control's token "
            "passes",
        ),
    ),
    "logsearch": (
        Arm(
            "warmstart",
            "warm start only",
            "warmstart",
            what="SFT on solved episodes with `delete_context`; evaluated with it",
            eval_overrides={"enable_context_snapshots": True},
        ),
        Arm(
            "warmstart_fit",
            "warm start without deletion (the control's)",
            "warmstart",
            {"max_completion_length": 640, "logsearch_context_deletion": False},
            what="the same SFT steps on the same episodes without `delete_context`: each file read and kept, then the "
            "answer (one trace an episode); its prompt does not ask to delete",
        ),
        Arm(
            "trl_fit",
            "TRL GRPOTrainer, budget fits both files",
            "trl",
            {"max_completion_length": 640, "logsearch_context_deletion": False},
            what="TRL's trainer and loop, 640 tokens: both files fit without deleting",
            warm_start="warmstart_fit",
        ),
        Arm(
            "snapshots",
            "context snapshots",
            "agentic",
            {
                "enable_context_snapshots": True,
                "max_snapshots_per_episode": 4,
                "snapshot_downsample": "last",
                "context_stub_text": "[deleted]",
                "snapshot_advantage": "episode",
            },
            what="`delete_context` on, 320 tokens per segment",
        ),
    ),
}


def arm(task: str, name: str) -> Arm:
    return next(a for a in ARMS[task] if a.name == name)


# ------------------------------------------------------------------------------------------------ comparisons


@dataclass(frozen=True)
class Comparison:
    """A pre-registered comparison `a - b` (paired by seed) and the question it answers."""

    task: str
    a: str
    b: str
    question: str
    primary: bool = False


COMPARISONS = (
    Comparison("calculator", "rollback", "feedback", "rollback + negatives, feedback held equal", primary=True),
    Comparison("calculator", "feedback", "trl", "malformed-call feedback during training"),
    Comparison("calculator", "rollback_episodes", "rollback", "`group_baseline`: episodes instead of all_rows"),
    Comparison("calculator", "trl", "rft", "GRPO against self-training on its own successes, equal rollouts"),
    Comparison("calculator", "rollback", "rft", "rollback + negatives against self-training"),
    Comparison("calculator", "tracin", "trl", "TracIn at equal compute", primary=True),
    Comparison("calculator", "tracin", "random", "TracIn against a random filter at its keep rate"),
    Comparison("calculator", "tracin", "max_variance", "TracIn against max-variance subsampling"),
    Comparison("calculator", "max_variance", "trl", "max-variance subsampling at equal compute"),
    Comparison("calculator", "trl", "warmstart", "did GRPO move the policy at all"),
    Comparison("logsearch", "snapshots", "trl_fit", "snapshots against a control whose budget fits", primary=True),
    Comparison("logsearch", "trl_fit", "warmstart_fit", "did GRPO move the control at all"),
    Comparison("logsearch", "snapshots", "warmstart", "did GRPO move the snapshot policy at all"),
    Comparison("logsearch", "warmstart", "warmstart_fit", "the two warm starts: deleting against keeping, before RL"),
)


# ------------------------------------------------------------------------------------------------ calibration


@dataclass(frozen=True)
class Rung:
    """One warm-start length of the calibration ladder and what it measured (seed 0)."""

    steps: int
    sampled_success: float
    spread_fraction: float

    @classmethod
    def of_cell(cls, steps: int, cell: dict) -> Rung:
        """The rung a recorded calibration cell measured."""
        sampled = cell["sampled"]
        return cls(steps, sum(sampled) / len(sampled), cell["spread_check"]["fraction"])


def choose_warmstart(rungs: Sequence[Rung]) -> tuple[int, bool, str]:
    """The pre-registered choice of the calculator's warm-start length from the calibration ladder.

    The first rung (in increasing steps) where oracle SFT has plateaued (the next rung, twice the steps, adds less
    than `PLATEAU_DELTA` of sampled success) and the policy leaves at least `SPREAD_MIN` of its GRPO groups with a
    reward spread. Without one: the longest plateaued-or-not rung that still has the spread, else the rung with the
    most spread; the check is then failed, and the report says so next to every calculator verdict.

    Returns:
        `(steps, check_passed, reason)`.
    """
    rungs = sorted(rungs, key=lambda r: r.steps)
    if len(rungs) < 2:
        raise ValueError("The calibration needs at least two rungs.")
    for rung, longer in zip(rungs, rungs[1:]):
        gain = longer.sampled_success - rung.sampled_success
        if gain < PLATEAU_DELTA and rung.spread_fraction >= SPREAD_MIN:
            return (
                rung.steps,
                True,
                f"{rung.steps} steps: {longer.steps} steps add {gain:+.3f} (< {PLATEAU_DELTA}), "
                f"{rung.spread_fraction:.0%} of groups with a reward spread (>= {SPREAD_MIN:.0%})",
            )
    spread = [r for r in rungs[:-1] if r.spread_fraction >= SPREAD_MIN]
    if spread:
        chosen = spread[-1]
        return chosen.steps, False, f"{chosen.steps} steps: no rung both plateaued and kept the spread"
    chosen = max(rungs[:-1], key=lambda r: r.spread_fraction)
    return chosen.steps, False, f"{chosen.steps} steps: no rung kept {SPREAD_MIN:.0%} of groups with a spread"


def ladder_decision(measured: dict[int, Rung], ladder: Sequence[int]) -> tuple[int, bool, str] | None:
    """The warm-start choice as soon as the ladder decides it, run in increasing steps; `None` while it is open.

    A rung that passes (plateaued, with the spread) is chosen by [`choose_warmstart`] once its double is measured,
    whatever the longer rungs would show: the rule takes the *first* passing rung, and every shorter rung is compared
    with the same double as in the whole ladder. So the ladder stops there (amendment 1), and the choice is the one
    the whole ladder would make. Without a passing rung the whole ladder is needed.

    Args:
        measured: `{steps: Rung}` of the rungs measured so far.
        ladder: The pre-registered lengths.
    """
    prefix = []
    for steps in sorted(ladder):
        if steps not in measured:
            break
        prefix.append(measured[steps])
    if len(prefix) < 2:
        return None
    choice = choose_warmstart(prefix)
    if choice[1] or len(prefix) == len(ladder):
        return choice
    return None


# ------------------------------------------------------------------------------------------------ learning rate

# The rungs' RL seed (prompt order, sampling): not seed 0's, so that no verdict's cell is the run the rule selected (a
# lucky run picked on validation would favour its arm on the held-out problems too).
LR_LADDER_RL_SEED = 1000


@dataclass(frozen=True)
class LrRung:
    """One RL learning rate of the ladder and its success on the validation problems (seed 0)."""

    learning_rate: float
    successes: int  # sampled validation episodes that succeeded
    episodes: int
    greedy: float

    @property
    def sampled(self) -> float:
        return self.successes / self.episodes

    @classmethod
    def of_cell(cls, cell: dict) -> LrRung:
        """The rung a recorded ladder cell measured (its `validation` evaluation, never the held-out one)."""
        v = cell["validation"]
        samples = v["eval_samples"]
        # Per-problem means of `samples` 0/1 rewards: counted back to episodes, so that ties are exact.
        successes = round(sum(v["sampled"]) * samples)
        return cls(
            cell["arm_settings"]["learning_rate"],
            successes,
            len(v["sampled"]) * samples,
            sum(v["greedy"]) / len(v["greedy"]),
        )


def choose_learning_rate(rungs: Sequence[LrRung]) -> tuple[float, str]:
    """The pre-registered choice of the RL learning rate (amendment 2): the rung with the most successful sampled
    validation episodes; a tie goes to the smaller learning rate (the smaller step from the warm start).

    Returns:
        `(learning_rate, reason)`.
    """
    if not rungs:
        raise ValueError("The learning-rate ladder needs at least one rung.")
    best = max(rungs, key=lambda r: (r.successes, -r.learning_rate))
    others = ", ".join(f"{r.learning_rate:g}: {r.sampled:.3f}" for r in rungs if r is not best)
    return (
        best.learning_rate,
        f"learning rate {best.learning_rate:g}: validation sampled success {best.sampled:.3f} "
        f"({best.successes} of {best.episodes})" + (f"; the others {others}" if others else ""),
    )


# ------------------------------------------------------------------------------------------------ budget

# Wall-time rates in seconds, bfloat16 autocast on this 2-core CPU (AVX512-BF16). Training rollouts: the first
# ablation's float32 cells (docs/ablation-superseded/first/cells) times 0.55, the bfloat16 speed-up measured on
# SmolLM2-135M (9.5 s against 19.5 s a step, `trl_agentic.warmstart.run_warmstart`): calculator GRPO 2.6 s per
# rollout (rollback's TRL control: 167 s for 64), rollback's agentic arm 3.5 s (224 s for 64, regenerations
# included); log search: 32 s per rollout of the snapshot arm (1022 s for 32; a control whose budget fits both files
# is charged that rate), warm start 15.7 s per step, greedy evaluation 3.9 s per problem. Calculator warm start and
# evaluation: the v2 calibration rungs on `medium` problems (bfloat16, 2026-11-27; the first ablation's greedy rate
# had left out sampling, which costs 1.7x greedy: a batch runs to its longest sample): 4.4 s per SFT step of 4
# traces (140 s for 32), 0.68 s per greedy problem (87 s for 128), 1.2 s per sampled episode (620 s for 512; the
# spread check alike), 1.7x greedy assumed for the log search. Hard calculator traces are ~20 % longer than easy
# ones and ~10 % longer than medium ones (clean traces 64-66, 67-76, 76-82 completion tokens with the model's
# tokenizer). Amendment 2: calculator GRPO rollouts at the rate of seed 0's `trl` cell on hard problems (1601 s for
# 512 rollouts, 2026-11-27: 3.13 s, where the float32-derived estimate had 1.72 s), rollback's at the first
# ablation's ratio to it (3.5 / 2.6). Amendment 4: the log search's rates measured on its seed-0 warm start
# (2026-12-04: 767 s for 48 SFT steps, 418 s greedy for 64 problems, 968 s for 128 sampled episodes) and on the first
# three undisturbed steps of the retired `trl_fit` (897 s for 48 rollouts of up to 640 tokens).
RATES = {
    "calculator": {
        "rollout": 1601 / 512,
        "rollback_rollout": 1601 / 512 * 3.5 / 2.6,
        "sft_step": 4.4 * 1.1,
        "greedy": 0.68 * 1.1,
        "sampled": 1.2 * 1.1,
    },
    "logsearch": {
        "rollout": 897 / 48,
        "rollback_rollout": 897 / 48,
        "sft_step": 767 / 48,
        "greedy": 418 / 64,
        "sampled": 968 / 128,
    },
}


def _evaluation_seconds(task: Task, problems: int | None = None) -> float:
    e, rates = task.evaluation, RATES[task.name]
    problems = e.problems if problems is None else problems
    return rates["greedy"] * problems + rates["sampled"] * problems * e.samples


def lr_ladder_seconds(task: Task, warmstart_steps: int) -> float:
    """The ladder's cost: each rung trains its arm and is evaluated on the validation problems only."""
    if not task.lr_ladder:
        return 0.0
    training = estimate_seconds(task, arm(task.name, task.lr_ladder_arm), warmstart_steps) - _evaluation_seconds(task)
    return (training + _evaluation_seconds(task, task.evaluation.validation_problems)) * len(task.lr_ladder)


def estimate_seconds(task: Task, arm_: Arm, warmstart_steps: int) -> float:
    """Estimated wall time of one cell (training and evaluation) from [`RATES`]."""
    rates, s = RATES[task.name], task.settings
    evaluation = _evaluation_seconds(task)
    if arm_.trainer == "warmstart":
        spread = rates["sampled"] * task.evaluation.spread_prompts * s["num_generations"]
        return rates["sft_step"] * warmstart_steps + spread + evaluation
    if arm_.compute_budget_from is not None:
        arm_ = arm(task.name, arm_.compute_budget_from)  # stopped at that arm's compute, estimated as its time
    rollouts = s["max_steps"] * s["per_device_train_batch_size"] * s["gradient_accumulation_steps"]
    rate = rates["rollback_rollout"] if arm_.overrides.get("enable_tool_rollback") else rates["rollout"]
    return rate * rollouts + evaluation


def budget(warmstart_steps: int = 64) -> dict:
    """`{task: {arm: seconds per seed}}`, the calibration's seconds and the total over the pre-registered seeds (the
    calculator's warm-start length is that of the calibration; `warmstart_steps` stands for it)."""
    out: dict = {"cells": {}, "calibration": 0.0, "lr_ladder": 0.0, "lr_ladders": {}}
    total = 0.0
    for task in TASKS.values():
        steps = task.settings.get("warmstart_steps", warmstart_steps)
        per_arm = {a.name: estimate_seconds(task, a, steps) for a in ARMS[task.name]}
        out["cells"][task.name] = per_arm
        total += sum(per_arm.values()) * len(task.seeds)
        if task.calibration_steps:
            ladder = Arm("warmstart", "", "warmstart")
            out["calibration"] += sum(estimate_seconds(task, ladder, n) for n in task.calibration_steps)
        out["lr_ladders"][task.name] = lr_ladder_seconds(task, steps)
        out["lr_ladder"] += out["lr_ladders"][task.name]
    out["total"] = total + out["calibration"] + out["lr_ladder"]
    extension = CALCULATOR
    out["extension"] = sum(out["cells"][extension.name].values()) * len(extension.extra_seeds)
    return out


# ------------------------------------------------------------------------------------------------ as registered


def _settings_text(settings: dict, skip: tuple[str, ...] = ()) -> str:
    return ", ".join(f"`{k}: {v}`" for k, v in settings.items() if k not in _MODEL and k not in skip)


def design_markdown() -> str:
    """The design as the pre-registration states it (generated; docs/ablation.md must contain it verbatim)."""
    lines = [
        f"Design `{DESIGN}`, amendment {AMENDMENT}. Model for every task: SmolLM2-135M-Instruct (embedded) + LoRA r=16, alpha 32, all linear "
        "layers, dropout 0; float32 weights, bfloat16 autocast (`bf16: true`), CPU.",
        "",
    ]
    for task in TASKS.values():
        e = task.evaluation
        lines += [
            f"**{task.name}** (seeds {', '.join(map(str, task.seeds))}"
            + (f"; extension seeds {', '.join(map(str, task.extra_seeds))}" if task.extra_seeds else "")
            + f"): {_settings_text(task.settings, ('learning_rate',) if task.lr_ladder else ())}"
            + (
                f"; `warmstart_steps` from the calibration ladder {', '.join(map(str, task.calibration_steps))} "
                "(seed 0)"
                if task.calibration_steps
                else ""
            )
            + (
                f"; `learning_rate` of every RL arm from the learning-rate ladder "
                f"{', '.join(f'{lr:g}' for lr in task.lr_ladder)} (`{task.lr_ladder_arm}` from seed 0's "
                f"`{arm(task.name, task.lr_ladder_arm).warm_start}`, RL "
                f"seed {LR_LADDER_RL_SEED}, judged on validation problems {e.validation_offset + 1}–"
                f"{e.validation_offset + e.validation_problems}: the most successful sampled episodes, a tie to the "
                "smaller rate)."
                if task.lr_ladder
                else "."
            ),
            f"Evaluation of every arm: {e.problems} held-out problems, greedy, and {e.samples} samples each at the "
            f"training temperature; warm-start spread check on {e.spread_prompts} training prompts x "
            f"`num_generations`.",
            "",
            "| arm | trainer | settings on top of the task's | what |",
            "|---|---|---|---|",
        ]
        for a in ARMS[task.name]:
            extra = _settings_text(a.overrides) or "-"
            if a.compute_budget_from:
                extra += f"; stopped once `{a.compute_budget_from}`'s token passes are spent"
            if a.keep_rate_from:
                extra += f"; `row_selection_fraction` = `{a.keep_rate_from}`'s keep rate"
            if a.trainer != "warmstart" and a.warm_start != "warmstart":
                extra += f"; trains from `{a.warm_start}`"
            lines.append(f"| `{a.name}` | {a.trainer} | {extra} | {a.what} |")
        lines.append("")
    lines += [
        "| comparison (a − b, paired by seed) | question | primary |",
        "|---|---|---|",
        *(f"| {c.task}: `{c.a}` − `{c.b}` | {c.question} | {'yes' if c.primary else ''} |" for c in COMPARISONS),
        "",
        f"Decision rule: 95 % Student t interval over seeds of the per-seed difference in sampled held-out success; "
        f"**helps** if it lies above 0, **hurts** if below, else **no effect larger than X** with X the larger "
        f"absolute bound; *underpowered* when X > {MIN_EFFECT}. Minimum effect worth detecting {MIN_EFFECT}; "
        f"minimum detectable effect (alpha {ALPHA}, power {POWER}) reported beside every verdict. Warm-start checks: "
        f">= {SPREAD_MIN:.0%} of groups with a reward spread, oracle SFT plateaued (< {PLATEAU_DELTA} from doubling).",
    ]
    mde = stats.minimum_detectable_effect(PLANNING_SD, len(CALCULATOR.seeds), ALPHA, POWER)
    lines.append(
        f"Planned minimum detectable effect with {len(CALCULATOR.seeds)} seeds at sd {PLANNING_SD}: {mde:.3f}; "
        f"with {len(LOGSEARCH.seeds)}: {stats.minimum_detectable_effect(PLANNING_SD, len(LOGSEARCH.seeds)):.3f}."
    )
    estimate = budget()
    lines += ["", "| task | arm | estimated seconds per seed |", "|---|---|---:|"]
    for task_name, per_arm in estimate["cells"].items():
        for name, seconds in per_arm.items():
            lines.append(f"| {task_name} | `{name}` | {seconds:.0f} |")
    lines.append(f"| calculator | calibration ladder (seed 0, once) | {estimate['calibration']:.0f} |")
    for task_name, seconds in estimate["lr_ladders"].items():
        if seconds:
            lines.append(f"| {task_name} | learning-rate ladder (seed 0's warm start, once) | {seconds:.0f} |")
    lines += [
        "",
        f"Estimated total: **{estimate['total'] / 3600:.1f} h** (the extension, if run: "
        f"{estimate['extension'] / 3600:.1f} h more). Rates: `trl_agentic/ablation/design.py`, `RATES`.",
    ]
    return "\n".join(lines) + "\n"


def planned_mde(task: Task) -> float:
    return stats.minimum_detectable_effect(PLANNING_SD, len(task.seeds), ALPHA, POWER)
