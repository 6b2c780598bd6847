"""Run outputs: a compact per-step progress line, training-trajectory recording, `curves.png` and `report.html`."""

from .callbacks import (
    CompactProgressCallback,
    TrajectoryRecorder,
    format_metric_table,
    format_step_line,
    install_compact_progress,
)
from .curves import plot_curves
from .report import select_trajectories, write_report

__all__ = [
    "CompactProgressCallback",
    "TrajectoryRecorder",
    "format_metric_table",
    "format_step_line",
    "install_compact_progress",
    "plot_curves",
    "select_trajectories",
    "write_report",
]
