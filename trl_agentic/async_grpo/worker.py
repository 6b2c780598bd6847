"""trl-agentic's features inside TRL's asynchronous rollout worker (the spawned child process).

`AgenticAsyncRolloutLoop` subclasses TRL's `_AsyncRolloutLoop` and overrides two of its methods; with every feature
off (`agentic=None`) both call TRL's, unchanged:

- `_generate_one` (one conversation): runs trl-agentic's rollout loop (`AgenticRolloutLoop`, the synchronous
  trainer's loop, rollback / negatives / snapshots / further user turns included) for this one trajectory, in a worker
  thread, through `WorkerBackend`, which generates each turn with TRL's own `_generate_one_turn` (the worker's aiohttp
  session and vLLM request, the versioned adapter name) scheduled on the worker's event loop. So every trajectory
  proceeds on its own: a rollback of one trajectory regenerates only its failed turn while the others keep
  generating. The rows it returns are `AgenticSequence`s (`rows.sequences_from_loop`): the last segment, the
  negative rows and the earlier snapshot segments.
- `_score_group`: TRL's scoring (reward functions, environment rewards), then `rows.group_row_advantages` gives every
  row of the group (negatives and snapshots included: variable-size groups) its reward and advantage by the
  synchronous trainer's rules, and the samples become `AgenticRolloutSample`s carrying their row kind, reward,
  conversation index, the group's row count and the policy versions that generated the trajectory. The rows pushed
  are those the synchronous trainer trains on (`rows.score_group_rows`): not a lost rollout's regular and snapshot
  rows, but its negative rows.

Differences from TRL's own conversation handling, when a feature is on: turns are appended as tokens (tool results,
hints and user turns rendered as the synchronous trainer renders them) instead of re-tokenizing the whole
conversation each turn, so there is no re-tokenization drift and `fork_threshold_tokens` has no effect; a
`delete_context` call always starts a new row (a TRL "fork"); the completion budget `max_completion_length` is the
total of the trajectory's model and environment tokens (the synchronous rule), not a per-turn `max_tokens`.

Metrics (summed over the logging window, TRL's `_total` convention): `rollback/attempts_total`,
`rollback/recovered_total`, `rollback/exhausted_total`, `rollback/regenerated_tokens_total`,
`rollback/failed_turn_tokens_total`, `rollback/hints_dropped_total`, `negatives/saved_total`, `snapshots/closed_total`,
`context/tokens_freed_total`, `conversation/user_turns_total`, `conversation/user_turns_dropped_total`,
`infra/retries_total`, `infra/lost_rollouts_total`, `tools/truncated_turns_total`, `tools/malformed_calls_total` (with
`malformed_tool_call_feedback` or rollback), `tools/truncated_outputs_total` (`max_tool_output_chars`),
`tools/turn_cap_truncations_total` (`max_turn_tokens`); and per group `groups/rows_total` and
`negatives/rows_total`, `snapshots/rows_total` (rows kept after the per-group cap).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import math
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from ..batch import snapshot_reward
from ..rollout.loop import AgenticRolloutLoop, LoopConfig
from ..rollout.rendering import ChatRenderer
from ..rollout.types import RowKind
from .compat import worker_module
from .rows import is_truncated, pushed_rows, score_group_rows, segment_info, trajectory_rows

__all__ = ["AgenticAsyncRolloutLoop", "AgenticRolloutSample", "WorkerBackend"]

_worker = worker_module()
RolloutSample = _worker.RolloutSample

_KIND_NAMES = {int(RowKind.REGULAR): "regular", int(RowKind.NEGATIVE): "negative", int(RowKind.SNAPSHOT): "snapshot"}


@dataclass(slots=True)
class AgenticRolloutSample(RolloutSample):
    """TRL's `RolloutSample` plus what the trainer side needs (staleness per row kind, the estimator stage).

    Attributes:
        row_kind: `RowKind` of the row.
        reward: The row's reward (a negative row's penalty, a snapshot's episode reward plus its term).
        episode: Index of the row's conversation in its group.
        group_rows: Number of rows of its group pushed to the trainer (they are pushed one after the other).
        baseline_rows: Number of rows of its group its advantage was computed over; more than `group_rows` when a
            row was scored but not pushed (`rows.trained_rows`: a lost rollout's regular or snapshot row, or a row
            without a trained token).
        trained: False for a row that is not trained (a lost rollout's row, a row without a trained token), pushed
            only when an estimator runs on the trainer side (`rows.pushed_rows`: the estimator sees the group the
            synchronous trainer's would); the stage drops it after the estimator.
        policy_versions: `(first, last)` policy version that generated a turn of the trajectory; `model_version` is,
            as in TRL, the version when the group started (the `max_staleness` bound reads it, for every row kind).
    """

    row_kind: int = 0
    reward: float = math.nan
    episode: int = 0
    group_rows: int = 0
    baseline_rows: int = 0
    policy_versions: tuple = (0, 0)
    trained: bool = True


def consumed_marker(group) -> AgenticRolloutSample:
    """What the worker pushes for a group it has no row of to push (every conversation truncated under
    `mask_truncated_completions`, or lost): no tokens, not trained, a group of one. The trainer side counts the group
    as consumed (`stage.AgenticRolloutQueue`), as TRL counts a group one of whose rows it trained. Its reward is NaN
    (unscored), the one metric TRL's worker reads from every sample it scored (`log_completions` prints it)."""
    return AgenticRolloutSample(
        prompt=group.prompts[0] if group.prompts else [],
        completion=[],
        input_ids=np.zeros(0, dtype=np.int64),
        completion_mask=np.zeros(0, dtype=np.int64),
        old_log_probs=np.zeros(0, dtype=np.float32),
        advantage=0.0,
        model_version=group.model_version,
        group_id=group.group_id,
        metrics={"reward": math.nan},
        group_rows=1,
        trained=False,
    )


def is_consumed_marker(sample) -> bool:
    """Whether `sample` is a `consumed_marker` (a real row has at least its prompt's tokens)."""
    return not getattr(sample, "trained", True) and len(sample.input_ids) == 0


class _Stopping(Exception):
    """A trajectory abandoned because the worker is stopping."""


def environment_of(tool_dict: dict, standalone_tools=()):
    """The environment instance whose bound methods are this rollout's tools (TRL does not pass it on): what the
    rollout loop gets as the trajectory's environment (checkpoints, user turns). `standalone_tools` (the trainer's
    `tools`, listed first by TRL) are left out: a bound method among them (`client.search`) is not the environment's."""
    for tool in tool_dict.values():
        owner = getattr(tool, "__self__", None)
        if owner is not None and not inspect.ismodule(owner) and not any(tool == t for t in standalone_tools):
            return owner
    return None


class WorkerBackend:
    """`RolloutBackend` for one trajectory inside TRL's worker: generation through TRL's `_generate_one_turn`.

    Called from a worker thread; each generation request is scheduled on the worker's event loop and waited for, so
    the other trajectories keep generating meanwhile.
    """

    multi_process = False
    takes_turn_limits = True

    def __init__(self, rollout_loop: AgenticAsyncRolloutLoop, tools: list, event_loop):
        self._rl = rollout_loop
        self._loop = event_loop
        self.tools = tools
        self.tokenizer = rollout_loop.tokenizer
        self.max_completion_length = rollout_loop.max_tokens
        self.max_model_len = rollout_loop._agentic["max_model_len"]
        iterations = rollout_loop.max_tool_calling_iterations
        self.max_iterations = sys.maxsize if iterations is None else iterations
        self.stop_token_ids = {*rollout_loop.eos_token_ids, self.tokenizer.pad_token_id} - {None}
        self.versions: list[int] = []

    def generate(self, contexts, limits=None):
        ids, logprobs = [], []
        for k, context in enumerate(contexts):  # one trajectory queues at most one context per call
            self.versions.append(self._rl.model_version)
            limit = limits[k] if limits is not None else None
            future = asyncio.run_coroutine_threadsafe(self._rl._limited_turn(list(context), limit), self._loop)
            turn_ids, turn_logprobs = self._wait(future)
            ids.append(list(turn_ids))
            logprobs.append(list(turn_logprobs))
        return ids, logprobs

    def _wait(self, future):
        # Polled: once the worker is asked to stop (or its event loop is closed), the trajectory is abandoned at its
        # next generation request, so that stopping does not wait for whole multi-turn trajectories (see
        # `AgenticAsyncRolloutLoop._generate_one`).
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if self._rl._stop_event.is_set() or self._loop.is_closed():
                    future.cancel()
                    raise _Stopping from None

    def parse(self, ids, prefix, row, tools=None):
        from trl.chat_template_utils import parse_response

        return parse_response(self.tokenizer, ids, prefix=prefix, tools=self.tools if tools is None else tools)

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def tool_suffix_ids(self, tool_messages):
        return self._rl._renderer.tool_suffix_ids(tool_messages)

    def hint_ids(self, hint):
        return self._rl._renderer.hint_ids(hint)

    def user_turn_ids(self, content):
        return self._rl._renderer.user_turn_ids(content)

    def render_prompt(self, messages, row, tools=None):
        return self._rl._renderer.prompt_ids(messages, tools=self.tools if tools is None else tools)

    def new_environment(self, row, old):  # only with `tool_timeout`, which the async config refuses
        raise NotImplementedError("tool_timeout is not supported by the asynchronous trainer")

    def any_rank(self, flag, error=None):
        if error is not None:
            raise error
        return flag


def _without_truncated_conversations(samples: list, group, stop_token_ids) -> list:
    """TRL's own rows (every feature off) less every row of a truncated conversation (`rows.is_truncated` on TRL's
    completion stream), which `GRPOTrainer` would mask: its reward stayed in TRL's advantage statistics, and a row
    without a trained token is not pushed (TRL's packer cannot build a micro-batch of such rows). TRL makes each
    conversation's rows in order, one per sequence."""
    out, k = [], 0
    for completion_ids, sequences in zip(group.completions_ids, group.completions_sequences, strict=True):
        if not is_truncated(completion_ids, stop_token_ids):
            out.extend(samples[k : k + len(sequences)])
        k += len(sequences)
    if k != len(samples):
        raise RuntimeError(f"TRL scored {len(samples)} rows for {k} sequences")
    return out


def die_with_trainer() -> None:
    """In the rollout worker's child process: have the kernel send it SIGTERM when the trainer process, which spawned
    it, dies, however it dies (Linux; elsewhere nothing).

    TRL's worker child is a daemon process, which multiprocessing stops only at a normal exit of the trainer: a trainer
    stopped by SIGTERM (a scheduler's cancel or preemption), which runs no `finally` and no exit handler, left it
    running, and the vLLM server, whose graceful shutdown waits for the child's open connections, kept running with it
    (seen live, docs/async.md). The kernel ties the signal to the thread that spawned the child: the trainer's
    `train()` thread (TRL stops the child itself when `train()` returns). A trainer that died before the prctl is
    caught by the parent check. A refused prctl (a seccomp sandbox) is said on stderr, and the worker runs on."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if not sys.platform.startswith("linux") or parent is None:  # not a spawned child: a custom in-process worker
        return
    import os
    import signal

    from .supervisor import set_parent_death_signal

    set_parent_death_signal(signal.SIGTERM, "this rollout worker", "the trainer")
    if os.getppid() != parent.pid:  # the trainer is already gone
        os.kill(os.getpid(), signal.SIGTERM)


class TRLRolloutLoop(_worker._AsyncRolloutLoop):
    """TRL's asynchronous rollout loop, unchanged, in a child that dies with the trainer (`die_with_trainer`): what
    TRL's worker spawns when every feature is off."""

    def __init__(self, *args, **kwargs):
        die_with_trainer()
        super().__init__(*args, **kwargs)


class AgenticAsyncRolloutLoop(_worker._AsyncRolloutLoop):
    """TRL's asynchronous rollout loop with trl-agentic's trajectory loop and group advantages (module docstring).

    Args:
        agentic (`dict`, *optional*):
            `None` keeps TRL's behaviour exactly. Otherwise `{"loop": LoopConfig fields, "advantage": the fields
            `rows.group_row_advantages` reads, "max_model_len": int, "seed": int, "push_untrained": bool (an estimator
            runs on the trainer side: push the rows that are not trained too, `rows.pushed_rows`)}` (plain
            values: they are pickled into the spawned child).
        mask_truncated_completions (`bool`, *optional*, defaults to `False`):
            Train no row of a truncated conversation (`rows.is_truncated`) but its negative rows, as `GRPOTrainer`
            masks it; its reward stays in the group statistics. With every feature off, TRL's rows of it are dropped
            after TRL's scoring.
        **kwargs: TRL's `_AsyncRolloutLoop` arguments.
    """

    def __init__(self, *, agentic: dict | None = None, mask_truncated_completions: bool = False, **kwargs):
        die_with_trainer()
        super().__init__(**kwargs)
        self._agentic = agentic
        self._mask_truncated = mask_truncated_completions
        if agentic is None:
            return
        self._loop_config = LoopConfig(**agentic["loop"])
        self._adv_args = SimpleNamespace(**agentic["advantage"])
        self._segment_reward = snapshot_reward(self._adv_args.snapshot_reward_func)
        self._renderer = ChatRenderer(self.tokenizer, self.chat_template, self.chat_template_kwargs)
        self._seed_rng = random.Random(agentic.get("seed", 0))
        self._seed_lock = threading.Lock()
        # One thread per in-flight trajectory: a trajectory blocks its thread while its turn is generated.
        self._trajectory_pool = ThreadPoolExecutor(
            max_workers=max(1, self.max_inflight_tasks), thread_name_prefix="agentic-trajectory"
        )

    def run(self) -> None:
        try:
            super().run()
        finally:
            if self._agentic is not None:
                self._trajectory_pool.shutdown(wait=False, cancel_futures=True)
                # Rows the trainer will never read (it stopped) must not keep this process alive: the queue's feeder
                # thread blocks on a full pipe at exit (multi-turn rows are large), and the parent then waits 15 s
                # before terminating the worker.
                self.rollout_buffer.cancel_join_thread()
                self._metrics_queue.cancel_join_thread()

    # --------------------------------------------------------------------------------------------------- one rollout
    async def _generate_one(self, prompt, tool_dict, tools, group_id=0):
        if self._agentic is None:
            return await super()._generate_one(prompt, tool_dict, tools, group_id)
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        with self._seed_lock:
            seed = self._seed_rng.getrandbits(63)
        try:
            result, stats = await loop.run_in_executor(
                self._trajectory_pool,
                functools.partial(self._run_trajectory, prompt, tool_dict, tools, group_id, loop, seed),
            )
        except _Stopping:
            # TRL's generate loop waits for every in-flight rollout when it stops; an abandoned trajectory returns
            # no row at once (its group is never scored: the score loop has stopped).
            return [], [], [], 0, 0, None
        completion, completion_ids, sequences, n_calls, n_failures, _ = result
        # Metrics are touched on the event loop's thread only (TRL's accumulators are not locked).
        for key, value in stats.items():
            self._counters[key] += value
        self._push_rollout_metrics(
            turns=sum(1 for m in completion if m.get("role") == "assistant"),
            sequences=len(sequences),
            completion_ids=completion_ids,
            tally={
                "clean": 0.0,
                "realign": 0.0,
                "fork": 0.0,
                "transitions": 0.0,
                "drift_tokens": 0.0,
                "drift_max": 0.0,
            },
            loop_exhausted=False,
            duration_s=time.monotonic() - started,
        )
        return result

    async def _limited_turn(self, prompt_ids: list[int], limit: int | None):
        """One turn by TRL's `_generate_one_turn`, asking vLLM for at most `limit` tokens (what the trajectory can
        keep: its remaining budget, `max_turn_tokens`, the model's room) instead of the whole `max_completion_length`."""
        if limit is None or limit >= self.max_tokens:
            return await self._generate_one_turn(prompt_ids)
        # TRL's request reads `self.max_tokens`: a shallow copy of this loop (same session, counters, version) with
        # the request's own value, so concurrent trajectories never see each other's, and a subclass's override of
        # `_generate_one_turn` (its `super()` included) still runs.
        request = copy.copy(self)
        request.max_tokens = limit
        return await request._generate_one_turn(prompt_ids)

    def _run_trajectory(self, prompt, tool_dict, tools, group_id, event_loop, seed):
        """One trajectory through trl-agentic's loop (in a worker thread). Returns TRL's 6-tuple and counters."""
        backend = WorkerBackend(self, tools, event_loop)
        environment = environment_of(tool_dict, getattr(self, "_standalone_tools", ()))
        prompt_msgs = copy.deepcopy(list(prompt))
        prompt_ids = self._renderer.prompt_ids(prompt_msgs, tools=tools)
        loop = AgenticRolloutLoop(backend, self._loop_config, async_loop=event_loop, rng=random.Random(seed))
        # The first turn is asked for as the loop asks for later ones (at least one token: a prompt that leaves no
        # room is vLLM's to refuse, as in TRL's worker).
        first_limit = max(1, loop._turn_limit(prompt_ids, prompt_ids))
        (first_ids,), (first_logprobs,) = backend.generate([prompt_ids], limits=[first_limit])
        message = backend.parse(first_ids, prompt_ids, 0)
        sync_tools = {n: f for n, f in tool_dict.items() if not inspect.iscoroutinefunction(f)}
        async_tools = {n: f for n, f in tool_dict.items() if inspect.iscoroutinefunction(f)}
        prompts, prompt_id_lists = [prompt_msgs], [prompt_ids]
        completion_ids, completions, logprobs = [list(first_ids)], [[message]], [list(first_logprobs)]
        trl_tuple, result = loop.run(
            prompts,
            prompt_id_lists,
            completion_ids,
            completions,
            logprobs,
            [sync_tools],
            [async_tools],
            [environment] if environment is not None else None,
            group_ids=[group_id],
        )
        tool_mask, completions, completion_ids, logprobs, n_calls, n_failures, _ = trl_tuple
        rows = trajectory_rows(prompt_id_lists[0], trl_tuple, result, backend.stop_token_ids)
        versions = (min(backend.versions), max(backend.versions))
        for row in rows:
            row.policy_versions = versions
        s = result.stats
        stats = {
            "rollback/attempts_total": s.rollback_attempts,
            "rollback/recovered_total": s.rollback_recovered,
            "rollback/exhausted_total": s.rollback_exhausted,
            "rollback/regenerated_tokens_total": s.regenerated_tokens,
            "rollback/failed_turn_tokens_total": s.failed_turn_tokens,
            "rollback/hints_dropped_total": s.hints_dropped,
            "negatives/saved_total": s.negatives_saved,
            "snapshots/closed_total": s.snapshots,
            "context/tokens_freed_total": s.tokens_freed,
            "conversation/user_turns_total": s.user_turns,
            "conversation/user_turns_dropped_total": s.user_turns_dropped,
            "infra/retries_total": s.infra_retries,
            "infra/lost_rollouts_total": int(result.infra_failed[0]),
            "tools/truncated_turns_total": s.truncated_turns,
            "tools/malformed_calls_total": s.malformed_calls,
            "tools/truncated_outputs_total": s.truncated_outputs,
            "tools/turn_cap_truncations_total": s.turn_cap_truncations,
        }
        generated = [t for t, m in zip(completion_ids[0], tool_mask[0]) if m]
        return (completions[0], generated, rows, n_calls, n_failures, None), {k: float(v) for k, v in stats.items()}

    # --------------------------------------------------------------------------------------------------- one group
    async def _score_group(self, group):
        if self._agentic is not None and self._stop_event.is_set():
            return []  # it may hold abandoned trajectories (`_generate_one`)
        samples = await super()._score_group(group)
        if self._agentic is None:
            if self._mask_truncated:
                stops = {*self.eos_token_ids, self.tokenizer.pad_token_id} - {None}
                return _without_truncated_conversations(samples, group, stops) or [consumed_marker(group)]
            return samples
        rows = [row for rows in group.completions_sequences for row in rows]
        conversation = [c for c, rows in enumerate(group.completions_sequences) for _ in rows]
        if len(rows) != len(samples):
            raise RuntimeError(f"TRL scored {len(samples)} rows for {len(rows)} sequences")
        terms = [self._segment_term(r, group, c) for r, c in zip(rows, conversation)] if self._segment_reward else None
        scored, trained = score_group_rows(
            rows,
            conversation,
            [sample.metrics["reward"] for sample in samples],
            len(group.completions_sequences),
            self._adv_args,
            terms,
            mask_truncated=self._mask_truncated,
        )
        out = []
        for k, j, is_trained in pushed_rows(scored.keep, trained, self._agentic.get("push_untrained", False)):
            sample, row = samples[k], rows[k]
            advantage, reward = float(scored.advantages[j]), float(scored.rewards[j])
            metrics = dict(sample.metrics)
            metrics.update({f"rows/{name}_frac": float(row.kind == kind) for kind, name in _KIND_NAMES.items()})
            out.append(
                AgenticRolloutSample(
                    prompt=sample.prompt,
                    completion=sample.completion,
                    input_ids=sample.input_ids,
                    completion_mask=sample.completion_mask,
                    old_log_probs=sample.old_log_probs,
                    advantage=advantage,
                    model_version=sample.model_version,
                    group_id=sample.group_id,
                    metrics=metrics,
                    row_kind=int(row.kind),
                    reward=reward,
                    episode=conversation[k],
                    policy_versions=tuple(row.policy_versions),
                    trained=is_trained,
                )
            )
        for sample in out:
            sample.group_rows, sample.baseline_rows = len(out), int(sum(scored.keep))
        kinds = [s.row_kind for s in out if s.trained]
        out = out or [consumed_marker(group)]
        self._counters["groups/rows_total"] += len(kinds)
        self._counters["negatives/rows_total"] += kinds.count(int(RowKind.NEGATIVE))
        self._counters["snapshots/rows_total"] += kinds.count(int(RowKind.SNAPSHOT))
        return out

    def _segment_term(self, row, group, conversation: int) -> float:
        if row.kind != RowKind.SNAPSHOT:
            return 0.0
        # `row` is the dataset row, as the synchronous trainer passes it: TRL keeps its columns but the prompt.
        dataset_row = {key: values[conversation] for key, values in group.reward_kwargs.items()}
        dataset_row["prompt"] = group.prompts[conversation]
        return float(self._segment_reward(segment_info(row, dataset_row)))
