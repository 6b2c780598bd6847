"""The validation schedule (refresh V, roll out validation) against a closed form."""

import math

from hypothesis import given
from hypothesis import strategies as st

from trl_agentic.tracin.schedule import due, validation_rollout_steps, window_starts


def test_due():
    assert due(0, None, 5)
    assert not due(4, 0, 5) and due(5, 0, 5) and due(9, 3, 5)


def test_window_starts_worked_by_hand():
    assert window_starts(3, 4, 1, 4) == [0, 1, 2]  # TRL's default: steps_per_generation = gradient_accumulation_steps
    assert window_starts(9, 4, 2, 2) == [0, 4, 8]
    assert window_starts(2, 1, 1, 4) == [0, 0, 0, 0, 1, 1, 1, 1]  # a window shorter than an optimizer step
    assert window_starts(5, 3, 1, 2) == [0, 1, 3, 4]  # micro-steps 0, 3, 6, 9 of 10
    assert window_starts(0, 4, 1, 4) == []


@given(
    total=st.integers(0, 20),
    spg=st.integers(1, 6),
    iterations=st.integers(1, 3),
    accumulation=st.integers(1, 6),
)
def test_window_starts_match_trls_counters(total, spg, iterations, accumulation):
    # TRL's loop: `_step` counts micro-steps, a window starts when `_step % (spg x num_iterations) == 0`, and
    # `global_step` advances after every `gradient_accumulation_steps` micro-steps.
    starts, micro, global_step = [], 0, 0
    while global_step < total:
        for _ in range(accumulation):
            if micro % (spg * iterations) == 0:
                starts.append(global_step)
            micro += 1
        global_step += 1
    assert window_starts(total, spg, iterations, accumulation) == starts


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
    starts = window_starts(total, window, 1, 1)
    assert validation_rollout_steps(starts, refresh, rollout) == list(range(0, total, period))


def test_repeated_window_starts_refresh_once_per_step():
    # Four windows per optimizer step: V is refreshed at the first of them only.
    assert validation_rollout_steps(window_starts(3, 1, 1, 4), 1, 1) == [0, 1, 2]
