"""Guards of the asynchronous trainer's stage and set-up (found by a review, each failed before its fix).

- `AgenticRolloutQueue.get` gives TRL's dataset `queue.Empty` while only groups without a row to train arrive (it
  looped forever: no step, no log, no health check), warns at a streak of them and stops after a whole pass;
- the estimator does not run on a group TRL's dataset drops as stale, every row;
- `scale_rewards="none"` with every feature off warns that TRL scales the advantages anyway;
- the negative-reward warning of the synchronous trainer is given here too;
- the environment a worker's rollout loop checkpoints is the environment, not the owner of a standalone tool;
- an environment given as a `functools.partial` (TRL's worker asks for picklable factories) is probed like a class,
  a function through its return annotation (never called in the trainer).
"""

import collections
import functools
import logging
import queue
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trl_agentic.async_grpo.stage import UNTRAINED_GROUPS_LIMIT, UNTRAINED_GROUPS_WARNING, AgenticRolloutQueue
from trl_agentic.async_grpo.worker import AgenticRolloutSample, consumed_marker, environment_of
from trl_agentic.rollout.types import RowKind


def _trainer(model_version=0, max_staleness=2, dataset_size=None):
    return SimpleNamespace(
        args=SimpleNamespace(seed=0, max_staleness=max_staleness),
        _metrics={"train": collections.defaultdict(list)},
        model_version=model_version,
        _trained_groups=set(),
        _observed_rows=collections.deque(),
        train_dataset=None if dataset_size is None else [{}] * dataset_size,
    )


def _marker(group_id):
    return consumed_marker(
        SimpleNamespace(prompts=[[{"role": "user", "content": "q"}]], model_version=0, group_id=group_id)
    )


def _row(group_id, k, version=0, kind=RowKind.REGULAR, reward=None, rows=4):
    return AgenticRolloutSample(
        prompt=[],
        completion=[],
        input_ids=np.array([1, 2, 3, 4 + k]),
        completion_mask=np.array([0, 0, 1, 1]),
        old_log_probs=np.zeros(4, dtype=np.float32),
        advantage=0.0,
        model_version=version,
        group_id=group_id,
        metrics={"reward": float(k)},
        row_kind=int(kind),
        reward=float(k) if reward is None else reward,
        episode=k,
        group_rows=rows,
        baseline_rows=rows,
    )


def test_get_gives_the_dataset_empty_while_only_groups_without_a_row_arrive():
    """A worker that keeps pushing consumed markers (every rollout lost, or truncated under
    `mask_truncated_completions`): `get(timeout)` returns `queue.Empty` within about its timeout, so TRL's dataset runs
    its health check; the groups are counted as consumed all the same."""
    trainer = _trainer()
    inner, stop = queue.Queue(), threading.Event()

    def worker():  # a group every 10 ms, each a marker: faster than any real rollout, slower than reading one
        group_id = 0
        while not stop.wait(0.01):
            inner.put(_marker(group_id))
            group_id += 1

    producer = threading.Thread(target=worker, daemon=True)
    producer.start()
    stage = AgenticRolloutQueue(trainer, inner, None)
    outcome = []

    def call():
        try:
            stage.get(timeout=0.3)
            outcome.append("row")
        except queue.Empty:
            outcome.append("empty")

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=60)
    stop.set()
    producer.join(timeout=10)
    assert outcome == ["empty"]  # it looped forever: `get() never returned`
    assert len(trainer._trained_groups) > 0


