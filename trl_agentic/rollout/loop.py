"""The multi-turn tool loop with rollback-and-retry, negative samples and context snapshots.

This replaces `GRPOTrainer._tool_call_loop`. It is plain data in, plain data out: generation, parsing and chat
templating are reached through a `RolloutBackend`, so tests drive the loop with scripted token sequences and the
trainer plugs in TRL's own `_generate_single_turn`, `parse_response` and `_get_tool_suffix_ids`.

Per iteration, for every rollout whose last assistant turn asked for tools:

1. checkpoint the environment (rollback on), run the calls (`tools.run_tool_call`), re-run infrastructure failures;
2. on a model error matching `rollback_on_errors` with retries left: save the failed trajectory as a negative row,
   restore the environment, truncate the tokens and messages to the start of that turn (plus an optional masked
   hint) and queue the turn for regeneration;
3. on `delete_context`: close the segment as a snapshot row and continue from the re-rendered, shorter prompt;
4. otherwise append the tool results (masked) and queue the next turn;

then ONE batched generation call serves every queued rollout (continuations and regenerations alike). With several
processes, every rank makes the same number of generation calls (a dummy one when it has nothing to do), because
generation can be a collective (ZeRO-3 gathers, vLLM server mode).
"""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..envs.protocol import checkpoint_env, restore_env
from .context import DELETE_CONTEXT_TOOL, apply_deletion
from .parsing import parse_tool_calls
from .tools import ToolOutcome, classify, run_tool_call
from .types import ExtraRow, LoopResult, LoopStats, RowKind


class RolloutBackend(Protocol):
    """What the loop needs from a generation engine and a tokenizer."""

    max_completion_length: int
    max_model_len: int
    max_iterations: int
    multi_process: bool

    def generate(self, contexts: list[list[int]]) -> tuple[list[list[int]], list[list[float]] | None]: ...

    def parse(self, ids: list[int], prefix: list[int], row: int) -> dict: ...

    def decode(self, ids: list[int]) -> str: ...

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]: ...

    def hint_ids(self, hint: str) -> list[int]: ...

    def render_prompt(self, messages: list[dict], row: int) -> list[int]: ...

    def any_rank(self, flag: bool) -> bool: ...


@dataclass
class LoopConfig:
    """The subset of `AgenticGRPOConfig` the loop reads (see the config for the meaning of each field)."""

    enable_tool_rollback: bool = False
    max_tool_retries: int = 3
    rollback_on_errors: list[str] = field(default_factory=list)
    rollback_feedback: str = "none"
    rollback_hint_template: str = "Your previous tool call failed with: {error}. Write a corrected call."
    infra_error_patterns: list[str] = field(default_factory=list)
    max_infra_retries: int = 2
    save_negative_samples: bool = False
    max_negative_samples_per_group: int = 1
    tool_timeout: float = 0.0
    max_tool_output_chars: int = 4000
    enable_context_snapshots: bool = False
    max_snapshots_per_episode: int = 4
    snapshot_downsample: str = "last"
    context_stub_text: str = "[deleted]"

    @classmethod
    def from_args(cls, args) -> LoopConfig:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


