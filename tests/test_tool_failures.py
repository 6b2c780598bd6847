"""Tool failures that are not ordinary exceptions reach the model as messages and never end, hang or crash training.

Each case was found by an adversarial review (2026-12-06) and failed before its fix: `BaseException`s raised by tools
(sync and async: `SystemExit` from an `argparse` inside a tool ended the process with status 0; one from an async
tool killed the event loop every async tool of the run shares, so the next call hung), an exception whose `__str__`
raises, text with a lone surrogate (the tokenizer crashes on it), arguments nested deeper than `copy.deepcopy` can
recurse, an error result too long for any budget in a negative row, and an environment that cannot be checkpointed
only after `reset`. Scripted generation (`rollout_helpers.ScriptBackend`) with the tiny model's real tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import pytest
from rollout_helpers import LedgerEnv, ScriptBackend, call, run_tools_loop, start

from trl_agentic.config import DEFAULT_INFRA_ERROR_TYPES, DEFAULT_ROLLBACK_ON_ERRORS, AgenticGRPOConfig
from trl_agentic.errors import InfrastructureError, ToolCallError, render_tool_error
from trl_agentic.rollout.loop import AgenticRolloutLoop, LoopConfig
from trl_agentic.rollout.parsing import MAX_ARGUMENT_DEPTH, nesting_depth
from trl_agentic.rollout.tools import truncate, truncate_blocks
from trl_agentic.rollout.types import RowKind

RAISED = [SystemExit(0), SystemExit(2), GeneratorExit(), asyncio.CancelledError(), KeyboardInterrupt()]


def cfg(**overrides) -> LoopConfig:
    base = dict(rollback_on_errors=list(DEFAULT_ROLLBACK_ON_ERRORS), infra_error_types=list(DEFAULT_INFRA_ERROR_TYPES))
    return LoopConfig(**{**base, **overrides})


def _tool_messages(trl_tuple) -> list[str]:
    return [m["content"] for m in trl_tuple[1][0] if m["role"] == "tool"]


def _raiser(error: BaseException):
    def boom() -> str:
        """
        Fails.
        """
        raise error

    return boom


@pytest.mark.parametrize("timeout", [0.0, 5.0])
@pytest.mark.parametrize("error", RAISED, ids=repr)
def test_a_sync_tool_raising_a_base_exception_is_a_message(tiny_tokenizer, error, timeout):
    """Reported under its type name, the rollout goes on to its next turn. Except, in a call that runs in the
    trainer's own thread (`tool_timeout=0`), `SystemExit` and `KeyboardInterrupt`: there they may be the trainer's
    (a SIGTERM handler's `sys.exit`, Ctrl-C), so they propagate, as in TRL."""
    b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
    if isinstance(error, (SystemExit, KeyboardInterrupt)) and not timeout:
        with pytest.raises(type(error)):
            run_tools_loop(b, [call("boom")], [{"boom": _raiser(error)}], cfg(tool_timeout=timeout))
        return
    _, _, trl_tuple, result = run_tools_loop(b, [call("boom")], [{"boom": _raiser(error)}], cfg(tool_timeout=timeout))
    assert _tool_messages(trl_tuple) == [render_tool_error(repr(error))]
    assert trl_tuple[1][0][-1]["content"] == "Done." and result.stats.tool_failures == 1


def test_a_signal_handlers_system_exit_during_a_tool_call_ends_the_rollout(tiny_tokenizer):
    """The control of the rule above: a SIGTERM handler that calls `sys.exit` while a tool runs in the trainer's
    thread is the trainer being stopped (a scheduler's preemption), not a tool failure to show the model."""
    import os
    import signal

    def slow() -> str:
        """
        Waits for the signal.
        """
        os.kill(os.getpid(), signal.SIGUSR1)
        threading.Event().wait(5)
        return "not stopped"

    previous = signal.signal(signal.SIGUSR1, lambda *_: sys.exit(143))
    try:
        b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
        with pytest.raises(SystemExit) as stopped:
            run_tools_loop(b, [call("slow")], [{"slow": slow}], cfg(enable_tool_rollback=True))
        assert stopped.value.code == 143
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("error", RAISED, ids=repr)
def test_an_async_tool_raising_a_base_exception_leaves_the_event_loop_running(
    tiny_tokenizer, event_loop_thread, error
):
    """Alone and gathered with another call: reported, and the event loop every async tool shares still runs, so a
    later call returns (it hung forever with `tool_timeout=0`). asyncio re-raises `SystemExit` and
    `KeyboardInterrupt` out of the loop. A `CancelledError` the tool raises itself is its error, not a timeout (it was
    reported as a timeout when gathered)."""

    async def fine() -> str:
        """
        Returns.
        """
        return "fine"

    async def boom() -> str:
        """
        Fails.
        """
        raise error

    alone = call("boom")
    together = (
        '<tool_call>{"name": "boom", "arguments": {}}</tool_call><tool_call>{"name": "fine", "arguments": {}}'
        "</tool_call><|im_end|>"
    )
    for turn, expected in [(alone, [repr(error)]), (together, [repr(error), "fine"])]:
        b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
        p, prompt_ids, completion_ids, completions, lps = start(b, [turn])
        loop = AgenticRolloutLoop(b, cfg(), async_loop=event_loop_thread)
        trl_tuple, _ = loop.run(
            p, prompt_ids, completion_ids, completions, lps, [{}], [{"boom": boom, "fine": fine}], None
        )
        assert _tool_messages(trl_tuple) == [render_tool_error(expected[0]), *expected[1:]]
        assert event_loop_thread.thread.is_alive()


def test_an_exception_whose_str_raises_is_still_a_message(tiny_tokenizer):
    class Opaque(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
    _, _, trl_tuple, result = run_tools_loop(b, [call("boom")], [{"boom": _raiser(Opaque())}], cfg())
    assert _tool_messages(trl_tuple) == [render_tool_error("<unprintable Opaque: RuntimeError>")]
    assert result.stats.tool_failures == 1


def test_a_lone_surrogate_reaches_the_model_escaped(tiny_tokenizer):
    """A file name decoded with `surrogateescape` in a result, an error and the rollback hint built from it: each is
    shown with the surrogate escaped (the tokenizer raised on it), in the result's case the text is otherwise kept."""

    def listing() -> str:
        """
        Lists.
        """
        return "report-\udcff.txt"

    def opening() -> str:
        """
        Opens.
        """
        raise TypeError("cannot open report-\udcff.txt")

    b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
    _, _, trl_tuple, _ = run_tools_loop(b, [call("listing")], [{"listing": listing}], cfg())
    assert _tool_messages(trl_tuple) == ["report-\\udcff.txt"]
    b = ScriptBackend(tiny_tokenizer, [[call("listing")], ["Done.<|im_end|>"]])
    config = cfg(enable_tool_rollback=True, rollback_feedback="hint")
    _, _, trl_tuple, result = run_tools_loop(b, [call("opening")], [{"opening": opening, "listing": listing}], config)
    assert "cannot open report-\\udcff.txt" in b.decode(b.calls[0][0])  # the hint the regenerated turn read
    assert result.stats.rollback_attempts == 1
    # A model can write one itself: `"ad\\udcffd"` in JSON is a lone surrogate in the name of an unknown tool.
    unknown = '<tool_call>{"name": "ad\\udcffd", "arguments": {}}</tool_call><|im_end|>'
    b = ScriptBackend(tiny_tokenizer, [[call("listing")], ["Done.<|im_end|>"]])
    config = cfg(enable_tool_rollback=True, rollback_feedback="hint", rollback_on_errors=["ToolNotFoundError"])
    _, _, trl_tuple, result = run_tools_loop(b, [unknown], [{"listing": listing}], config)
    assert "Tool ad\\udcffd not found." in b.decode(b.calls[0][0]) and result.stats.rollback_attempts == 1


def test_content_blocks_are_escaped_and_share_the_budget():
    """Content-block results (TRL passes a list through as the message's content) get the same surrogate escape as a
    string result, with or without a character budget; blocks without text are left as they are."""
    image = {"type": "image", "url": "file:///x.png"}
    blocks = [{"type": "text", "text": "report-\udcff.txt"}, image, {"type": "text", "text": "abcdef"}]
    assert truncate_blocks(blocks, None) == ([{"type": "text", "text": "report-\\udcff.txt"}, image, blocks[2]], False)
    out, cut = truncate_blocks(blocks, 20)
    assert out[0] == {"type": "text", "text": "report-\\udcff.txt"} and out[1] is image
    assert cut and out[2]["text"] == truncate("abcdef", 20 - len("report-\\udcff.txt"))
    clean = [{"type": "text", "text": "ok"}]
    assert truncate_blocks(clean, None)[0] is clean and truncate_blocks(clean, 5) == (clean, False)


class _NoDepthCheckBackend(ScriptBackend):
    """Parses as TRL's `parse_response` does: any JSON object, however deep (the depth check is the loop's)."""

    def parse(self, ids, prefix, row, tools=None):
        text = self.tok.decode(ids, skip_special_tokens=True)
        if "<tool_call>" not in text:
            return {"role": "assistant", "content": text}
        body = text.split("<tool_call>")[1].split("</tool_call>")[0]
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": json.loads(body)}]}


@pytest.mark.parametrize("backend", [ScriptBackend, _NoDepthCheckBackend])
@pytest.mark.parametrize("features", ["rollback", "snapshots", "tool_timeout"])
def test_arguments_nested_too_deep_to_copy_are_a_parse_error(tiny_tokenizer, backend, features):
    """600 levels (1.2 KB of `[[[`): a failing call's negative row, a later `delete_context` and the checkpoint of an
    environment that keeps its arguments copy the call recursively, which raised `RecursionError` out of the loop.
    Deeper than `MAX_ARGUMENT_DEPTH` is a `ToolCallParseError` the model reads, whichever parser found the call; the
    rollout goes on."""
    nested = "[" * 600 + "]" * 600
    deep = '<tool_call>{"name": "add", "arguments": {"n": ' + nested + "}}</tool_call><|im_end|>"
    env = LedgerEnv()
    rollback = ["ToolCallParseError", *DEFAULT_ROLLBACK_ON_ERRORS]  # the malformed turn is rolled back and saved
    config = {
        "rollback": cfg(enable_tool_rollback=True, save_negative_samples=True, rollback_on_errors=rollback),
        "snapshots": cfg(enable_context_snapshots=True),
        "tool_timeout": cfg(tool_timeout=5.0),  # checkpoints the environment, whose log would keep the arguments
    }[features]
    b = backend(tiny_tokenizer, [[call("add", n=2)], ["Done.<|im_end|>"]])
    _, _, trl_tuple, result = run_tools_loop(b, [deep], [{"add": env.add}], config, envs=[env])
    message = f"\"arguments\" of tool 'add' nest deeper than {MAX_ARGUMENT_DEPTH} levels"
    assert env.log == [2] and trl_tuple[1][0][-1]["content"] == "Done."
    if features == "rollback":
        assert [row.kind for row in result.extra_rows] == [RowKind.NEGATIVE]
        assert result.extra_rows[0].error_messages == [message]
        assert _tool_messages(trl_tuple) == ["2"]
    else:
        assert _tool_messages(trl_tuple) == [render_tool_error(message), "2"]


def test_a_cut_turns_deep_call_runs_as_in_trl(tiny_tokenizer):
    """A turn cut by the budget is never rolled back, saved or snapshotted, so nothing copies its calls: they run,
    as TRL runs a cut turn's calls, however deep."""
    nested = "[" * 100 + "]" * 100
    cut = '<tool_call>{"name": "add", "arguments": {"n": ' + nested + "}}</tool_call>"  # no end of turn
    env = LedgerEnv()
    b = ScriptBackend(tiny_tokenizer, [])
    b.max_completion_length = len(b.enc(cut))  # the cut filled the budget
    config = cfg(enable_tool_rollback=True, save_negative_samples=True)
    _, _, trl_tuple, result = run_tools_loop(b, [cut], [{"add": env.add}], config, envs=[env])
    assert result.stats.truncated_turns == 1
    assert len(env.log) == 1 and nesting_depth(env.log[0]) == 100  # the call ran
    assert result.stats.malformed_calls == 0 and result.extra_rows == []
    assert trl_tuple[1][0][0]["tool_calls"][0]["function"]["name"] == "add"


def test_nesting_depth_counts_containers():
    assert [nesting_depth(v) for v in (1, "x", {}, [], {"a": 1}, {"a": [1]}, [[[]]], {"a": {"b": {"c": [2]}}})] == [
        0, 0, 1, 1, 1, 2, 3, 4,
    ]  # fmt: skip
    deep = []
    for _ in range(5000):
        deep = [deep]
    assert nesting_depth(deep) == 5001  # no recursion


def test_a_negative_row_leaves_out_an_error_result_no_budget_could_hold(tiny_tokenizer):
    """A 200 000-character traceback under `max_completion_length=256`: the regular row leaves the result out (it
    does not fit), and so does the negative row now; its trained tokens, the failed turn, are the same as with a
    short error. The result came after the row's last trained token, so no gradient changes."""

    def failing(size: int):
        def add(n: int) -> str:
            """
            Adds.

            Args:
                n: A number.
            """
            raise TypeError("x" * size)

        return add

    rows = {}
    for size in (10, 200_000):
        b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
        b.max_completion_length = 256
        config = cfg(enable_tool_rollback=True, save_negative_samples=True)
        _, _, _, result = run_tools_loop(b, [call("add", n=1)], [{"add": failing(size)}], config)
        (rows[size],) = result.extra_rows
    short, long = rows[10], rows[200_000]
    trained = [t for t, m in zip(short.completion_ids, short.tool_mask) if m]
    assert [t for t, m in zip(long.completion_ids, long.tool_mask) if m] == trained
    assert len(short.completion_ids) > len(trained)  # the short error is kept, as before
    assert long.completion_ids == trained and long.prompt_ids == short.prompt_ids


class LockAfterReset(LedgerEnv):
    def reset(self, **kwargs):
        super().reset(**kwargs)
        self.lock = threading.Lock()


@pytest.mark.parametrize("config", [dict(enable_tool_rollback=True), dict(tool_timeout=5.0)])
def test_state_that_cannot_be_checkpointed_after_reset_gets_the_actionable_error(tiny_tokenizer, config):
    """The start-up check sees an environment before `reset`; a lock made in `reset` failed later with copy's bare
    "cannot pickle '_thread.lock' object". Now the error names the environment, the attribute and the fix."""
    env = LockAfterReset()
    env.reset()
    b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
    with pytest.raises(TypeError, match=r"LockAfterReset cannot be checkpointed .* attribute 'lock' \(lock\)"):
        run_tools_loop(b, [call("add", n=1)], [{"add": env.add}], cfg(**config), envs=[env])


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e10, -1.0, True])
def test_a_tool_timeout_no_wait_can_take_is_refused_by_the_config(value):
    """`inf` and `1e10` overflow a thread's join or the event loop's wait, NaN compares false to everything: each
    failed every tool call at run time (reported to the model as failures). Refused before any model loads."""
    with pytest.raises(ValueError, match="`tool_timeout` must be a number of seconds from 0"):
        AgenticGRPOConfig(output_dir="unused", use_cpu=True, tool_timeout=value)


