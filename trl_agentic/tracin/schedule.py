"""When the TracIn validation direction V is refreshed and when validation prompts are rolled out (pure functions).

The trainer mixin asks these at each generation window; the ablation report counts the rollouts an arm paid for with
the same functions, so the two cannot drift apart.
"""

from __future__ import annotations


def due(step: int, last: int | None, every: int) -> bool:
    """Whether an event last done at optimizer step `last` (`None`: never) is due again at `step`."""
    return last is None or step - last >= every


def window_starts(
    total_steps: int, steps_per_generation: int, num_iterations: int, gradient_accumulation_steps: int
) -> list[int]:
    """The optimizer step at the start of each generation window in `total_steps` optimizer steps.

    TRL generates at every `steps_per_generation × num_iterations`-th micro-step and counts an optimizer step every
    `gradient_accumulation_steps` micro-steps; a window shorter than an optimizer step repeats that step.
    """
    every = steps_per_generation * num_iterations
    return [
        micro // gradient_accumulation_steps for micro in range(0, total_steps * gradient_accumulation_steps, every)
    ]


def validation_rollout_steps(starts: list[int], refresh_steps: int, rollout_steps: int) -> list[int]:
    """The optimizer steps, of the window starts `starts`, at which validation is rolled out: V is refreshed when due
    at the start of a generation window, and validation rolled out at a refresh when due."""
    refreshed = rolled_out = None
    steps = []
    for step in starts:
        if due(step, refreshed, refresh_steps):
            refreshed = step
            if due(step, rolled_out, rollout_steps):
                rolled_out = step
                steps.append(step)
    return steps
