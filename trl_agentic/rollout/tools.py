"""Running one tool call safely and classifying what happened (the taxonomy of `trl_agentic.errors`).

Every failure becomes a message the model reads, rendered exactly as TRL renders a tool exception
(`str({"error": message})`), never an exception in the trainer: unknown tools, wrong arguments, exceptions, hangs past
`tool_timeout`, huge or non-string results. Each outcome gets a category:

- `"ok"`: the tool returned (whatever it returned, `{"error": ...}` included, is a result; its text is never
  searched: TRL's loop also counts only raised exceptions as failures);
- `"model"`: a model error whose type is listed in `rollback_on_errors` (may trigger a rollback);
- `"error"`: any other model error (shown to the model, the rollout goes on);
- `"infra"`: an infrastructure error (`InfrastructureError` or a type listed in `infra_error_types`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import FailedToolMessage, class_names, error_type_names, render_tool_error


class ToolTimeout(TimeoutError):
    """A tool did not return within `tool_timeout` seconds (a model error: e.g. arguments that make it compute forever)."""


class ToolRaised(Exception):
    """A tool raised a `BaseException` that is not an `Exception` (`SystemExit` from an `argparse` or `sys.exit`
    inside it, `KeyboardInterrupt`, `GeneratorExit`, a stray `asyncio.CancelledError`): reported to the model under
    that exception's type name, not raised in the trainer (where `SystemExit` would end training with status 0). Only
    where it cannot be the trainer's own: a tool in the trainer's thread (`tool_timeout=0`) lets `SystemExit` and
    `KeyboardInterrupt` through (`_call_with_timeout`)."""

    def __init__(self, error: BaseException):
        super().__init__(_exception_text(error))
        self.error_type = type(error).__name__


def _reportable(error: BaseException) -> Exception:
    return error if isinstance(error, Exception) else ToolRaised(error)


def _exception_text(error: BaseException) -> str:
    """The message a raised exception is shown with: `str(e)` as TRL shows it (`repr` for a `BaseException` that is not
    an `Exception`, whose `str` is e.g. an exit code); one whose `__str__` fails still gets a message."""
    return _to_text(error, str if isinstance(error, Exception) else repr)


class _Raised:
    """What `_guarded` returns for a coroutine that raised: asyncio re-raises `SystemExit` and `KeyboardInterrupt` out
    of the event loop, which would end the thread every async tool of the run shares."""

    def __init__(self, error: BaseException):
        self.error = _reportable(error)


async def _guarded(coroutine):
    try:
        return await coroutine
    except asyncio.CancelledError as e:
        if asyncio.current_task().cancelling():
            raise  # the timeout's cancellation
        return _Raised(e)  # the tool's own, alone or gathered: an error like any other, not a timeout
    except BaseException as e:  # noqa: BLE001 - a tool's failure is reported, never raised in the event loop
        return _Raised(e)


# Model errors of the loop's own making, by type name.
UNKNOWN_TOOL = "ToolNotFoundError"
BAD_CALL = "ToolCallError"
PARSE_ERROR = "ToolCallParseError"


@dataclass
class ToolOutcome:
    """The result of one tool call as the loop sees it.

    Attributes:
        name: Tool name the model asked for.
        content: Text shown to the model (TRL's rendering; already truncated).
        category: `"ok"`, `"model"`, `"error"` or `"infra"`.
        error_type: The error's type name (None when ok).
        error_text: The error message (None when ok).
        truncated: Whether the tool's output was longer than `max_tool_output_chars` and was cut.
        timed_out: Whether the call was abandoned at `tool_timeout` (its thread may still be running).
    """

    name: str
    content: str
    category: str
    error_type: str | None = None
    error_text: str | None = None
    truncated: bool = False
    timed_out: bool = False

    @property
    def failed(self) -> bool:
        return self.category != "ok"

    def message(self) -> dict:
        """The tool message the model reads: TRL's `{"role", "name", "content"}`, a `FailedToolMessage` when failed."""
        return (FailedToolMessage if self.failed else dict)(role="tool", name=self.name, content=self.content)


@dataclass
class ErrorPolicy:
    """Which error types roll back (`rollback_on_errors`) and which are infrastructure (`infra_error_types`)."""

    rollback_on_errors: list[str]
    infra_error_types: list[str]

    def category(self, names: list[str], classes: list[str] | None = None) -> str:
        """`names`: every name the error matches (`error_type_names`); `classes`: its class hierarchy alone
        (`class_names`), the only names an infrastructure error is read from (default: none, the loop's own failures
        such as an unknown tool are never infrastructure)."""
        if any(name in self.infra_error_types for name in classes or ()):
            return "infra"
        if any(name in self.rollback_on_errors for name in names):
            return "model"
        return "error"


def truncate(text: str, max_chars: int | None) -> str:
    """Cut `text` to `max_chars` characters (None: no limit), saying how many were dropped: the marker takes room too,
    so the count is of the characters actually cut (it said `len(text) - max_chars`, fewer)."""
    if max_chars is None or len(text) <= max_chars:
        return text
    kept = max_chars
    while True:  # the count's digits change the marker's length; `kept` only falls, so this ends
        marker = f"\n...[truncated {len(text) - kept} chars]"
        fits = max(0, max_chars - len(marker))
        if fits == kept:
            return text[:kept] + marker
        kept = fits


def truncate_blocks(blocks: list, max_chars: int | None) -> tuple[list, bool]:
    """`truncate` for list content (content blocks): the text blocks share the `max_chars` budget, in order, and are
    made `printable`.

    Returns:
        `(blocks, cut)`: the blocks (the input itself when no text changed) and whether any text was cut.
    """
    out, left, cut, changed = [], max_chars, False, False
    for block in blocks:
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            full = printable(block["text"])
            text = truncate(full, left)
            cut = cut or text != full
            changed = changed or text != block["text"]
            if left is not None:
                left = max(0, left - len(text))
            block = {**block, "text": text}
        out.append(block)
    return (out if changed else blocks), cut


def gather_async_calls(coroutines: list, timeout: float, async_loop: asyncio.AbstractEventLoop | None) -> list:
    """Run a turn's async tool calls together on `async_loop`, as TRL's loop does (`asyncio.gather`, in call order).

    Args:
        coroutines: The calls' coroutines, in call order.
        timeout: Seconds after which the calls still running are cancelled (`0` = no limit).
        async_loop: The event loop (running in another thread) of the async tools.

    Returns:
        One entry per coroutine: its return value, or the exception it raised (`ToolTimeout` when cancelled at
        `timeout`). Never raises for a tool's failure.
    """
    if async_loop is None:
        for coroutine in coroutines:
            coroutine.close()
        return [RuntimeError("no event loop available for async tools")] * len(coroutines)
    expired = ToolTimeout(f"tool did not return within {timeout:g} s")

    async def run() -> list:
        tasks = [asyncio.ensure_future(_guarded(c)) for c in coroutines]
        _, pending = await asyncio.wait(tasks, timeout=timeout or None)
        for task in pending:
            task.cancel()
        results = []
        for task in tasks:
            if task in pending or task.cancelled():
                results.append(expired)
            elif task.exception() is not None:  # raised past `_guarded`: cannot happen, reported all the same
                results.append(_reportable(task.exception()))
            else:
                result = task.result()
                results.append(result.error if isinstance(result, _Raised) else result)
        return results

    future = asyncio.run_coroutine_threadsafe(run(), async_loop)
    try:
        # `run` returns at `timeout`; this limit only matters when a coroutine blocks the event loop itself.
        return future.result(2 * timeout if timeout else None)
    except TimeoutError:
        future.cancel()
        return [expired] * len(coroutines)


def failure(
    name: str,
    error_type: str,
    message: str,
    policy: ErrorPolicy,
    names: list[str] | None = None,
    classes: list[str] | None = None,
) -> ToolOutcome:
    """The outcome of a failed call: TRL's rendering of `message`, classified by `names` (default `[error_type]`) and
    the raised exception's `classes` (`ErrorPolicy.category`)."""
    message = printable(message)  # it also feeds the rollback hint, which is tokenized as it is
    return ToolOutcome(
        name=printable(name),
        content=render_tool_error(message),
        category=policy.category(names or [error_type], classes),
        error_type=error_type,
        error_text=message,
    )


def _call_with_timeout(fn, kwargs: dict, timeout: float) -> Any:
    if not timeout:
        # In the trainer's own thread a `SystemExit`, `KeyboardInterrupt` or a test timeout may be the trainer's (a
        # SIGTERM handler calling `sys.exit`, Ctrl-C), not the tool's: they propagate, as in TRL. What a signal never
        # delivers is the tool's failure. With `tool_timeout` the tool runs in a thread of its own, where any of them
        # is the tool's and is reported.
        try:
            return fn(**kwargs)
        except (GeneratorExit, asyncio.CancelledError) as e:
            raise _reportable(e) from None
    box: dict[str, Any] = {}

    def target():
        try:
            box["result"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the model as a message
            box["error"] = e

    # A daemon thread per call: a hung tool leaks its thread but never blocks the trainer or later calls (the loop
    # also stops it from touching the environment again, see `AgenticRolloutLoop._isolate_timed_out_env`).
    thread = threading.Thread(target=target, daemon=True, name="trl-agentic-tool")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ToolTimeout(f"tool did not return within {timeout:g} s")
    if "error" in box:
        raise _reportable(box["error"])
    return box.get("result")


def run_tool_call(
    call: dict,
    sync_tools: dict,
    async_tools: dict,
    *,
    timeout: float,
    max_chars: int | None,
    policy: ErrorPolicy,
    async_loop: asyncio.AbstractEventLoop | None = None,
) -> ToolOutcome:
    """Execute one parsed tool call and turn whatever happens into a `ToolOutcome`; never raises.

    The messages of the failures TRL also handles are TRL's own (`"Tool {name} not found."`, `str(exception)`,
    `"Unsupported tool call type: ..."`), so the model reads the same text under both loops.

    Args:
        call: TRL's call dict `{"type": "function", "function": {"name": ..., "arguments": {...}}}`.
        sync_tools / async_tools: Name → callable for this rollout.
        timeout: Seconds before a call is abandoned (`0` = no limit).
        max_chars: Truncation limit for the text shown to the model (None = no limit).
        policy: Classification of error types.
        async_loop: Event loop (running in another thread) for async tools.
    """
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name", "unknown") if isinstance(function, dict) else "unknown"
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
        kind = call.get("type") if isinstance(call, dict) else type(call).__name__
        return failure(name, BAD_CALL, f"Unsupported tool call type: {kind}", policy)
    # Only None means no arguments (TRL's parser normalises it to {}); other non-objects reach `tool(**arguments)`,
    # whose TypeError is the message TRL shows ("... argument after ** must be a mapping, not str").
    arguments = function.get("arguments")
    arguments = {} if arguments is None else arguments
    try:
        if name in sync_tools:
            result = _call_with_timeout(sync_tools[name], arguments, timeout)
        elif name in async_tools:
            if async_loop is None:
                raise RuntimeError("no event loop available for async tools")
            future = asyncio.run_coroutine_threadsafe(_guarded(async_tools[name](**arguments)), async_loop)
            try:
                result = future.result(timeout or None)
            except TimeoutError as e:
                future.cancel()
                raise ToolTimeout(f"tool did not return within {timeout:g} s") from e
            if isinstance(result, _Raised):
                raise result.error
        else:
            return failure(name, UNKNOWN_TOOL, f"Tool {name} not found.", policy)
    except Exception as e:  # noqa: BLE001 - every failure must reach the model as a message
        names = error_type_names(e)
        # The loop's own timeout is the model's (config: a hung call is never infrastructure), though `ToolTimeout`
        # is a `TimeoutError`, an `OSError`: a user's `infra_error_types: [OSError]` must not retry it.
        classes = [] if isinstance(e, ToolTimeout) else class_names(e)
        outcome = failure(name, names[0], truncate(_exception_text(e), max_chars), policy, names, classes)
        outcome.timed_out = isinstance(e, ToolTimeout)
        return outcome
    # The tool returned: a result, whatever it says (TRL's loop does not count it as a failure either).
    if isinstance(result, list):  # content blocks: TRL passes them through as the message's content
        content, cut = truncate_blocks(result, max_chars)
        return ToolOutcome(name=name, content=content, category="ok", truncated=cut)
    full = printable(result if isinstance(result, str) else _to_text(result))
    outcome = ToolOutcome(name=name, content=truncate(full, max_chars), category="ok")
    outcome.truncated = max_chars is not None and len(full) > max_chars
    return outcome


def printable(text: str) -> str:
    """`text` as a tokenizer can take it: a lone surrogate (a file name decoded with `surrogateescape`, `os.fsdecode`)
    has no UTF-8 encoding and would crash it, so it is shown escaped (`\\udcff`). Anything but a string is returned
    as it is (a parser may give a non-string tool name)."""
    if not isinstance(text, str):
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _to_text(result: Any, render: Callable[[Any], str] = str) -> str:
    try:
        return render(result)
    except Exception as e:  # noqa: BLE001 - a result whose __str__ fails is still reported
        return f"<unprintable {type(result).__name__}: {type(e).__name__}>"
