"""A group the asynchronous worker has no trained row of still counts as consumed (resume position, epoch end).

TRL's `AsyncGRPOTrainer` counts a group as trained when its collator packs one of the group's rows; a checkpoint
resumes the worker at the first group never counted (`_save_checkpoint`'s `prompt_index`) and `num_train_epochs`
stops when the epoch's groups are counted. trl-agentic's worker pushes no trainable row for a group whose every
conversation was truncated under `mask_truncated_completions`, or lost: such a group used to stay uncounted, so every
later checkpoint resumed at it. Here the worker's scoring (TRL's code, then ours), the trainer-side stage and TRL's
collator run as in training, and the resume position is computed as TRL computes it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_async_equivalence import _samples, _three, _train
from test_async_rows import _group, _scoring_worker

from trl_agentic.async_grpo.compat import trainer_module, worker_module
from trl_agentic.async_grpo.rows import AgenticSequence


def _trl_group(gid: int, truncated: bool):
    """Two conversations of TRL's rows ending with EOS (9), or cut by the budget (5)."""
    seq = worker_module().TrainingSequence
    end = 5 if truncated else 9
    group = _group(
        [[seq([1, 2 + k, end], [0, 1, 1], [0.0] * 3, f"r{gid}{k}")] for k in range(2)], [[2, end], [3, end]]
    )
    group.group_id = gid
    return group


def _agentic_group(gid: int, truncated: bool, lost: bool):
    end = 5 if truncated else 9
    rows = [
        [AgenticSequence([1, 2 + k, end], [0, 1, 1], [0.0] * 3, f"c{k}", truncated=truncated, lost=lost)]
        for k in range(2)
    ]
    group = _group(rows, [[2 + k, end] for k in range(2)])
    group.group_id = gid
    return group


