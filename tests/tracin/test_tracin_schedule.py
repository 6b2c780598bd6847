"""The validation schedule (refresh V, roll out validation) against a closed form."""

import math

from hypothesis import given
from hypothesis import strategies as st

from trl_agentic.tracin.schedule import due, generation_window, validation_rollout_steps


def test_due():
    assert due(0, None, 5)
    assert not due(4, 0, 5) and due(5, 0, 5) and due(9, 3, 5)


def test_generation_window_in_optimizer_steps():
    assert generation_window(4, 1, 4) == 1  # TRL's default: steps_per_generation = gradient_accumulation_steps
    assert generation_window(4, 2, 2) == 4
    assert generation_window(1, 1, 4) == 1  # a window shorter than an optimizer step: every step


@given(
    total=st.integers(0, 60),
    window=st.integers(1, 6),
    refresh=st.integers(1, 12),
    rollout=st.integers(1, 12),
)
def test_rollouts_at_a_fixed_period(total, window, refresh, rollout):
    # Refreshes fall on window starts at least `refresh` apart: every window * ceil(refresh / window) steps; rollouts
    # on refreshes at least `rollout` apart: every period * ceil(rollout / period) steps, from step 0.
    period = window * math.ceil(refresh / window)
    period *= math.ceil(rollout / period)
    assert validation_rollout_steps(total, window, refresh, rollout) == list(range(0, total, period))