def test_a_call_whose_name_is_not_a_string_is_an_unknown_tool():
    """A response parser may give any JSON value as the name: no crash where names and messages are escaped."""
    from trl_agentic.rollout.tools import ErrorPolicy, run_tool_call

    outcome = run_tool_call(
        {"type": "function", "function": {"name": 7, "arguments": {}}},
        {},
        {},
        timeout=0,
        max_chars=None,
        policy=ErrorPolicy([], []),
    )
    assert outcome.name == 7 and outcome.content == render_tool_error("Tool 7 not found.")


@pytest.mark.parametrize(
    "raised, category",
    [
        (lambda: InfrastructureError("sandbox did not start"), "infra"),
        (lambda: type("PoolDown", (InfrastructureError,), {})("pool down"), "infra"),  # a subclass
        (lambda: ConnectionError("server refused"), "infra"),  # a class listed in `infra_error_types`
        # a `ToolCallError` names the model's error: its `error_type` never makes it infrastructure
        (lambda: ToolCallError("raised by model code", error_type="InfrastructureError"), "model"),
        (lambda: ToolCallError("raised by model code", error_type="ConnectionError"), "model"),
        (lambda: ToolCallError("raised by model code", error_type="KeyError"), "error"),
    ],
)
def test_infrastructure_is_read_from_the_class_hierarchy_alone(raised, category):
    from trl_agentic.rollout.tools import ErrorPolicy, run_tool_call

    def tool():
        raise raised()

    policy = ErrorPolicy(
        rollback_on_errors=["InfrastructureError", "ConnectionError"],
        infra_error_types=["InfrastructureError", "ConnectionError"],
    )
    call = {"type": "function", "function": {"name": "tool", "arguments": {}}}
    outcome = run_tool_call(call, {"tool": tool}, {}, timeout=0, max_chars=None, policy=policy)
    assert outcome.category == category