def test_three_passes_without_a_row_to_train_are_an_error_after_warnings(caplog):
    """Warnings at 8, 16, 32 and 64 groups in a row; the error at three passes over the prompts (at least 64 groups:
    an early policy truncated under `mask_truncated_completions` fails a small dataset's groups in a row by chance)."""
    trainer = _trainer(dataset_size=30)
    inner = queue.Queue()
    for group_id in range(95):
        inner.put(_marker(group_id))
    stage = AgenticRolloutQueue(trainer, inner, None)
    with caplog.at_level(logging.WARNING, logger="trl_agentic.async_grpo.stage"):
        with pytest.raises(
            RuntimeError, match="90 groups in a row without a row to train .at least three passes over"
        ):
            stage.get(timeout=5)
    warnings = [r.getMessage() for r in caplog.records if "groups in a row" in r.getMessage()]
    assert [int(w.split(" groups")[0].rsplit(" ", 1)[1]) for w in warnings] == [UNTRAINED_GROUPS_WARNING, 16, 32, 64]
    # A small dataset: at least UNTRAINED_GROUPS_LIMIT groups (8 prompts: not 8 groups, nor 24).
    trainer, inner = _trainer(dataset_size=8), queue.Queue()
    for group_id in range(UNTRAINED_GROUPS_LIMIT - 1):
        inner.put(_marker(group_id))
    inner.put(_row(UNTRAINED_GROUPS_LIMIT - 1, 0, rows=1))
    assert AgenticRolloutQueue(trainer, inner, None).get(timeout=5).group_id == UNTRAINED_GROUPS_LIMIT - 1
    # A group with a row resets the streak: 7 markers, a row, 7 markers never stop the run.
    trainer, inner = _trainer(dataset_size=8), queue.Queue()
    for group_id in range(7):
        inner.put(_marker(group_id))
    inner.put(_row(7, 0, rows=1))
    for group_id in range(8, 15):
        inner.put(_marker(group_id))
    stage = AgenticRolloutQueue(trainer, inner, None)
    assert stage.get(timeout=5).group_id == 7
    with pytest.raises(queue.Empty):
        stage.get(timeout=0.2)


def test_get_with_no_wait_still_reads_a_whole_pushed_group():
    inner = queue.Queue()
    for k in range(4):
        inner.put(_row(0, k))
    stage = AgenticRolloutQueue(_trainer(), inner, None)
    assert sorted(stage.get(timeout=0).episode for _ in range(4)) == [0, 1, 2, 3]


def test_the_estimator_does_not_run_on_a_group_past_max_staleness():
    from accelerate.state import PartialState

    from trl_agentic.async_grpo.compat import trainer_module

    PartialState()  # TRL's dataset logs its drops through accelerate's logger

    calls = []

    def estimator(batch, trainer=None):
        calls.append(batch.rewards.numel())
        return torch.zeros(batch.rewards.numel())

    trainer = _trainer(model_version=10, max_staleness=2)
    trainer.args = SimpleNamespace(
        seed=0,
        max_staleness=2,
        scale_rewards="group",
        advantage_std_floor=0.1,
        group_baseline="episodes",
        snapshot_advantage="episode",
        chat_template_kwargs=None,
        temperature=1.0,
    )
    trainer.processing_class, trainer.model = None, torch.nn.Linear(1, 1)
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m)
    inner = queue.Queue()
    for group_id, version in ((0, 3), (1, 9)):  # group 0 started 7 versions ago: every row of it is stale
        for k in range(4):
            inner.put(_row(group_id, k, version=version))
    stage = AgenticRolloutQueue(trainer, inner, estimator)
    metrics = trainer._metrics["train"]
    dataset = trainer_module().RolloutQueueDataset(
        stage, lambda: trainer.model_version, lambda s: None, 1.0, metrics, max_staleness=2, poll_interval_s=0.1
    )
    rows = iter(dataset)
    trained = [next(rows) for _ in range(4)]
    assert {r["group_id"] for r in trained} == {1} and len(metrics["sample/dropped_stale_total"]) == 4
    assert calls == [4]  # group 1 only: it ran on both, [4, 4]


