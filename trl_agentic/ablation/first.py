"""The first ablation (issue 18), superseded by issue 37's design (`trl_agentic.ablation`); kept so that its report
re-renders from its cells: `python -m trl_agentic.ablation.first render`. Only its report is kept here; the code that
ran its cells is in the history (`git show 009b255:trl_agentic/ablation.py`), and its statistics are
`trl_agentic.stats.bootstrap_interval`. Why it was superseded: docs/ablation.md, "Why a second design".

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
import json
import time
from collections.abc import Sequence
from pathlib import Path

from ..stats import bootstrap_interval

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


# ------------------------------------------------------------------------------------------------ cells


def _parse(settings: dict, trl: bool = False):
    """`(TaskArguments, config, ModelConfig)` from a flat settings dict; `trl`: TRL's own `GRPOConfig`, whose
    dataclass drops every agentic field."""
    from transformers import HfArgumentParser
    from trl import GRPOConfig, ModelConfig

    from ..config import AgenticGRPOConfig
    from ..tasks import TaskArguments

    parser = HfArgumentParser((TaskArguments, GRPOConfig if trl else AgenticGRPOConfig, ModelConfig))
    return parser.parse_dict(settings, allow_extra_keys=trl)


def _cell_path(cells: Path, feature: str, seed: int, arm: str) -> Path:
    return cells / feature / f"seed{seed}" / f"{arm}.json"


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

    # The config's defaults for fields the settings leave out. The task's held-out count is not read here: the text
    # world's 128 held-out tasks of plans up to 3 steps predate its world split, which now refuses them.
    args = _parse({**settings, "num_eval_tasks": 0})[1]
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
    """Re-render the superseded report from its cells (its runs were recorded 2026-11-25 to 2026-11-27)."""
    parser = argparse.ArgumentParser(prog="python -m trl_agentic.ablation.first", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("render",), nargs="?", default="render")
    parser.add_argument("--features", nargs="+", default=list(FEATURES), choices=list(FEATURES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--cells", default="docs/ablation-superseded/first/cells", help="The committed cells (JSON).")
    parser.add_argument("--doc", default="docs/ablation-superseded/first/ablation.md")
    a = parser.parse_args(argv)
    cells = Path(a.cells)
    command = (
        f"python -m trl_agentic.ablation --features {' '.join(a.features)} --seeds {' '.join(map(str, a.seeds))} "
        f"--steps 8 --num_eval 128 --cells {cells}"
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