@pytest.mark.parametrize("length, limit", [(1000, 500), (500, 64), (120, 100), (10**6, 64), (30, 10), (99, 98)])
def test_the_truncation_marker_counts_the_characters_cut(length, limit):
    """The marker takes room in the budget: it counts every character left out (1000 at 500 kept 475 and said 500)."""
    text = "y" * length
    out = truncate(text, limit)
    kept, count = out.split("\n...[truncated ")
    assert kept == text[: len(kept)] and count == f"{length - len(kept)} chars]"
    assert len(out) <= limit or kept == ""  # within the budget unless the marker alone exceeds it


def _http_404(url: str) -> str:
    """
    Fetches a page.

    Args:
        url: The page.
    """
    raise Exception("HTTP 404")  # noqa: TRY002 - the commonest failure of user tools and their libraries


@pytest.mark.parametrize("kind, timeout", [("sync", 0.0), ("sync", 5.0), ("async", 0.0), ("async", 5.0)])
def test_a_tool_raising_a_bare_exception_is_a_message(tiny_tokenizer, event_loop_thread, kind, timeout):
    """`raise Exception(...)` has no class name below the catch-all bases: the loop indexed an empty list of names and
    the IndexError stopped training (on every rank) and evaluation. TRL's loop shows it as `{"error": ...}`."""

    async def fetch(url: str) -> str:
        """
        Fetches a page.

        Args:
            url: The page.
        """
        return _http_404(url)

    tools = {"fetch": _http_404} if kind == "sync" else {"fetch": fetch}
    b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
    p, prompt_ids, completion_ids, completions, lps = start(b, [call("fetch", url="x")])
    loop = AgenticRolloutLoop(
        b, cfg(tool_timeout=timeout, malformed_tool_call_feedback=True), async_loop=event_loop_thread
    )
    trl_tuple, result = loop.run(p, prompt_ids, completion_ids, completions, lps, [{}], [tools], None)
    assert _tool_messages(trl_tuple) == [render_tool_error("HTTP 404")]
    assert trl_tuple[1][0][-1]["content"] == "Done." and result.stats.tool_failures == 1


