"""The asynchronous trainer's stage passes a group's rows on in a random order (`AgenticRolloutQueue._in_random_order`).

TRL's `RolloutQueueDataset` drops a row read more than `max_staleness` policy versions after its group started, so the
rows read last are dropped most; the worker pushes a group's conversations in the order they finished (the ones with
rollbacks, and their negative rows, last). The end-to-end tests read through TRL's own dataset: in the worker's order
every negative row is dropped, in the stage's order every kind is dropped at the group's rate.
"""

from __future__ import annotations

import queue
import random
from collections import Counter, defaultdict
from types import SimpleNamespace

import numpy as np

from trl_agentic.async_grpo.stage import AgenticRolloutQueue
from trl_agentic.async_grpo.worker import AgenticRolloutSample
from trl_agentic.rollout.types import RowKind

STEP = 8  # samples a step trains: TRL's per_device_train_batch_size x gradient_accumulation_steps here
REGULAR, NEGATIVES = 8, 2  # a group of 8 rollouts whose last one saved two failed attempts


def _row(group_id: int, episode: int, kind: RowKind, version: int, group_rows: int, trained=True):
    return AgenticRolloutSample(
        prompt=[],
        completion=[],
        input_ids=np.arange(4),
        completion_mask=np.array([0, 0, 1, 1]),
        old_log_probs=np.zeros(4, dtype=np.float32),
        advantage=float(episode),
        model_version=version,
        group_id=group_id,
        metrics={"kind": int(kind)},  # what TRL's dataset yields of a sample: its metrics, not its kind
        row_kind=int(kind),
        reward=0.0,
        episode=episode,
        group_rows=group_rows,
        trained=trained,
    )


class _Worker:
    """The worker's queue, made as it is read: a group is pushed when the trainer wants a row and none is queued, at
    the current policy version, in the worker's order (regular rows as their conversations finished, the last
    conversation's negative rows after its regular row). `group_rows=0` marks rows of a worker that does not say."""

    def __init__(self, trainer, group_rows: bool):
        self.trainer, self.group_rows, self.rows, self.groups = trainer, group_rows, [], 0

    def get(self, timeout=None):
        if not self.rows:
            n = REGULAR + NEGATIVES if self.group_rows else 0
            version = self.trainer.model_version
            self.rows = [_row(self.groups, e, RowKind.REGULAR, version, n) for e in range(REGULAR)]
            self.rows += [_row(self.groups, REGULAR - 1, RowKind.NEGATIVE, version, n) for _ in range(NEGATIVES)]
            self.groups += 1
        return self.rows.pop(0)

    def qsize(self):
        return len(self.rows)


def _read(group_rows: bool, steps: int, seed: int = 0):
    """Train `steps` steps of `STEP` samples through TRL's dataset (the policy version moves on after each step,
    `max_staleness=0`): the kinds read and dropped, counted from the stage's per-kind metrics."""
    from accelerate import PartialState

    from trl_agentic.async_grpo.compat import trainer_module

    PartialState()  # TRL's dataset logs through accelerate's logger
    metrics = defaultdict(list)
    trainer = SimpleNamespace(
        model_version=0, args=SimpleNamespace(max_staleness=0, seed=seed), _metrics={"train": metrics}
    )
    trainer._observed_rows = []
    stage = AgenticRolloutQueue(trainer, _Worker(trainer, group_rows))
    dataset = trainer_module().RolloutQueueDataset(
        rollout_queue=stage,
        model_version_fn=lambda: trainer.model_version,
        check_health_fn=lambda s: None,
        stale_after_s=10,
        metrics=metrics,
        max_staleness=0,
        poll_interval_s=0.01,
    )
    it = iter(dataset)
    kept = Counter()
    for _ in range(steps):
        for _ in range(STEP):
            kept[RowKind(next(it)["metrics"]["kind"])] += 1
        trainer.model_version += 1
    dropped = {
        kind: sum(metrics[f"sample/dropped_stale_{name}_total"])
        for kind, name in ((RowKind.REGULAR, "regular"), (RowKind.NEGATIVE, "negative"))
    }
    return kept, dropped


def test_in_the_workers_order_every_negative_row_is_dropped():
    """The control, rows passed on as pushed (a worker that does not give `group_rows`): each step trains a group's
    first 8 rows, its regular ones, and the negatives, read after the version moved on, are all dropped."""
    kept, dropped = _read(group_rows=False, steps=200)
    assert kept[RowKind.NEGATIVE] == 0 and kept[RowKind.REGULAR] == 200 * STEP
    assert dropped[RowKind.NEGATIVE] == 2 * 199 and dropped[RowKind.REGULAR] == 0  # the last group's wait unread


