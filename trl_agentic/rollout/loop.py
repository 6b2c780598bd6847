"""The multi-turn tool loop with rollback-and-retry, negative samples, context snapshots and several user turns.

This replaces `GRPOTrainer._tool_call_loop` when an agentic feature needs it (`AgenticGRPOTrainer` delegates to
TRL's own loop otherwise). It is plain data in, plain data out: generation, parsing and chat templating are reached
through a `RolloutBackend`, so tests drive the loop with scripted token sequences and the trainer plugs in TRL's own
`_generate_single_turn`, `parse_response` and `_get_tool_suffix_ids`.

Each rollout is in one of three states after a generated turn: it asked for tools, its turn ended without tools (the
environment may then supply the next user message, `_next_user_turn`), or it is done (no more user turns, a
truncated turn, or out of budget). Per iteration, every rollout with work is stepped:

1. tools: checkpoint the environment (rollback on), run the calls as TRL's loop does: the sync calls one by one, then
   the async calls together (`asyncio.gather`), their results in that order (an infrastructure error is retried in
   place; a call past `tool_timeout` leaves its environment behind, see `_isolate_timed_out_env`), then
   - on a model error matching `rollback_on_errors` with retries left: save the failed turn as a negative row (the
     failed turn only; earlier turns become its prompt), restore the environment, truncate the tokens and messages
     to the start of that turn (plus an optional masked hint) and queue the turn for regeneration;
   - on `delete_context`: close the segment as a snapshot row and continue from the re-rendered, shorter prompt;
   - otherwise append the tool results (masked) and queue the next turn;
2. user turn: append the environment's next user message (masked) and queue the next assistant turn;

then ONE batched generation call serves every queued rollout. With several processes every rank makes the same number
of generation calls (a dummy one when it has nothing to do), because generation can be a collective (ZeRO-3 gathers,
vLLM server mode), and an exception on one rank is re-raised on every rank at the next synchronisation instead of
leaving the others waiting in a collective.

A turn cut by `max_completion_length` or by `max_turn_tokens` (it fills the tokens it could keep without ending with
an end-of-sequence token; a turn the engine stopped earlier, on a stop token or string of `generation_kwargs`, is
complete) is counted in `truncated_turns` (and, when the per-turn cap cut it, in `turn_cap_truncations`) and is never rolled back,
trained as a negative, turned into a snapshot or checked for malformed calls; the rollout ends there. Tool calls that
TRL's parser still finds in it run as in TRL's loop (their side effects on the environment happen), and their results
are dropped: TRL drops them because they do not fit the budget, which is always the case when the cut filled it; a
turn cut by the per-turn cap ends the rollout by the same rule, whatever budget is left.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..envs.protocol import checkpoint_env, has_user_turns, next_user_turn, restore_env
from ..errors import FailedToolMessage, tool_call_failed
from .context import DELETE_CONTEXT_TOOL, apply_deletion, delete_context
from .parsing import parse_tool_calls, too_deep
from .tools import PARSE_ERROR, ErrorPolicy, ToolOutcome, failure, gather_async_calls, run_tool_call
from .types import ExtraRow, LoopResult, LoopStats, RowKind


class RolloutBackend(Protocol):
    """What the loop needs from a generation engine and a tokenizer."""

    max_completion_length: int
    max_model_len: int
    max_iterations: int
    multi_process: bool
    stop_token_ids: set[int]  # a turn that does not end with one of these was truncated

    # A backend with `takes_turn_limits = True` also gets `limits=`: per context, the most tokens the loop will keep
    # of its turn (`_turn_limit`), so that the engine generates no more (the asynchronous worker's vLLM requests).
    # One with `takes_call_limit = True` gets `limit=`: the largest of those for the whole call (one batched
    # generation: the trainer's engine); a call that only keeps other processes' collectives matched passes 1.
    def generate(self, contexts: list[list[int]]) -> tuple[list[list[int]], list[list[float]] | None]: ...

    # `tools`: the rollout's tools, passed only once a user turn changed them (absent: the row's initial tools).
    def parse(self, ids: list[int], prefix: list[int], row: int, tools: list | None = None) -> dict: ...

    def decode(self, ids: list[int]) -> str: ...

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]: ...

    def hint_ids(self, hint: str) -> list[int]: ...

    def user_turn_ids(self, content: str) -> list[int]: ...

    def render_prompt(self, messages: list[dict], row: int, tools: list | None = None) -> list[int]: ...

    def new_environment(self, row: int, old: Any) -> Any: ...

    def any_rank(self, flag: bool, error: BaseException | None = None) -> bool: ...


@dataclass
class LoopConfig:
    """The subset of `AgenticGRPOConfig` the loop reads (see the config for the meaning of each field)."""

    enable_tool_rollback: bool = False
    max_tool_retries: int = 3
    rollback_on_errors: list[str] = field(default_factory=list)
    rollback_feedback: str = "none"
    rollback_hint_template: str = "Your previous tool call failed with: {error}. Write a corrected call."
    infra_error_types: list[str] = field(default_factory=lambda: ["InfrastructureError"])
    max_infra_retries: int = 2
    save_negative_samples: bool = False
    max_negative_samples_per_group: int = 1
    tool_timeout: float = 0.0
    max_tool_output_chars: int | None = None
    malformed_tool_call_feedback: bool = False
    enable_context_snapshots: bool = False
    max_snapshots_per_episode: int = 4
    snapshot_downsample: str = "last"
    context_stub_text: str = "[deleted]"
    max_turn_tokens: int | None = None

    @classmethod
    def from_args(cls, args) -> LoopConfig:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})

    @property
    def detects_malformed_calls(self) -> bool:
        # Rollback needs to see a malformed call to roll it back, so it turns the detection on.
        return self.malformed_tool_call_feedback or self.enable_tool_rollback

    @property
    def policy(self) -> ErrorPolicy:
        return ErrorPolicy(list(self.rollback_on_errors), list(self.infra_error_types))


_TOOLS, _USER = "tools", "user"


@dataclass
class _Rollout:
    """Mutable state of one rollout inside the loop."""

    prompt_ids: list[int]
    completion_ids: list[int]
    tool_mask: list[int]
    logprobs: list[float] | None
    prompt_msgs: list[dict]  # the conversation that the current segment's tokens render (TRL's `prompts[i]`)
    completion_msgs: list[dict]  # every message the model produced or received in the episode (TRL's `completions[i]`)
    pending: str | None = None  # `_TOOLS`, `_USER` or None (done)
    calls: list[dict] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    turn_start: int = 0  # token offset in completion_ids where the current assistant turn starts
    turn_msg_start: int = 0  # index in completion_msgs of the current assistant turn
    segment_msg_start: int = 0  # index in completion_msgs where the current segment starts
    segment_prompt_len: int = 0  # number of prompt_msgs the current segment's prompt renders
    turn_k: int = 0  # assistant turn position (a regenerated turn keeps its position)
    turns_done: int = 0  # tool rounds executed (rolled-back rounds do not count)
    retries: dict[int, int] = field(default_factory=dict)
    in_retry: bool = False
    regenerating: bool = False
    cut: bool = False  # the last generated turn was cut by the budget (no end-of-turn token)
    segment_index: int = 0
    snapshots: list[ExtraRow] = field(default_factory=list)
    infra_failed: bool = False
    context: list[int] | None = None  # queued for generation when set
    rollbacks: list[dict] = field(default_factory=list)


class AgenticRolloutLoop:
    """Runs the tool loop for one generation batch. See the module docstring for the algorithm.

    Args:
        backend: Generation/tokenizer adapter.
        config: Loop settings.
        async_loop: Event loop for async tools (TRL runs one in a daemon thread).
        rng: Random generator for snapshot downsampling.
    """

    def __init__(self, backend: RolloutBackend, config: LoopConfig, async_loop=None, rng: random.Random | None = None):
        self.backend = backend
        self.config = config
        self.policy = config.policy
        self.async_loop = async_loop
        self.rng = rng or random.Random(0)

    # ------------------------------------------------------------------------------------------------------------
    def run(
        self,
        prompts: list[list[dict]],
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        completions: list[list[dict]],
        logprobs: list[list[float]] | None,
        sync_tool_dicts: list[dict],
        async_tool_dicts: list[dict],
        environments: list[Any] | None,
        group_ids: list[int] | None = None,
    ) -> tuple[tuple, LoopResult]:
        """Run the loop. Arguments are TRL's per-rollout lists (mutated in place, like TRL's loop does).

        `prompt_ids[i]` is replaced by the prompt of rollout i's last segment when it deleted context; the tool dicts
        and `environments[i]` are updated in place when a user turn changes the tools or a timed-out call retires its
        environment.

        Returns:
            `(trl_tuple, result)` where `trl_tuple` is TRL's `(tool_mask, completions, completion_ids, logprobs,
            tool_call_count, tool_failure_count, tool_images)` for the primary rows, and `result` a `LoopResult`.
        """
        started = time.perf_counter()
        backend = self.backend
        n = len(prompt_ids)
        self._stats = stats = LoopStats()
        self._extra_rows: list[ExtraRow] = []
        self._group_ids = group_ids if group_ids is not None else list(range(n))
        self._negatives_per_group: dict[int, int] = {}
        self._iteration = 0  # generation calls so far: a rollout with work generates once per iteration
        self._environments = environments
        self._sync_tools, self._async_tools = sync_tool_dicts, async_tool_dicts
        self._tool_lists: dict[int, list] = {}  # rows whose tools a user turn changed
        self._deletion_withdrawn: set[int] = set()  # rows whose user turn removed `delete_context`

        rollouts = []
        for i in range(n):
            r = _Rollout(
                prompt_ids=prompt_ids[i],
                completion_ids=completion_ids[i],
                tool_mask=[1] * len(completion_ids[i]),
                logprobs=logprobs[i] if logprobs is not None else None,
                prompt_msgs=prompts[i],
                completion_msgs=completions[i],
            )
            r.turn_msg_start = max(0, len(r.completion_msgs) - 1)
            r.segment_prompt_len = len(r.prompt_msgs)
            if self._hit_turn_cap(completion_ids[i], backend.max_completion_length):
                stats.turn_cap_truncations += 1  # the first turn, generated by TRL under the same cap
            limit = self._turn_limit(prompt_ids[i], prompt_ids[i])  # what TRL's first generation could keep
            self._after_turn(i, r, completion_ids[i], completions[i][-1] if completions[i] else {}, limit)
            rollouts.append(r)

        error: BaseException | None = None
        while True:
            queued: list[int] = []
            try:
                for i, r in enumerate(rollouts):
                    if r.pending == _TOOLS and r.turns_done >= backend.max_iterations:
                        r.pending = None  # iteration cap: leftover calls stay unexecuted, like TRL
                    if r.pending is not None:
                        self._step(i, r)
                    if r.context is not None:
                        queued.append(i)
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                error = e
            if not self._any_rank(bool(queued), error):
                break
            try:
                self._generate(rollouts, queued)
            except Exception as e:  # noqa: BLE001 - re-raised at the next synchronisation, on every rank
                error = e
            self._iteration += 1

        # Close: snapshot downsampling.
        infra_failed, num_segments, rollback_log, segment_starts = [], [], [], []
        for i, r in enumerate(rollouts):
            kept = self._downsample(r.snapshots)
            stats.snapshot_rows += len(kept)
            self._extra_rows.extend(kept)
            infra_failed.append(r.infra_failed)
            num_segments.append(r.segment_index + 1)
            rollback_log.append(r.rollbacks)
            segment_starts.append(r.segment_msg_start)
            prompt_ids[i] = r.prompt_ids
            completion_ids[i] = r.completion_ids
            if logprobs is not None:
                logprobs[i] = r.logprobs
        tool_mask = [r.tool_mask for r in rollouts]
        stats.loop_seconds = time.perf_counter() - started
        trl_tuple = (
            tool_mask,
            completions,
            completion_ids,
            logprobs,
            stats.tool_calls,
            stats.tool_failures,
            [[] for _ in range(n)],
        )
        # Per rollout, whether each tool call of its last segment (the regular row) failed, read from the messages.
        tool_failed = [
            [tool_call_failed(m) for m in r.completion_msgs[r.segment_msg_start :] if m.get("role") == "tool"]
            for r in rollouts
        ]
        return trl_tuple, LoopResult(
            self._extra_rows, infra_failed, num_segments, stats, rollback_log, segment_starts, tool_failed
        )

    def _any_rank(self, flag: bool, error: BaseException | None) -> bool:
        """Whether any rank has work; raises on every rank when any rank failed (never a rank left waiting)."""
        if self.backend.multi_process:
            return self.backend.any_rank(flag, error)
        if error is not None:
            raise error
        return flag

    def _tools_kwarg(self, i: int) -> dict:
        # Passed only when a user turn changed the tools, so a backend without the `tools` argument keeps working.
        return {"tools": self._tool_lists[i]} if i in self._tool_lists else {}

    def _env(self, i: int):
        return self._environments[i] if self._environments else None

    # ------------------------------------------------------------------------------------------------------------
    def _after_turn(self, i: int, r: _Rollout, ids: list[int], message: dict, limit: int) -> None:
        """Decide what a freshly generated turn asks for: tools, the next user turn, or nothing (done). `limit`: the
        most tokens the turn could keep (`_turn_limit`)."""
        r.calls, r.parse_errors = [], []
        # Cut: it filled its limit without an end-of-turn token. A turn that ended earlier without one was stopped by
        # the engine for another reason (`stop_token_ids` or stop strings in `generation_kwargs`): it is complete.
        r.cut = not ids or (ids[-1] not in self.backend.stop_token_ids and len(ids) >= limit)
        if r.cut:
            self._stats.truncated_turns += 1
        calls = message.get("tool_calls") if message else None
        r.calls = list(calls or [])
        if not calls and self.config.detects_malformed_calls and not r.cut:
            parsed = parse_tool_calls(self.backend.decode(ids))
            if parsed.errors:  # TRL's parser gave up silently: tell the model what was wrong
                r.calls, r.parse_errors = parsed.calls, parsed.errors
        deep = [too_deep(c) for c in r.calls] if not r.cut else []  # a cut turn's calls run as in TRL, never copied
        if any(deep):
            # Arguments nested too deep for the copies this loop makes (negative rows, deletions, checkpoints) are a
            # parse error the model reads (TRL's own loop, which runs when every feature is off, runs them).
            r.calls = [c for c, error in zip(r.calls, deep) if not error]
            r.parse_errors = [*r.parse_errors, *(error for error in deep if error)]
            if message and "tool_calls" in message:  # the turn as kept in the conversation (copied for negatives)
                if r.calls:
                    message["tool_calls"] = r.calls
                else:
                    del message["tool_calls"]
        if r.calls or r.parse_errors:
            r.pending = _TOOLS  # in a cut turn too: TRL runs the calls its parser found (see the module docstring)
            return
        if r.cut:
            r.pending = None  # no budget left for an answer
            return
        # A regenerated turn that calls no tool did not recover from the failed call: it is not counted as recovered
        # (nor is a later, unrelated tool round).
        r.in_retry = False
        if has_user_turns(self._env(i)):
            r.pending = _USER
        else:
            r.pending = None

    def _step(self, i: int, r: _Rollout) -> None:
        if r.pending == _USER:
            self._user_turn(i, r)
        else:
            self._tool_round(i, r)

    def _tool_round(self, i: int, r: _Rollout) -> None:
        cfg, backend, stats = self.config, self.backend, self._stats
        env = self._env(i)
        checkpoint = checkpoint_env(env) if (cfg.enable_tool_rollback and env is not None) else None
        prompt_msg_start = len(r.prompt_msgs)
        # The assistant message that asked for the tools joins the conversation (TRL does the same).
        if r.completion_msgs and r.turn_msg_start < len(r.completion_msgs):
            r.prompt_msgs.append(r.completion_msgs[r.turn_msg_start])

        outcomes, ordered_calls = self._run_calls(i, r)
        if any(_has_image(o.content) for o in outcomes):
            raise NotImplementedError("trl-agentic's tool loop does not handle images; use text environments.")
        stats.tool_calls += len(r.calls) + len(r.parse_errors)
        stats.tool_failures += sum(o.failed for o in outcomes)
        stats.malformed_calls += len(r.parse_errors)
        stats.truncated_outputs += sum(o.truncated for o in outcomes)
        tool_messages = [o.message() for o in outcomes]
        calls, r.calls, r.parse_errors, r.pending = r.calls, [], [], None

        if any(o.category == "infra" for o in outcomes):
            # Persistent infrastructure failure: keep the rollout out of the loss and stop it here.
            r.infra_failed = True
            stats.infra_failed_rollouts += 1
            r.completion_msgs.extend(tool_messages)
            return

        model_errors = [o for o in outcomes if o.category == "model"]
        if model_errors and cfg.enable_tool_rollback and not r.cut:
            if r.retries.get(r.turn_k, 0) < cfg.max_tool_retries:
                self._rollback(i, r, checkpoint, calls, tool_messages, model_errors, prompt_msg_start)
                return
            stats.rollback_exhausted += 1
        elif r.in_retry and not any(o.failed for o in outcomes):
            # The regenerated turn's calls all ran: an error outside `rollback_on_errors` is no recovery.
            stats.rollback_recovered += 1
        r.in_retry = False
        r.turns_done += 1

        r.completion_msgs.extend(tool_messages)
        r.prompt_msgs.extend(tool_messages)
        if cfg.enable_context_snapshots and not r.cut:
            # Parse-error outcomes come first: the calls' own outcomes (and tool messages) are the last len(calls).
            first = len(outcomes) - len(ordered_calls)
            deletes = [
                (c, m)
                for c, o, m in zip(ordered_calls, outcomes[first:], tool_messages[first:])
                if o.name == DELETE_CONTEXT_TOOL and not o.failed
            ]
            if deletes and self._snapshot(i, r, deletes, tool_messages):
                return
        suffix = backend.tool_suffix_ids(tool_messages)
        if r.cut or not self._fits(r, suffix):
            # A cut turn, or over budget: drop this round's messages and end the rollout as it is (TRL's behaviour,
            # #5521; a turn the per-turn cap cut ends the rollout too, see the module docstring).
            del r.completion_msgs[len(r.completion_msgs) - len(tool_messages) :]
            del r.prompt_msgs[prompt_msg_start:]
            return
        self._append_env_tokens(r, suffix)
        r.context = r.prompt_ids + r.completion_ids

    def _fits(self, r: _Rollout, suffix: list[int], reply: int = 0) -> bool:
        """Whether `suffix` fits the budgets, leaving `reply` completion tokens for the answer to it."""
        backend = self.backend
        completion = len(r.completion_ids) + len(suffix)
        # `<` under max_model_len already keeps one position free for generation (a tool result's answer too).
        return (
            completion + reply <= backend.max_completion_length
            and len(r.prompt_ids) + completion < backend.max_model_len
        )

    def _user_turn(self, i: int, r: _Rollout) -> None:
        """Ask the environment for the next user message; append it (masked) and queue the next assistant turn."""
        r.pending = None
        env = self._env(i)
        message = r.completion_msgs[r.turn_msg_start] if r.turn_msg_start < len(r.completion_msgs) else {}
        # The hook may advance the environment (BFCL opens the next turn's call record), so its state is kept until
        # the turn is known to fit: a turn the model never sees must leave no trace in the state the reward reads.
        before = checkpoint_env(env) if env is not None else None
        turn = next_user_turn(env, message or {"role": "assistant", "content": ""})
        if turn is None:
            return
        suffix = self.backend.user_turn_ids(turn.content)
        if not self._fits(r, suffix, reply=1):  # a user turn with no room left for its answer is not asked
            restore_env(env, before)
            self._stats.user_turns_dropped += 1
            return
        sync_tools, async_tools = self._sync_tools[i], self._async_tools[i]
        for name in turn.remove_tools:
            sync_tools.pop(name, None)
            async_tools.pop(name, None)
            if name == DELETE_CONTEXT_TOOL:
                self._deletion_withdrawn.add(i)
        for fn in turn.add_tools:
            if fn.__name__ == DELETE_CONTEXT_TOOL and self.config.enable_context_snapshots:
                if fn is not delete_context:
                    raise ValueError(
                        f"A user turn of {type(env).__name__} adds a tool named `{DELETE_CONTEXT_TOOL}`: with "
                        "`enable_context_snapshots=True` that name is trl-agentic's context deletion; rename the tool."
                    )
                self._deletion_withdrawn.discard(i)
            # A name is one tool: the sync and async dicts never both hold it (the sync one would shadow the new one).
            sync_tools.pop(fn.__name__, None)
            async_tools.pop(fn.__name__, None)
            target = async_tools if asyncio.iscoroutinefunction(fn) else sync_tools
            target[fn.__name__] = fn
        if turn.add_tools or turn.remove_tools:
            # Parsing (argument types) and re-rendering (snapshots) use the tools the rollout has from now on.
            self._tool_lists[i] = [*sync_tools.values(), *async_tools.values()]
        if message:
            r.prompt_msgs.append(message)  # the assistant's answer joins the conversation
        user = {"role": "user", "content": turn.content}
        r.prompt_msgs.append(user)
        r.completion_msgs.append(copy.deepcopy(user))
        self._stats.user_turns += 1
        self._append_env_tokens(r, suffix)
        r.context = r.prompt_ids + r.completion_ids

    def _run_calls(self, i: int, r: _Rollout) -> tuple[list[ToolOutcome], list[dict]]:
        """Run the turn's calls in TRL's order: the sync ones (and the calls that fail before running: unknown tool, an
        async tool's wrong arguments) one by one, then the async ones together, as TRL gathers them. An
        infrastructure error is retried in place (the call failed before it did anything, per the
        `InfrastructureError` contract), so calls that succeeded are never run twice.

        Returns:
            The outcomes (parse errors first, then the calls' in the order above) and the calls in that order.
        """
        outcomes = [failure("tool_call_parser", PARSE_ERROR, error, self.policy) for error in r.parse_errors]
        ordered: list[dict] = []
        deferred: list[tuple[dict, Any]] = []  # (async call, its coroutine)
        for call in r.calls:
            name = call.get("function", {}).get("name") if isinstance(call, dict) else None
            if (
                self.config.enable_context_snapshots
                and name == DELETE_CONTEXT_TOOL
                and i not in self._deletion_withdrawn
            ):
                outcome = self._check_delete(r, call)
            else:
                coroutine, outcome = self._start_async(i, call)
                if coroutine is not None:
                    deferred.append((call, coroutine, self._async_tools[i][name]))
                    continue
                outcome = outcome or self._run_sync(i, call)
            outcomes.append(outcome)
            ordered.append(call)
            if outcome.category == "infra":
                for _, coroutine, _ in deferred:
                    coroutine.close()  # never awaited: the rollout is lost, later calls of the turn are not run
                return outcomes, ordered
        if deferred:
            outcomes += self._run_async(i, [self._rebind(i, *d) for d in deferred])
            ordered += [call for call, _, _ in deferred]
        return outcomes, ordered

    def _rebind(self, i: int, call: dict, coroutine, fn) -> tuple[dict, Any]:
        """`(call, coroutine)` for the tool the rollout has now: a sync call of the turn that timed out retired the
        environment (`_isolate_timed_out_env`) after the async calls' coroutines were made, and they must not run on
        the retired instance (the rollout, and its reward, go on with the fresh one)."""
        current = self._async_tools[i][call["function"]["name"]]
        if current is fn:
            return call, coroutine
        coroutine.close()
        arguments = call["function"].get("arguments")
        return call, current(**({} if arguments is None else arguments))

    def _tool_call(self, i: int, call: dict, sync_tools: dict, async_tools: dict, timed: bool = True) -> ToolOutcome:
        started = time.perf_counter()
        outcome = run_tool_call(
            call,
            sync_tools,
            async_tools,
            timeout=self.config.tool_timeout if timed else 0.0,
            max_chars=self.config.max_tool_output_chars,
            policy=self.policy,
            async_loop=self.async_loop,
        )
        self._stats.tool_seconds += time.perf_counter() - started
        return outcome

    def _run_sync(self, i: int, call: dict) -> ToolOutcome:
        """One call run on its own (with infrastructure retries)."""
        cfg, stats, env = self.config, self._stats, self._env(i)
        # With a time limit, the state before each call: a call that times out leaves its thread running.
        before = checkpoint_env(env) if (cfg.tool_timeout and env is not None) else None
        for attempt in range(cfg.max_infra_retries + 1):
            outcome = self._tool_call(i, call, self._sync_tools[i], self._async_tools[i])
            if outcome.timed_out and before is not None:
                self._isolate_timed_out_env(i, before)
            if outcome.category != "infra":
                break
            if attempt < cfg.max_infra_retries:
                stats.infra_retries += 1
        return outcome

    def _start_async(self, i: int, call: dict) -> tuple[Any, ToolOutcome | None]:
        """`(coroutine, None)` for a call of an async tool; `(None, outcome)` when calling it raised at once (TRL
        reports that failure in the sync order); `(None, None)` for any other call."""
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            return None, None
        name, arguments = function.get("name"), function.get("arguments")
        arguments = {} if arguments is None else arguments  # as `run_tool_call`: a non-object raises TRL's TypeError
        if name in self._sync_tools[i] or name not in self._async_tools[i]:
            return None, None
        try:
            return self._async_tools[i][name](**arguments), None
        except Exception as e:  # noqa: BLE001 - reported to the model, as run_tool_call does
            return None, self._tool_call(i, _without_arguments(call), {name: _Replay(e)}, {}, timed=False)

    def _run_async(self, i: int, deferred: list[tuple[dict, Any]]) -> list[ToolOutcome]:
        """Run async calls together (TRL's `asyncio.gather`), each then classified by `run_tool_call`; a call with an
        infrastructure error is run again on its own."""
        cfg, stats = self.config, self._stats
        started = time.perf_counter()
        results = gather_async_calls([c for _, c in deferred], cfg.tool_timeout, self.async_loop)
        stats.tool_seconds += time.perf_counter() - started
        outcomes = []
        for (call, _), result in zip(deferred, results):
            name = call["function"]["name"]
            outcome = self._tool_call(i, _without_arguments(call), {name: _Replay(result)}, {}, timed=False)
            for _ in range(cfg.max_infra_retries):
                if outcome.category != "infra":
                    break
                stats.infra_retries += 1
                outcome = self._tool_call(i, call, {}, self._async_tools[i])
            outcomes.append(outcome)
        env = self._env(i)
        if env is not None and any(o.timed_out for o in outcomes):
            # The timed-out coroutines were cancelled; a thread one of them started may still run: the rollout goes
            # on with a fresh instance holding the state as it is now.
            self._isolate_timed_out_env(i, checkpoint_env(env))
        return outcomes

    def _isolate_timed_out_env(self, i: int, state: Any) -> None:
        """Retire an environment whose call timed out: its thread may still change it, so the rollout continues on a
        fresh instance holding the state from before the call (the trainer's pool gets the fresh one too)."""
        old = self._env(i)
        new = self.backend.new_environment(i, old)
        restore_env(new, state)
        self._environments[i] = new
        for tools in (self._sync_tools[i], self._async_tools[i]):
            for name, fn in list(tools.items()):
                if getattr(fn, "__self__", None) is old:
                    tools[name] = getattr(new, name)
        if i in self._tool_lists:
            self._tool_lists[i] = [*self._sync_tools[i].values(), *self._async_tools[i].values()]
        self._stats.retired_environments += 1

    def _check_delete(self, r: _Rollout, call: dict) -> ToolOutcome:
        try:
            _, deleted = apply_deletion(r.prompt_msgs, _message_ids(call), self.config.context_stub_text)
        except (TypeError, ValueError) as e:
            return failure(DELETE_CONTEXT_TOOL, type(e).__name__, str(e), self.policy)
        return ToolOutcome(name=DELETE_CONTEXT_TOOL, content=f"Deleted messages {deleted}.", category="ok")

    def _rollback(self, i, r, checkpoint, calls, tool_messages, model_errors, prompt_msg_start):
        cfg, backend, stats = self.config, self.backend, self._stats
        stats.rollback_attempts += 1
        r.rollbacks.append(
            {
                "turn": r.turn_k,
                "error_types": [o.error_type for o in model_errors],
                "errors": [o.error_text for o in model_errors],
            }
        )
        group = self._group_ids[i]
        if cfg.save_negative_samples and self._negatives_per_group.get(group, 0) < cfg.max_negative_samples_per_group:
            # The failed turn alone is trained on (its calls, then its masked error results); the turns before it
            # are good and also in the regular row, so here they are context: the row's prompt. The error results
            # come after the last trained token, so they change no gradient: where they do not fit the budgets (a
            # 200k-character traceback) they are left out, as the regular row would leave them out, rather than
            # widening the whole batch to them.
            suffix = backend.tool_suffix_ids(tool_messages)
            if not self._fits(r, suffix):
                suffix = []
            start = r.turn_start
            self._extra_rows.append(
                ExtraRow(
                    kind=RowKind.NEGATIVE,
                    parent=i,
                    prompt_ids=r.prompt_ids + r.completion_ids[:start],
                    completion_ids=r.completion_ids[start:] + suffix,
                    tool_mask=r.tool_mask[start:] + [0] * len(suffix),
                    logprobs=(r.logprobs[start:] + [0.0] * len(suffix)) if r.logprobs is not None else None,
                    segment_index=r.segment_index,
                    error_types=[o.error_type or "Error" for o in model_errors],
                    error_messages=[o.error_text or "" for o in model_errors],
                    tool_calls=copy.deepcopy(calls),
                    tool_position=r.turn_k,
                    iteration=self._iteration,
                    messages=copy.deepcopy(r.completion_msgs[r.turn_msg_start :]) + copy.deepcopy(tool_messages),
                    prompt_messages=copy.deepcopy(r.prompt_msgs[:prompt_msg_start]),
                )
            )
            self._negatives_per_group[group] = self._negatives_per_group.get(group, 0) + 1
            stats.negatives_saved += 1
        env = self._env(i)
        if env is not None and checkpoint is not None:
            restore_env(env, checkpoint)
        stats.failed_turn_tokens += len(r.completion_ids) - r.turn_start
        # Truncate tokens and messages to the start of the failed turn.
        del r.completion_ids[r.turn_start :]
        del r.tool_mask[r.turn_start :]
        if r.logprobs is not None:
            del r.logprobs[r.turn_start :]
        del r.completion_msgs[r.turn_msg_start :]
        del r.prompt_msgs[prompt_msg_start:]
        if cfg.rollback_feedback == "hint":
            error = "; ".join(f"{o.error_type}: {o.error_text}" for o in model_errors)
            hint = cfg.rollback_hint_template.format(error=error)
            hint_ids = backend.hint_ids(hint)
            # The hint must leave the regenerated turn a token of budget and of context; without room the failed
            # turn is regenerated from its own context, as with `rollback_feedback="none"`.
            if self._fits(r, hint_ids, reply=1):
                self._append_env_tokens(r, hint_ids)
                hint_msgs = [{"role": "assistant", "content": ""}, {"role": "user", "content": hint}]
                r.completion_msgs.extend(hint_msgs)
                r.prompt_msgs.extend(copy.deepcopy(hint_msgs))
            else:
                stats.hints_dropped += 1
        r.retries[r.turn_k] = r.retries.get(r.turn_k, 0) + 1
        r.in_retry = True
        r.regenerating = True
        r.context = r.prompt_ids + r.completion_ids

    def _snapshot(self, i, r, deletes, tool_messages) -> bool:
        """Close the segment and restart from the re-rendered conversation. Returns False if it cannot be done.

        `deletes` holds the successful `delete_context` calls of this turn with their tool messages; all of them are
        applied (each was validated against the same conversation, so their union is valid too).
        """
        cfg, backend, stats = self.config, self.backend, self._stats
        ids = sorted({m for call, _ in deletes for m in _as_list(_message_ids(call))})
        # The conversation now ends with this turn's tool results; the indices refer to the messages before them.
        new_msgs, _ = apply_deletion(r.prompt_msgs, ids, cfg.context_stub_text)
        new_prompt = backend.render_prompt(new_msgs, i, **self._tools_kwarg(i))
        if len(new_prompt) >= backend.max_model_len - 1:
            # No room to generate even after the deletion: keep the segment, and do not tell the model otherwise. The
            # loop refused the call: a failed call (`tool_call_failed`, `tools/failure_frequency`), not a rollback.
            for _, message in deletes:
                refused = FailedToolMessage(
                    message, content="Context not deleted: the shortened conversation is still too long."
                )
                for messages in (tool_messages, r.completion_msgs, r.prompt_msgs):
                    messages[:] = [refused if m is message else m for m in messages]
            stats.tool_failures += len(deletes)
            return False
        stats.snapshots += 1
        # Freed = the context the next turn would have had (segment + tool results) minus the one it gets.
        suffix = backend.tool_suffix_ids(tool_messages)
        freed = max(len(r.prompt_ids) + len(r.completion_ids) + len(suffix) - len(new_prompt), 0)
        stats.tokens_freed += freed
        r.snapshots.append(
            ExtraRow(
                kind=RowKind.SNAPSHOT,
                parent=i,
                prompt_ids=r.prompt_ids,
                completion_ids=r.completion_ids,
                tool_mask=r.tool_mask,
                logprobs=r.logprobs,
                segment_index=r.segment_index,
                tokens_freed=freed,
                # The segment's messages (up to the delete call, before its tool results), and its prompt.
                messages=copy.deepcopy(
                    r.completion_msgs[r.segment_msg_start : len(r.completion_msgs) - len(tool_messages)]
                ),
                prompt_messages=copy.deepcopy(r.prompt_msgs[: r.segment_prompt_len]),
            )
        )
        r.prompt_ids, r.completion_ids, r.tool_mask = new_prompt, [], []
        r.logprobs = [] if r.logprobs is not None else None
        r.prompt_msgs[:] = new_msgs  # in place: this list is TRL's `prompts[i]`
        r.segment_index += 1
        r.segment_msg_start = len(r.completion_msgs)
        r.segment_prompt_len = len(new_msgs)
        r.turn_start = 0
        r.context = list(new_prompt)
        return True

    @staticmethod
    def _append_env_tokens(r: _Rollout, ids: list[int]) -> None:
        r.completion_ids.extend(ids)
        r.tool_mask.extend([0] * len(ids))
        if r.logprobs is not None:
            r.logprobs.extend([0.0] * len(ids))

    def _generate(self, rollouts: list[_Rollout], queued: list[int]) -> None:
        backend, stats = self.backend, self._stats
        call_limit = getattr(backend, "takes_call_limit", False)
        if not queued:  # another rank has work: keep collective generation calls matched
            stats.dummy_generation_calls += 1
            dummy = [list(rollouts[0].prompt_ids)] if rollouts else [[0]]
            if call_limit:
                backend.generate(dummy, limit=1)
            else:
                backend.generate(dummy)
            return
        contexts = [rollouts[i].context for i in queued]
        stats.generation_calls += 1
        started = time.perf_counter()
        if getattr(backend, "takes_turn_limits", False):  # one request per context: each asks for what it can keep
            new_ids, new_logprobs = self._generate_limited(backend, contexts, [rollouts[i].prompt_ids for i in queued])
        elif call_limit:  # one batched call: no more than the context that can keep the most (a later turn's budget)
            limit = max(self._turn_limit(rollouts[i].prompt_ids, c) for i, c in zip(queued, contexts))
            new_ids, new_logprobs = backend.generate(contexts, limit=max(limit, 1))
        else:
            new_ids, new_logprobs = backend.generate(contexts)
        stats.generate_seconds += time.perf_counter() - started
        for j, i in enumerate(queued):
            r = rollouts[i]
            context, r.context = r.context, None
            limit = self._turn_limit(r.prompt_ids, context)
            post = list(new_ids[j])
            post_lp = list(new_logprobs[j]) if new_logprobs is not None else None
            cap = self.config.max_turn_tokens
            if cap is not None and len(post) > cap:  # an engine that ignored the cap: cut like one that honoured it
                post, post_lp = post[:cap], (post_lp[:cap] if post_lp is not None else None)
            budget = backend.max_completion_length - (len(context) - len(r.prompt_ids))
            # Also the room left in the model's context: a batched call asks for the most any of its contexts can keep,
            # and transformers' `generate` does not stop at `max_position_embeddings` (only warns).
            excess = len(post) - min(budget, backend.max_model_len - len(context))
            if excess > 0:
                post = post[: max(0, len(post) - excess)]
                post_lp = post_lp[: len(post)] if post_lp is not None else None
            elif self._hit_turn_cap(post, budget):
                stats.turn_cap_truncations += 1
            if r.regenerating:
                stats.regenerated_tokens += len(post)
            else:
                r.turn_k += 1
            r.regenerating = False
            r.turn_start = len(r.completion_ids)
            r.completion_ids.extend(post)
            r.tool_mask.extend([1] * len(post))
            if r.logprobs is not None:
                r.logprobs.extend(post_lp if post_lp is not None else [0.0] * len(post))
            message = backend.parse(post, context, i, **self._tools_kwarg(i)) if post else {}
            r.turn_msg_start = len(r.completion_msgs)
            if message:
                r.completion_msgs.append(message)
            self._after_turn(i, r, post, message, limit)

    def _turn_limit(self, prompt_ids: list[int], context: list[int]) -> int:
        """The most tokens a turn generated from `context` can keep (more are cut, `_generate`): what is left of the
        budget, the per-turn cap, and the room left in the model's context (0: none)."""
        backend = self.backend
        limit = min(
            backend.max_completion_length - (len(context) - len(prompt_ids)), backend.max_model_len - len(context)
        )
        if self.config.max_turn_tokens is not None:
            limit = min(limit, self.config.max_turn_tokens)
        return max(0, limit)

    def _generate_limited(self, backend, contexts: list[list[int]], prompts: list[list[int]]):
        """`backend.generate` with each context's `_turn_limit`; a context that can keep no token is not sent (its
        turn is empty, as the cut of a longer one would leave it)."""
        limits = [self._turn_limit(p, c) for p, c in zip(prompts, contexts)]
        asked = [j for j, n in enumerate(limits) if n > 0]
        ids: list[list[int]] = [[] for _ in contexts]
        logprobs: list[list[float]] | None = [[] for _ in contexts]
        if asked:
            got_ids, got_logprobs = backend.generate([contexts[j] for j in asked], limits=[limits[j] for j in asked])
            for k, j in enumerate(asked):
                ids[j] = list(got_ids[k])
                if got_logprobs is None:
                    logprobs = None
                elif logprobs is not None:
                    logprobs[j] = list(got_logprobs[k])
        return ids, logprobs

    def _hit_turn_cap(self, ids: list[int], budget: int) -> bool:
        """Whether a turn was cut by `max_turn_tokens` (rather than by the rollout's remaining `budget`)."""
        cap = self.config.max_turn_tokens
        return cap is not None and cap < budget and len(ids) == cap and ids[-1] not in self.backend.stop_token_ids

    def _downsample(self, snapshots: list[ExtraRow]) -> list[ExtraRow]:
        k = self.config.max_snapshots_per_episode
        if len(snapshots) <= k:
            return snapshots
        if k == 0:
            return []
        if self.config.snapshot_downsample == "last":
            return snapshots[-k:]
        others = sorted(self.rng.sample(range(len(snapshots) - 1), k - 1))
        return [snapshots[j] for j in others] + [snapshots[-1]]


class _Replay:
    """A stand-in sync tool that returns a result obtained elsewhere (or raises its exception), so that
    `run_tool_call` classifies it as it classifies any call."""

    def __init__(self, result):
        self.result = result

    def __call__(self, **_):
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def _without_arguments(call: dict) -> dict:
    """`call` with no arguments, for a `_Replay` (which reports what the call itself did, its TypeError included)."""
    return {**call, "function": {**call["function"], "arguments": {}}}


def _has_image(content) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content)


def _message_ids(call: dict):
    """The `message_ids` argument of a `delete_context` call (raises TypeError when the arguments are not an object)."""
    args = call.get("function", {}).get("arguments") if isinstance(call, dict) else None
    if isinstance(args, str):  # some response parsers keep the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else None
        except ValueError:
            pass  # not JSON: refused below as a non-object
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise TypeError("the arguments of delete_context must be a JSON object with a 'message_ids' list")
    return args.get("message_ids")


def _as_list(message_ids) -> list:
    return [message_ids] if isinstance(message_ids, int) else list(message_ids)