def test_a_negative_row_that_is_no_penalty_is_warned_about_once(caplog):
    """As the synchronous trainer warns (`batch.negative_not_a_penalty`): rewards in [-1, 1] and the default
    `negative_sample_reward=-0.5` give the failed attempt an advantage of 0."""
    inner = queue.Queue()
    for group_id in (0, 1):
        rewards = [-1.0, -1.0, -1.0, 1.0]
        for k, reward in enumerate(rewards):
            inner.put(_row(group_id, k, reward=reward, rows=5))
        inner.put(_row(group_id, 4, kind=RowKind.NEGATIVE, reward=-0.5, rows=5))
    stage = AgenticRolloutQueue(_trainer(), inner, None)
    with caplog.at_level(logging.WARNING, logger="trl_agentic.async_grpo.stage"):
        for _ in range(10):
            stage.get(timeout=5)
    warnings = [r.getMessage() for r in caplog.records if "is not a penalty" in r.getMessage()]
    assert len(warnings) == 1 and "reward (-0.5) is not below" in warnings[0] and "(lowest -1)" in warnings[0]
    # Below every episode: no warning.
    caplog.clear()
    inner = queue.Queue()
    for k, reward in enumerate([0.0, 0.0, 1.0, 1.0]):
        inner.put(_row(0, k, reward=reward, rows=5))
    inner.put(_row(0, 4, kind=RowKind.NEGATIVE, reward=-0.5, rows=5))
    stage = AgenticRolloutQueue(_trainer(), inner, None)
    with caplog.at_level(logging.WARNING, logger="trl_agentic.async_grpo.stage"):
        for _ in range(5):
            stage.get(timeout=5)
    assert not [r for r in caplog.records if "is not a penalty" in r.getMessage()]


class _SearchClient:
    def search(self, query: str) -> str:
        """
        Searches.

        Args:
            query: The query.
        """
        return "result"


class _Env:
    def reset(self, **kwargs):
        return None

    def act(self, command: str) -> str:
        """
        Acts.

        Args:
            command: The command.
        """
        return "ok"


def test_the_loop_environment_is_not_the_owner_of_a_standalone_tool():
    """TRL lists the standalone tools first (`self._standalone_tools + methods`): a client's bound `search` made the
    client "the environment", whose state rollback then checkpointed and restored instead of the environment's."""
    client, env = _SearchClient(), _Env()
    tool_dict = {t.__name__: t for t in [client.search, env.act]}
    assert environment_of(tool_dict, [client.search]) is env
    assert environment_of({"search": client.search}, [client.search]) is None  # no environment's method
    assert environment_of({"act": env.act}) is env


class UserTurnEnv:
    def __init__(self, turns: int = 2):
        self.turns = turns

    def reset(self, **kwargs):
        self.left = self.turns

    def lookup(self, key: str) -> str:
        """
        Looks a key up.

        Args:
            key: The key.
        """
        return key

    def _next_user_turn(self, assistant_message):
        self.left -= 1
        return "and the next question" if self.left >= 0 else None


class DeletingEnv(_Env):
    def delete_context(self, keep: int) -> str:
        """
        The user's own tool of this name.

        Args:
            keep: Unused.
        """
        return "mine"


@pytest.mark.parametrize(
    "factory",
    [UserTurnEnv, functools.partial(UserTurnEnv, turns=3), functools.partial(functools.partial(UserTurnEnv), turns=1)],
    ids=["class", "partial", "nested_partial"],
)
def test_environment_probes_read_a_partials_class(factory):
    from trl_agentic.async_grpo.trainer import _environment_probes
    from trl_agentic.envs.protocol import has_user_turns

    [(given, probe)] = _environment_probes(factory)
    assert given is factory and probe is UserTurnEnv and has_user_turns(probe)
    # A function is never called here (the worker builds environments; a factory may start a container): its return
    # annotation names the class, else it is not probed.
    calls = []

    def annotated() -> UserTurnEnv:
        calls.append(1)
        return UserTurnEnv(turns=1)

    assert _environment_probes({"a": annotated, "b": lambda: calls.append(1)}) == [(annotated, UserTurnEnv)]
    assert calls == []