def test_in_the_stages_order_every_kind_is_dropped_at_the_groups_rate():
    """The same reads with the groups' rows in the stage's random order: of each group 2 of 10 rows are dropped, and a
    negative row is dropped as often as a regular one (binomial sd of the rate over 400 negatives: 0.02)."""
    kept, dropped = _read(group_rows=True, steps=200)
    assert sum(kept.values()) == 200 * STEP
    negatives, regular = 2 * 200, REGULAR * 200
    negative_rate = dropped[RowKind.NEGATIVE] / negatives
    regular_rate = dropped[RowKind.REGULAR] / regular
    assert dropped[RowKind.NEGATIVE] + dropped[RowKind.REGULAR] == 2 * 199
    assert abs(negative_rate - 0.2) < 0.06 and abs(regular_rate - 0.2) < 0.03
    assert abs(negative_rate - regular_rate) < 0.06


def _group(group_id: int, n: int, trained=None):
    trained = trained or [True] * n
    return [_row(group_id, e, RowKind.REGULAR, 0, n, trained=t) for e, t in enumerate(trained)]


def _stage(seed=0, estimator=None):
    trainer = SimpleNamespace(
        model_version=0,
        args=SimpleNamespace(max_staleness=4, seed=seed),
        _metrics={"train": defaultdict(list)},
        _observed_rows=[],
    )
    inner = queue.Queue()
    stage = AgenticRolloutQueue(trainer, inner)
    if estimator is not None:  # an estimator's stage without a model: `_estimate` replaced by a plain function
        stage._estimator = True
        stage._estimate = estimator
    return stage, inner


def _drain(stage, inner, groups):
    for group in groups:
        for row in group:
            inner.put(row)
    out = []
    while True:
        try:
            out.append(stage.get(timeout=0))
        except queue.Empty:
            return out


def test_each_group_is_a_permutation_drawn_from_the_seed_and_the_group_id():
    """Every row once, groups not mixed and in their order; the permutation is a function of (seed, group id): the
    same on another read, another for another seed; over groups every row is at every position."""
    stage, inner = _stage(seed=3)
    groups = [_group(g, 5) for g in range(40)]
    out = _drain(stage, inner, groups)
    assert [r.group_id for r in out] == [g for g in range(40) for _ in range(5)]
    orders = [tuple(r.episode for r in out[5 * g : 5 * g + 5]) for g in range(40)]
    assert all(sorted(o) == list(range(5)) for o in orders)
    again = _drain(*_stage(seed=3), [_group(g, 5) for g in range(40)])
    assert [r.episode for r in again] == [r.episode for r in out]
    other = _drain(*_stage(seed=4), [_group(g, 5) for g in range(40)])
    assert [r.episode for r in other] != [r.episode for r in out]
    assert len(set(orders)) > 30  # not one fixed permutation
    for position in range(5):
        assert {o[position] for o in orders} == set(range(5))
    expected = random.Random("3/row-order/7").sample(range(5), 5)
    assert list(orders[7]) == expected


def test_untrained_rows_are_dropped_and_a_single_row_passes():
    """Without an estimator a group's untrained rows are not pushed; rows marked untrained (an estimator's group)
    are not passed on, and a group of one row comes out as it went in."""
    stage, inner = _stage()
    out = _drain(stage, inner, [_group(0, 4, trained=[True, False, True, False]), _group(1, 1)])
    assert sorted(r.episode for r in out[:2]) == [0, 2] and [r.group_id for r in out] == [0, 0, 1]


def test_an_estimators_added_rows_are_not_always_last():
    """With an estimator the order is drawn after it ran: the rows it adds (RLVCR's expansions, appended after the
    group) take every position, and the rows it saw untrained are still dropped."""

    def estimator(group):
        extra = _row(group[0].group_id, 99, RowKind.EXPANSION, 0, len(group) + 1)
        return [*group, extra]

    stage, inner = _stage(estimator=estimator)
    groups = [_group(g, 4, trained=[True, True, True, False]) for g in range(30)]
    out = _drain(stage, inner, groups)
    assert len(out) == 30 * 4 and all(r.episode != 3 for r in out)
    positions = {[r.row_kind for r in out[4 * g : 4 * g + 4]].index(int(RowKind.EXPANSION)) for g in range(30)}
    assert positions == {0, 1, 2, 3}


def test_an_incomplete_group_is_not_merged_with_the_next():
    """A group cut short (a worker stopped between two of its rows) is released when the next group's first row
    arrives, not counted into it: the next group is still whole and permuted under its own id."""
    stage, inner = _stage(seed=2)
    cut = _group(0, 3)[:2]
    out = _drain(stage, inner, [cut, _group(1, 3)])
    assert [r.group_id for r in out] == [0, 0, 1, 1, 1]
    assert sorted(r.episode for r in out[:2]) == [0, 1]
    expected = random.Random("2/row-order/1").sample(range(3), 3)
    assert [r.episode for r in out[2:]] == expected


def test_a_group_being_collected_counts_as_queued():
    """TRL logs `qsize()` as `sample/rollout_queue_size`: rows held while their group is collected are still queued."""
    stage, inner = _stage()
    assert _drain(stage, inner, [_group(0, 3)[:2]]) == []
    assert inner.empty() and stage.qsize() == 2
    inner.put(_group(0, 3)[2])
    assert len(_drain(stage, inner, [])) == 3 and stage.qsize() == 0