@pytest.mark.parametrize(
    "raised, names",
    [
        (Exception("x"), ["Exception"]),
        (BaseException("x"), ["BaseException"]),
        (ValueError("x"), ["ValueError"]),
        (FileNotFoundError("x"), ["FileNotFoundError", "OSError"]),
        (InfrastructureError("x"), ["InfrastructureError", "RuntimeError"]),
    ],
    ids=repr,
)
def test_class_names_always_name_the_exceptions_own_class(raised, names):
    from trl_agentic.errors import class_names

    assert class_names(raised) == names


@pytest.mark.parametrize("listed, category", [("rollback", "model"), ("infra", "infra"), (None, "error")])
def test_a_bare_exception_is_matched_by_its_own_name_only(listed, category):
    """Listing `"Exception"` matches a bare `Exception` (and no subclass: the catch-all is never a base name)."""
    from trl_agentic.rollout.tools import ErrorPolicy, run_tool_call

    policy = ErrorPolicy(
        rollback_on_errors=["Exception"] if listed == "rollback" else [],
        infra_error_types=["Exception"] if listed == "infra" else [],
    )
    fetch = {"type": "function", "function": {"name": "fetch", "arguments": {"url": "x"}}}
    assert (
        run_tool_call(fetch, {"fetch": _http_404}, {}, timeout=0, max_chars=None, policy=policy).category == category
    )
    value_error = {"type": "function", "function": {"name": "bad", "arguments": {}}}
    assert (
        run_tool_call(
            value_error, {"bad": _raiser(ValueError("v"))}, {}, timeout=0, max_chars=None, policy=policy
        ).category
        == "error"
    )


def test_a_tool_timeout_is_the_models_error_even_when_oserror_is_infrastructure(tiny_tokenizer):
    """The loop's `ToolTimeout` is a `TimeoutError`, an `OSError`; with `infra_error_types: [..., OSError]` (network
    errors are OSErrors) a hung call was re-run `max_infra_retries` times, a full timeout each, and the rollout then
    dropped from the loss: the model was never penalised for a call that hangs (config: a timeout is the model's)."""
    runs = []

    def slow(x: int) -> str:
        """
        Sleeps.

        Args:
            x: Unused.
        """
        runs.append(x)
        threading.Event().wait(2.0)
        return "late"

    b = ScriptBackend(tiny_tokenizer, [["Done.<|im_end|>"]])
    config = cfg(tool_timeout=0.2, infra_error_types=["InfrastructureError", "OSError"], max_infra_retries=2)
    _, _, trl_tuple, result = run_tools_loop(b, [call("slow", x=1)], [{"slow": slow}], config)
    assert runs == [1] and result.infra_failed == [False] and result.stats.infra_retries == 0
    assert result.stats.tool_failures == 1 and "did not return within" in _tool_messages(trl_tuple)[0]
