"""`curves.png`: per-step training curves from `trainer.state.log_history`."""

from __future__ import annotations

import math
from pathlib import Path

LEVEL_KEYS = [f"rlvcr/level_frac_{k}" for k in range(1, 5)]


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for entry in history:
        value = entry.get(key)
        if value is None or "step" not in entry or not isinstance(value, int | float) or math.isnan(value):
            continue
        steps.append(entry["step"])
        values.append(float(value))
    return steps, values


def train_entries(log_history: list[dict]) -> list[dict]:
    """The per-step training entries of a log history (not the final summary, not `eval_*` entries)."""
    return [
        e
        for e in log_history
        if "step" in e and "train_runtime" not in e and not any(k.startswith("eval_") for k in e)
    ]


def plot_curves(
    log_history: list[dict],
    path: str | Path,
    *,
    eval_results: dict[str, dict] | None = None,
    title: str | None = None,
) -> Path:
    """
    Plot reward, tool failure rate, rollbacks and negatives per step (plus the TracIn selected ratio and the RLVCR
    thinking-level mix when the run logged them) into one PNG.

    Args:
        log_history (`list[dict]`):
            `trainer.state.log_history` (one entry per logging step).
        path (`str` or `Path`):
            Output file (`.png`).
        eval_results (`dict[str, dict]`, *optional*):
            Held-out evaluation metrics by stage name (e.g. `{"before GRPO": {...}, "after GRPO": {...}}`); their
            `success_rate` is drawn as horizontal lines on the reward panel.
        title (`str`, *optional*):
            Figure title.

    Returns:
        `Path`: The written file.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = train_entries(log_history)
    panels = ["reward", "tools", "rollbacks", "negatives"]
    if any("tracin/selected_ratio" in e for e in history):
        panels.append("tracin")
    if any(k in e for e in history for k in LEVEL_KEYS):
        panels.append("levels")
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.2 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, panel in zip(flat, panels):
        if panel == "reward":
            steps, values = _series(history, "reward")
            ax.plot(steps, values, marker="o", ms=3, label="mean reward (train)")
            s_std, std = _series(history, "reward_std")
            if len(s_std) == len(steps) and steps:
                ax.fill_between(
                    steps, [v - d for v, d in zip(values, std)], [v + d for v, d in zip(values, std)], alpha=0.15
                )
            for key in sorted({k for e in history for k in e if k.startswith("rewards/") and k.endswith("/mean")}):
                s, v = _series(history, key)
                ax.plot(s, v, lw=1, ls=":", label=key.removeprefix("rewards/").removesuffix("/mean"))
            for (stage, metrics), color in zip((eval_results or {}).items(), ("tab:gray", "tab:green", "tab:purple")):
                value = metrics.get("success_rate")
                if value is not None and not math.isnan(value):
                    ax.axhline(value, color=color, ls="--", lw=1, label=f"held-out success, {stage}: {value:.0%}")
            ax.set_title("Reward per step")
        elif panel == "tools":
            for key, label in (
                ("tools/failure_frequency", "tool failure rate"),
                ("tools/call_frequency", "tool calls / rollout"),
            ):
                s, v = _series(history, key)
                if s:
                    ax.plot(s, v, marker="o", ms=3, label=label)
            ax.set_title("Tool calls")
        elif panel == "rollbacks":
            s, v = _series(history, "rollback/attempts")
            ax.bar(s, v, color="tab:orange", label="rollbacks")
            s2, v2 = _series(history, "rollback/recovered_ratio")
            if s2:
                twin = ax.twinx()
                twin.plot(s2, v2, color="tab:brown", marker=".", lw=1, label="recovered ratio")
                twin.set_ylim(-0.05, 1.05)
                twin.set_ylabel("recovered ratio")
            ax.set_title("Rollbacks per step")
        elif panel == "negatives":
            s, v = _series(history, "negatives/rows")
            ax.bar(s, v, color="tab:red", label="negative rows in the batch")
            s2, v2 = _series(history, "negatives/saved")
            if s2:
                ax.plot(s2, v2, color="black", marker=".", lw=1, label="saved")
            ax.set_title("Negative samples per step")
        elif panel == "tracin":
            s, v = _series(history, "tracin/selected_ratio")
            ax.plot(s, v, marker="o", ms=3, color="tab:cyan", label="selected ratio")
            ax.set_ylim(-0.05, 1.05)
            ax.set_title("TracIn selected ratio")
        elif panel == "levels":
            rows_by_level = [_series(history, key) for key in LEVEL_KEYS]
            steps = sorted({s for s, _ in rows_by_level for s in s})
            stacks = []
            for s, v in rows_by_level:
                lookup = dict(zip(s, v))
                stacks.append([lookup.get(step, 0.0) for step in steps])
            if steps:
                ax.stackplot(steps, *stacks, labels=[f"level {k}" for k in range(1, 5)], alpha=0.8)
            ax.set_ylim(0, 1)
            ax.set_title("RLVCR thinking-level mix")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7, loc="best")
        if not history:
            ax.text(0.5, 0.5, "no training steps logged", ha="center", va="center", transform=ax.transAxes)
    for ax in flat[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title, parse_math=False)  # a run's name or path, not mathtext: `$` is a dollar sign
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