def test_a_partial_user_turn_environment_runs_the_agentic_loop(tiny_model_dir, tmp_path, monkeypatch):
    """With user turns as the only feature, a partial factory kept TRL's own loop: no user turn ever happened."""
    from test_async_equivalence import _reward, scripted_async_trainer

    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer
    from trl_agentic.async_grpo.worker import AgenticAsyncRolloutLoop

    def build(factory, **overrides):
        trainer = scripted_async_trainer(
            tiny_model_dir, tmp_path, monkeypatch, config=overrides, environment_factory=factory
        )
        return trainer.rollout_worker

    worker = build(functools.partial(UserTurnEnv, turns=2))
    assert worker._loop_cls is AgenticAsyncRolloutLoop and "agentic" in worker._loop_kwargs
    # With snapshots on, an environment's own `delete_context` is refused (the loop would take its calls), also
    # behind a partial, before any model loads.
    for factory in (DeletingEnv, functools.partial(DeletingEnv)):
        with pytest.raises(ValueError, match="named `delete_context`"):
            build(factory, enable_context_snapshots=True)
    with pytest.raises(ValueError, match="named `delete_context`"):
        args = AsyncAgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, enable_context_snapshots=True)
        AsyncAgenticGRPOTrainer(model="unused", reward_funcs=_reward, args=args, tools=[DeletingEnv().delete_context])


class _ModelLoading(Exception):
    pass


@pytest.mark.parametrize(
    "values,warns",
    [
        ({"scale_rewards": "none"}, True),
        ({"scale_rewards": "group"}, False),
        ({"scale_rewards": "none", "enable_tool_rollback": True}, False),  # our advantages: 'none' is used
    ],
)
def test_scale_rewards_with_every_feature_off_warns_that_trl_scales(tmp_path, monkeypatch, values, warns):
    """With every feature off TRL's worker computes the advantages (divided by the std): `scale_rewards='none'` was
    silently ignored."""
    import warnings

    import trl_agentic.models
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer

    def stop(*args, **kwargs):
        raise _ModelLoading

    monkeypatch.setattr(trl_agentic.models, "resolve_model_path", stop)
    args = AsyncAgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **values)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(_ModelLoading):
        warnings.simplefilter("always")
        AsyncAgenticGRPOTrainer(
            model="unused", reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args
        )
    said = [w for w in caught if "`scale_rewards='none'` has no effect" in str(w.message)]
    assert len(said) == int(warns)


def test_trls_own_rows_between_groups_without_a_row_reset_the_streak(caplog):
    """Every feature off with `mask_truncated_completions`: TRL's own rows (no `group_rows`) pass through the stage
    and never reset the streak, so groups without a row spread over a run stopped it as if they came in a row."""
    from trl_agentic.async_grpo.compat import worker_module

    rollout_sample = worker_module().RolloutSample
    trainer, inner = _trainer(dataset_size=8), queue.Queue()
    for group in range(0, 2 * (UNTRAINED_GROUPS_LIMIT + 6), 2):
        for _ in range(4):  # a group of TRL's, trained
            inner.put(
                rollout_sample(
                    prompt=[], completion=[], input_ids=np.array([1, 2, 3, 4]), completion_mask=np.array([0, 0, 1, 1]),
                    old_log_probs=np.zeros(4, np.float32), advantage=0.5, model_version=0, group_id=group,
                    metrics={"reward": 1.0},
                )
            )  # fmt: skip
        inner.put(_marker(group + 1))  # then a group whose every conversation was truncated
    stage = AgenticRolloutQueue(trainer, inner, None)
    with caplog.at_level(logging.WARNING, logger="trl_agentic.async_grpo.stage"):
        read = [stage.get(timeout=5) for _ in range(4 * (UNTRAINED_GROUPS_LIMIT + 6))]
    assert len(read) == 4 * (UNTRAINED_GROUPS_LIMIT + 6)
    assert not any("groups in a row" in r.getMessage() for r in caplog.records)
