"""When the TracIn validation direction V is refreshed and when validation prompts are rolled out (pure functions).

The trainer mixin asks these at each generation window; the ablation report counts the validation rollouts an arm
paid for with the same functions, so the two cannot drift apart.
"""

from __future__ import annotations


def due(step: int, last: int | None, every: int) -> bool:
    """Whether an event last done at optimizer step `last` (`None`: never) is due again at `step`."""
    return last is None or step - last >= every


def generation_window(steps_per_generation: int, num_iterations: int, gradient_accumulation_steps: int) -> int:
    """Optimizer steps between two generation windows (TRL generates every `steps_per_generation × num_iterations`
    micro-steps); at least 1."""
    return max(1, steps_per_generation * num_iterations // gradient_accumulation_steps)


def validation_rollout_steps(total_steps: int, window: int, refresh_steps: int, rollout_steps: int) -> list[int]:
    """The optimizer steps in `[0, total_steps)` at which validation is rolled out: V is refreshed when due at the
    start of a generation window, and validation rolled out at a refresh when due."""
    refreshed = rolled_out = None
    steps = []
    for step in range(0, total_steps, window):
        if due(step, refreshed, refresh_steps):
            refreshed = step
            if due(step, rolled_out, rollout_steps):
                rolled_out = step
                steps.append(step)
    return steps
