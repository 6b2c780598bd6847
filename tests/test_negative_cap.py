"""`max_negative_samples_per_group` across processes (`trl_agentic.batch.kept_negatives`): the rows kept do not
depend on how a group's rollouts are split across processes. The oracle is the loop's own rule, written as a plain
loop: iterations in order, rollouts in index order within one, a group saving negatives until its quota is spent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trl_agentic.batch import kept_negatives


def _loop_saves(failures: set[tuple[int, int]], rollouts: list[int], group_size: int, cap: int) -> list:
    """What one process's rollout loop saves: `(iteration, rollout)` in the order it saves them."""
    saved, count = [], {}
    for iteration in sorted({i for i, _ in failures}):
        for rollout in rollouts:  # the loop steps its rollouts in index order
            group = rollout // group_size
            if (iteration, rollout) in failures and count.get(group, 0) < cap:
                saved.append((iteration, rollout))
                count[group] = count.get(group, 0) + 1
    return saved


@settings(max_examples=200)
@given(
    failures=st.sets(st.tuples(st.integers(0, 4), st.integers(0, 11)), max_size=20),
    group_size=st.sampled_from([2, 3, 4, 6, 12]),
    cap=st.integers(0, 3),
    processes=st.sampled_from([1, 2, 3, 4]),
)
def test_the_cap_keeps_what_one_process_keeps_however_the_rollouts_are_split(failures, group_size, cap, processes):
    one_process = _loop_saves(failures, list(range(12)), group_size, cap)
    per_process = 12 // processes
    gathered = []  # each process's saved rows, in rank order (what `gather_object` returns)
    for rank in range(processes):
        gathered += _loop_saves(failures, list(range(rank * per_process, (rank + 1) * per_process)), group_size, cap)
    keep = kept_negatives(gathered, group_size, cap)
    assert sorted(n for n, ok in zip(gathered, keep) if ok) == sorted(one_process)
    # One process: its loop already applied the cap, nothing more is dropped.
    assert all(kept_negatives(one_process, group_size, cap))


def test_a_split_group_keeps_its_earliest_failure_not_the_first_rank_s():
    """Group of 4 split over 2 processes, cap 1: rank 0's rollout fails at iteration 2, rank 1's at iteration 0.
    Rank order (the former rule) kept rank 0's; one process keeps the earlier one, rank 1's."""
    assert kept_negatives([(2, 1), (0, 2)], group_size=4, cap=1) == [False, True]