CASES = {
    # every feature off, `mask_truncated_completions` (TRL's rows less the truncated conversations')
    "features off, truncated": (None, True, lambda gid, bad: _trl_group(gid, truncated=bad)),
    "features on, truncated": ({"advantage": {}}, True, lambda gid, bad: _agentic_group(gid, bad, lost=False)),
    "features on, lost": ({"advantage": {}}, False, lambda gid, bad: _agentic_group(gid, False, lost=bad)),
    # an estimator: the worker pushes the untrained rows too, and the stage drops them after the estimator ran
    "estimator, lost": (
        {"advantage": {}, "push_untrained": True},
        False,
        lambda gid, bad: _agentic_group(gid, False, lost=bad),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_group_with_no_trained_row_is_counted_and_resume_starts_after_it(case):
    """Groups 0..3, group 1 without a trainable row: every trained row comes from 0, 2, 3, and the resume position
    after them is 4 (it was 1: a resumed run trained groups 2 and 3 again)."""
    from trl_agentic.async_grpo.stage import AgenticRolloutQueue

    agentic, mask, make = CASES[case]
    worker = _scoring_worker(agentic, mask, [1.0, 0.0])
    inner = queue.Queue()
    for gid in range(4):
        for sample in asyncio.run(worker._score_group(make(gid, gid == 1))):
            inner.put(sample)
    estimator_calls = []

    def estimator(batch, host):
        estimator_calls.append(batch.rewards.numel())
        return torch.zeros(batch.rewards.numel())

    trained_groups: set[int] = set()
    trainer = SimpleNamespace(
        args=SimpleNamespace(
            seed=0,
            max_staleness=4,
            temperature=1.0,
            chat_template_kwargs=None,
            group_baseline="episodes",
            snapshot_advantage="episode",
            scale_rewards="group",
            advantage_std_floor=1e-4,
        ),
        processing_class=None,
        _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m),
        model=torch.nn.Linear(1, 1),
        model_version=0,
        _observed_rows=[],
        _trained_groups=trained_groups,
    )
    stage = AgenticRolloutQueue(trainer, inner, estimator if agentic and agentic.get("push_untrained") else None)
    tm = trainer_module()
    collator = tm.DataCollatorForRollout(pad_token_id=0, groups_trained=trained_groups)
    collated = []
    while stage.qsize():
        sample = stage.get(timeout=0)
        row = tm.TreeRow()
        row.add(
            {
                key: getattr(sample, key)
                for key in ("input_ids", "completion_mask", "old_log_probs", "advantage", "group_id", "metrics")
            }
        )
        collator.torch_call([[row]])
        collated.append(int(sample.group_id))
    assert sorted(set(collated)) == [0, 2, 3]  # no row of group 1 is trained
    if estimator_calls:
        assert estimator_calls == [2, 2, 2, 2]  # the lost rows too, as the synchronous trainer's estimator sees them
    first_untrained = next(g for g in itertools.count() if g not in trained_groups)  # TRL's `_save_checkpoint`
    assert first_untrained == 4


def test_a_trainer_counts_a_group_pushed_without_rows_as_consumed(tiny_model_dir, tmp_path):
    """Through `AsyncAgenticGRPOTrainer` (a feature on, so the stage runs): group 1 is a worker's `consumed_marker`,
    the other groups are trained; after two steps group 1 is in TRL's `_trained_groups`, and no marker reached the
    loss (every consumed micro-batch holds 8 rows' tokens of real groups)."""
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer
    from trl_agentic.async_grpo.worker import consumed_marker

    samples = [s for s in _samples(agentic=True) if s.group_id != 1]
    marker = consumed_marker(
        SimpleNamespace(model_version=0, group_id=1, prompts=[[{"role": "user", "content": "q"}]])
    )
    samples.insert(4, marker)  # after group 0, as the worker pushes groups in order
    samples += [s for s in _samples(agentic=True) if s.group_id == 5]  # one more group for the prefetch
    for s in samples[-4:]:
        s.group_id = 6
    seen = {}

    def on_trainer(trainer):
        seen["trainer"] = trainer

    batches, *_ = _train(
        AsyncAgenticGRPOTrainer,
        AsyncAgenticGRPOConfig,
        tiny_model_dir,
        tmp_path,
        samples=samples,
        enable_tool_rollback=True,
        rollback_on_errors=["ValueError"],
        trainer_hook=on_trainer,
    )
    trained = seen["trainer"]._trained_groups
    assert len(batches) == 2
    assert {0, 1, 2, 3, 4} <= trained
    assert next(g for g in itertools.count() if g not in trained) >= 5


def test_an_estimator_refuses_rows_without_their_group(tiny_model_dir, tmp_path):
    """A rollout worker that pushes TRL's plain rows (no group size) with an estimator set: the estimator cannot run
    on a group, and training stops naming it (the worker's advantages were trained on, the estimator never called)."""
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer

    with pytest.raises(RuntimeError, match="advantage estimator runs on a group's rows"):
        _train(
            AsyncAgenticGRPOTrainer, AsyncAgenticGRPOConfig, tiny_model_dir, tmp_path, {"advantage_estimator": _three}
        )


def test_loop_settings_with_another_rollout_worker_are_said_to_do_nothing(tiny_model_dir, tmp_path, caplog):
    """The rollout loop's settings run in TRL's worker; with another worker the trainer says they do nothing."""
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer

    with caplog.at_level(logging.WARNING, logger="trl_agentic.async_grpo.trainer"):
        _train(
            AsyncAgenticGRPOTrainer,
            AsyncAgenticGRPOConfig,
            tiny_model_dir,
            tmp_path,
            samples=_samples(agentic=True),
            enable_tool_rollback=True,
            rollback_on_errors=["ValueError"],
            max_turn_tokens=64,
        )
    assert (
        "`enable_tool_rollback`, `max_turn_tokens` have no effect with a rollout worker other than TRL's"
        in caplog.text
    )


@pytest.mark.parametrize("trainer_name", ["AgenticGRPOTrainer", "AsyncAgenticGRPOTrainer"])
def test_a_snapshot_reward_func_that_does_not_import_fails_before_the_model_loads(trainer_name):
    """A `snapshot_reward_func` path that does not import is an error naming the field, raised before the model loads
    (the model here does not exist: a later check would fail on it instead). The asynchronous trainer imported it only
    in the rollout worker's child process."""
    import trl_agentic
    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer

    cls = AsyncAgenticGRPOTrainer if trainer_name.startswith("Async") else trl_agentic.AgenticGRPOTrainer
    config = AsyncAgenticGRPOConfig if trainer_name.startswith("Async") else trl_agentic.AgenticGRPOConfig
    for path, message in [
        ("no_such_module_xyz:f", "No module named"),
        ("math:no_such_function", "AttributeError"),
        ("math:pi", "not callable"),
    ]:
        args = config(output_dir="/nonexistent/out", snapshot_reward_func=path, report_to="none", use_cpu=True)
        with pytest.raises(ValueError, match=rf"`snapshot_reward_func='{path}'`.*{message}"):
            cls(model="/nonexistent/model", reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args)


def test_a_consumed_marker_passes_trls_score_loop_with_log_completions():
    """TRL's `_score_loop` prints every scored sample's `metrics["reward"]` with `log_completions=True`: the marker of
    a group without rows carries a NaN reward (it had none, and the worker's child died on `KeyError: 'reward'`) and is
    pushed to the queue."""
    import time

    for agentic, mask, make in CASES.values():
        worker = _scoring_worker(agentic, mask, [1.0, 0.0])
        group = make(7, True)
        group.queued_at = time.monotonic()
        worker.log_completions, worker.num_completions_to_print = True, 4
        worker._heartbeat_value = SimpleNamespace(value=0.0)
        worker._push_metrics = lambda values: None
        worker._inflight = worker._total_completion_tokens = worker._pushed_completion_tokens = 0
        worker._pushed_at, worker._total_groups_scored = time.monotonic(), 0
        worker.rollout_buffer, worker.queue_maxsize = queue.Queue(), 10

        async def score(worker=worker, group=group):
            worker._groups_to_score = asyncio.Queue()
            worker._groups_to_score.put_nowait(group)
            worker._groups_to_score.put_nowait(None)
            await worker._score_loop(asyncio.Event())

        asyncio.run(score())
        pushed = [worker.rollout_buffer.get_nowait() for _ in range(worker.rollout_buffer.qsize())]
        if agentic and agentic.get("push_untrained"):
            assert pushed and not any(s.trained for s in pushed)  # the lost rows, for the estimator
        else:
            from trl_agentic.async_grpo.worker import is_consumed_marker

            assert len(pushed) == 1 and is_consumed_marker(pushed[0]) and pushed[0].group_id == 7
            assert np.isnan(pushed[0].metrics["reward"])


def test_trls_own_worker_gets_no_warning_that_its_features_do_nothing(tiny_model_dir, tmp_path, caplog, monkeypatch):
    """With TRL's `AsyncRolloutWorker` the loop settings run (in trl-agentic's loop in its child): no warning. The
    trainer then waits for the vLLM server, here a stub that stops construction there."""
    from test_async_equivalence import scripted_async_trainer
    from trl.experimental.async_grpo import vllm_client

    class NoServer(Exception):
        pass

    def wait_for_server_ready(self, *args, **kwargs):
        raise NoServer

    config = {"enable_tool_rollback": True, "rollback_on_errors": ["ValueError"], "max_turn_tokens": 64}
    with caplog.at_level(logging.WARNING, logger="trl_agentic.async_grpo.trainer"), pytest.raises(NoServer):
        monkeypatch.setattr(vllm_client.VLLMClient, "wait_for_server_ready", wait_for_server_ready)
        scripted_async_trainer(tiny_model_dir, tmp_path, monkeypatch, config=config, server_ready=False)
    assert "no effect" not in caplog.text