@dataclass
class _Rollout:
    """Mutable state of one rollout inside the loop."""

    prompt_ids: list[int]
    completion_ids: list[int]
    tool_mask: list[int]
    logprobs: list[float] | None
    prompt_msgs: list[dict]  # the conversation that the current segment's tokens render (TRL's `prompts[i]`)
    completion_msgs: list[dict]  # every message the model produced or received in the episode (TRL's `completions[i]`)
    calls: list[dict] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    turn_start: int = 0  # token offset in completion_ids where the current assistant turn starts
    turn_msg_start: int = 0  # index in completion_msgs of the current assistant turn
    turn_k: int = 0  # assistant turn position (a regenerated turn keeps its position)
    turns_done: int = 0  # tool rounds executed (rolled-back rounds do not count)
    retries: dict[int, int] = field(default_factory=dict)
    in_retry: bool = False
    regenerating: bool = False
    segment_index: int = 0
    snapshots: list[ExtraRow] = field(default_factory=list)
    infra_failed: bool = False
    context: list[int] | None = None  # queued for generation when set
    rollbacks: list[dict] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.calls or self.parse_errors)


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

        `prompt_ids[i]` is replaced by the prompt of rollout i's last segment when it deleted context.

        Returns:
            `(trl_tuple, result)` where `trl_tuple` is TRL's `(tool_mask, completions, completion_ids, logprobs,
            tool_call_count, tool_failure_count, tool_images)` for the primary rows, and `result` a `LoopResult`.
        """
        started = time.perf_counter()
        backend = self.backend
        n = len(prompt_ids)
        stats = LoopStats()
        extra_rows: list[ExtraRow] = []
        group_ids = group_ids if group_ids is not None else list(range(n))
        negatives_per_group: dict[int, int] = {}

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
            self._read_calls(r, completion_ids[i], completions[i][-1] if completions[i] else {})
            rollouts.append(r)

        iteration = 0
        while True:
            local_active = [i for i, r in enumerate(rollouts) if r.has_work and r.turns_done < backend.max_iterations]
            active = backend.any_rank(bool(local_active)) if backend.multi_process else bool(local_active)
            if not active:
                break
            iteration += 1
            queued: list[int] = []
            for i in local_active:
                env = environments[i] if environments else None
                self._step_rollout(
                    i,
                    rollouts[i],
                    env,
                    sync_tool_dicts[i],
                    async_tool_dicts[i],
                    stats,
                    extra_rows,
                    group_ids,
                    negatives_per_group,
                )
                if rollouts[i].context is not None:
                    queued.append(i)
            self._generate(rollouts, queued, stats)

        # Close: snapshot downsampling, leftover unexecuted calls (iteration cap) are left as-is, like TRL.
        infra_failed, num_segments, rollback_log = [], [], []
        for i, r in enumerate(rollouts):
            kept = self._downsample(r.snapshots)
            stats.snapshot_rows += len(kept)
            extra_rows.extend(kept)
            infra_failed.append(r.infra_failed)
            num_segments.append(r.segment_index + 1)
            rollback_log.append(r.rollbacks)
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
        return trl_tuple, LoopResult(extra_rows, infra_failed, num_segments, stats, rollback_log)

    # ------------------------------------------------------------------------------------------------------------
    def _read_calls(self, r: _Rollout, ids: list[int], message: dict) -> None:
        """Set the rollout's pending calls from its newest assistant turn, detecting malformed tool-call markup."""
        calls = message.get("tool_calls") if message else None
        r.calls, r.parse_errors = list(calls or []), []
        if calls or not ids:
            return
        parsed = parse_tool_calls(self.backend.decode(ids))
        if parsed.errors:  # TRL's parser gave up silently: tell the model what was wrong
            r.calls, r.parse_errors = parsed.calls, parsed.errors

    def _step_rollout(self, i, r, env, sync_tools, async_tools, stats, extra_rows, group_ids, negatives_per_group):
        cfg, backend = self.config, self.backend
        checkpoint = checkpoint_env(env) if (cfg.enable_tool_rollback and env is not None) else None
        prompt_msg_start = len(r.prompt_msgs)
        # The assistant message that asked for the tools joins the conversation (TRL does the same).
        if r.completion_msgs and r.turn_msg_start < len(r.completion_msgs):
            r.prompt_msgs.append(r.completion_msgs[r.turn_msg_start])

        outcomes = self._run_calls(r, env, sync_tools, async_tools, checkpoint, stats)
        stats.tool_calls += len(r.calls) + len(r.parse_errors)
        stats.tool_failures += sum(o.failed for o in outcomes)
        stats.malformed_calls += len(r.parse_errors)
        stats.truncated_outputs += sum(o.truncated for o in outcomes)
        tool_messages = [{"role": "tool", "name": o.name, "content": o.content} for o in outcomes]
        calls, r.calls, r.parse_errors = r.calls, [], []

        if any(o.category == "infra" for o in outcomes):
            # Persistent infrastructure failure: keep the rollout out of the loss and stop it here.
            r.infra_failed = True
            stats.infra_failed_rollouts += 1
            r.completion_msgs.extend(tool_messages)
            return

        model_errors = [o for o in outcomes if o.category == "model"]
        if model_errors and cfg.enable_tool_rollback:
            used = r.retries.get(r.turn_k, 0)
            if used < cfg.max_tool_retries:
                self._rollback(
                    i,
                    r,
                    env,
                    checkpoint,
                    calls,
                    tool_messages,
                    model_errors,
                    prompt_msg_start,
                    stats,
                    extra_rows,
                    group_ids,
                    negatives_per_group,
                )
                return
            stats.rollback_exhausted += 1
            tool_messages[-1] = {
                **tool_messages[-1],
                "content": tool_messages[-1]["content"] + " (no retries left: continue without this result)",
            }
        elif r.in_retry and not model_errors:
            stats.rollback_recovered += 1
        r.in_retry = False
        r.turns_done += 1

        r.completion_msgs.extend(tool_messages)
        r.prompt_msgs.extend(tool_messages)
        if cfg.enable_context_snapshots:
            # Parse-error outcomes come first: the calls' own outcomes (and tool messages) are the last len(calls).
            first = len(outcomes) - len(calls)
            deletes = [
                (c, m)
                for c, o, m in zip(calls, outcomes[first:], tool_messages[first:])
                if o.name == DELETE_CONTEXT_TOOL and not o.failed
            ]
            if deletes and self._snapshot(i, r, deletes, tool_messages, stats):
                return
        suffix = backend.tool_suffix_ids(tool_messages)
        context = r.prompt_ids + r.completion_ids + suffix
        if len(context) - len(r.prompt_ids) > backend.max_completion_length or len(context) >= backend.max_model_len:
            # Over budget: drop this round's messages and end the rollout as it is (TRL's behaviour, #5521).
            del r.completion_msgs[len(r.completion_msgs) - len(tool_messages) :]
            del r.prompt_msgs[prompt_msg_start:]
            return
        self._append_env_tokens(r, suffix)
        r.context = context

    def _run_calls(self, r, env, sync_tools, async_tools, checkpoint, stats) -> list[ToolOutcome]:
        cfg = self.config
        attempt = 0
        while True:
            outcomes = [
                ToolOutcome(
                    name="tool_call_parser",
                    content=f"ToolCallParseError: {error}",
                    category=classify(
                        "ToolCallParseError",
                        error,
                        infra_patterns=cfg.infra_error_patterns,
                        rollback_patterns=cfg.rollback_on_errors,
                    ),
                    error_type="ToolCallParseError",
                    error_text=error,
                )
                for error in r.parse_errors
            ]
            for call in r.calls:
                name = call.get("function", {}).get("name") if isinstance(call, dict) else None
                if cfg.enable_context_snapshots and name == DELETE_CONTEXT_TOOL:
                    outcomes.append(self._check_delete(r, call))
                    continue
                started = time.perf_counter()
                outcomes.append(
                    run_tool_call(
                        call,
                        sync_tools,
                        async_tools,
                        timeout=cfg.tool_timeout,
                        max_chars=cfg.max_tool_output_chars,
                        infra_patterns=cfg.infra_error_patterns,
                        rollback_patterns=cfg.rollback_on_errors,
                        async_loop=self.async_loop,
                    )
                )
                stats.tool_seconds += time.perf_counter() - started
            if not any(o.category == "infra" for o in outcomes) or attempt >= cfg.max_infra_retries:
                return outcomes
            attempt += 1
            stats.infra_retries += 1
            if checkpoint is not None and env is not None:
                restore_env(env, checkpoint)  # re-run the whole turn from the state before it

    def _check_delete(self, r: _Rollout, call: dict) -> ToolOutcome:
        cfg = self.config
        try:
            _, deleted = apply_deletion(r.prompt_msgs, _message_ids(call), cfg.context_stub_text)
        except (TypeError, ValueError) as e:
            return ToolOutcome(
                name=DELETE_CONTEXT_TOOL,
                content=f"{type(e).__name__}: {e}",
                category=classify(
                    type(e).__name__,
                    str(e),
                    infra_patterns=cfg.infra_error_patterns,
                    rollback_patterns=cfg.rollback_on_errors,
                ),
                error_type=type(e).__name__,
                error_text=str(e),
            )
        return ToolOutcome(name=DELETE_CONTEXT_TOOL, content=f"Deleted messages {deleted}.", category="ok")

    def _rollback(
        self,
        i,
        r,
        env,
        checkpoint,
        calls,
        tool_messages,
        model_errors,
        prompt_msg_start,
        stats,
        extra_rows,
        group_ids,
        negatives_per_group,
    ):
        cfg, backend = self.config, self.backend
        stats.rollback_attempts += 1
        r.rollbacks.append(
            {
                "turn": r.turn_k,
                "error_types": [o.error_type for o in model_errors],
                "errors": [o.error_text for o in model_errors],
            }
        )
        group = group_ids[i]
        if cfg.save_negative_samples and negatives_per_group.get(group, 0) < cfg.max_negative_samples_per_group:
            # Save the failed attempt before the fix: the failed call and its error result included.
            suffix = backend.tool_suffix_ids(tool_messages)
            extra_rows.append(
                ExtraRow(
                    kind=RowKind.NEGATIVE,
                    parent=i,
                    prompt_ids=list(r.prompt_ids),
                    completion_ids=r.completion_ids + suffix,
                    tool_mask=r.tool_mask + [0] * len(suffix),
                    logprobs=(r.logprobs + [0.0] * len(suffix)) if r.logprobs is not None else None,
                    segment_index=r.segment_index,
                    error_types=[o.error_type or "Error" for o in model_errors],
                    error_messages=[o.error_text or "" for o in model_errors],
                    tool_calls=copy.deepcopy(calls),
                    tool_position=r.turn_k,
                    messages=copy.deepcopy(r.completion_msgs[r.turn_msg_start :]) + copy.deepcopy(tool_messages),
                )
            )
            negatives_per_group[group] = negatives_per_group.get(group, 0) + 1
            stats.negatives_saved += 1
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
            self._append_env_tokens(r, backend.hint_ids(hint))
            hint_msgs = [{"role": "assistant", "content": ""}, {"role": "user", "content": hint}]
            r.completion_msgs.extend(hint_msgs)
            r.prompt_msgs.extend(copy.deepcopy(hint_msgs))
        r.retries[r.turn_k] = r.retries.get(r.turn_k, 0) + 1
        r.in_retry = True
        r.regenerating = True
        r.context = r.prompt_ids + r.completion_ids

    def _snapshot(self, i, r, deletes, tool_messages, stats) -> bool:
        """Close the segment and restart from the re-rendered conversation. Returns False if it cannot be done.

        `deletes` holds the successful `delete_context` calls of this turn with their tool messages; all of them are
        applied (each was validated against the same conversation, so their union is valid too).
        """
        cfg, backend = self.config, self.backend
        ids = sorted({m for call, _ in deletes for m in _as_list(_message_ids(call))})
        # The conversation now ends with this turn's tool results; the indices refer to the messages before them.
        new_msgs, _ = apply_deletion(r.prompt_msgs, ids, cfg.context_stub_text)
        new_prompt = backend.render_prompt(new_msgs, i)
        if len(new_prompt) >= backend.max_model_len - 1:
            # No room to generate even after the deletion: keep the segment, and do not tell the model otherwise.
            for _, message in deletes:
                message["content"] = "Context not deleted: the shortened conversation is still too long."
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
                # The conversation this segment's tokens render (up to the delete call, before its tool results).
                messages=copy.deepcopy(r.prompt_msgs[: len(r.prompt_msgs) - len(tool_messages)]),
            )
        )
        r.prompt_ids, r.completion_ids, r.tool_mask = new_prompt, [], []
        r.logprobs = [] if r.logprobs is not None else None
        r.prompt_msgs[:] = new_msgs  # in place: this list is TRL's `prompts[i]`
        r.segment_index += 1
        r.turn_start = 0
        r.context = list(new_prompt)
        return True

    @staticmethod
    def _append_env_tokens(r: _Rollout, ids: list[int]) -> None:
        r.completion_ids.extend(ids)
        r.tool_mask.extend([0] * len(ids))
        if r.logprobs is not None:
            r.logprobs.extend([0.0] * len(ids))

    def _generate(self, rollouts: list[_Rollout], queued: list[int], stats: LoopStats) -> None:
        backend = self.backend
        if not queued:
            if backend.multi_process:  # keep collective generation calls matched across ranks
                stats.dummy_generation_calls += 1
                backend.generate([list(rollouts[0].prompt_ids)] if rollouts else [[0]])
            return
        contexts = [rollouts[i].context for i in queued]
        stats.generation_calls += 1
        started = time.perf_counter()
        new_ids, new_logprobs = backend.generate(contexts)
        stats.generate_seconds += time.perf_counter() - started
        for j, i in enumerate(queued):
            r = rollouts[i]
            context, r.context = r.context, None
            post = list(new_ids[j])
            post_lp = list(new_logprobs[j]) if new_logprobs is not None else None
            excess = len(context) - len(r.prompt_ids) + len(post) - backend.max_completion_length
            if excess > 0:
                post = post[: max(0, len(post) - excess)]
                post_lp = post_lp[: len(post)] if post_lp is not None else None
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
            message = backend.parse(post, context, i) if post else {}
            r.turn_msg_start = len(r.completion_msgs)
            if message:
                r.completion_msgs.append(message)
            self._read_calls(r, post, message)

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
