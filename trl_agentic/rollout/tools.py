"""Running one tool call safely and classifying what went wrong.

Every failure becomes a message the model can read (never an exception in the trainer): unknown tools, wrong
arguments, exceptions, hangs past `tool_timeout`, huge or non-string results. Each outcome is classified as
`"ok"`, `"model"` (a model error that may trigger a rollback), `"infra"` (an infrastructure failure: retried, never
trained on) or `"error"` (any other failure, shown to the model and counted).
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass
from typing import Any

# A traceback-style last line ("NameError: name 'x' is not defined") in a tool's returned text.
_ERROR_LINE = re.compile(r"(?m)^\s*[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b\s*:")


class ToolTimeout(TimeoutError):
    """A plain Python tool did not return within `tool_timeout` seconds."""


@dataclass
class ToolOutcome:
    """The result of one tool call as the loop sees it.

    Attributes:
        name: Tool name the model asked for.
        content: Text shown to the model (already truncated).
        category: `"ok"`, `"model"`, `"infra"` or `"error"`.
        error_type: Exception class name (or the error type found in the returned text), None when ok.
        error_text: Error message, None when ok.
        truncated: Whether the tool's output was longer than `max_tool_output_chars` and was cut.
    """

    name: str
    content: str
    category: str
    error_type: str | None = None
    error_text: str | None = None
    truncated: bool = False

    @property
    def failed(self) -> bool:
        return self.category != "ok"


def truncate(text: str, max_chars: int) -> str:
    """Cut `text` to `max_chars` characters, saying how much was dropped."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[truncated {len(text) - max_chars} chars]"
    return text[: max(0, max_chars - len(marker))] + marker


def _matches(patterns: list[str], *texts: str | None) -> bool:
    return any(p in t for p in patterns for t in texts if t)


def classify(
    error_type: str | None, error_text: str | None, *, infra_patterns: list[str], rollback_patterns: list[str]
) -> str:
    """Classify a failure: infrastructure patterns win over model-error patterns.

    Args:
        error_type: Exception class name, if any.
        error_text: Exception message or the tool's returned text.
        infra_patterns: `AgenticGRPOConfig.infra_error_patterns`.
        rollback_patterns: `AgenticGRPOConfig.rollback_on_errors`.

    Returns:
        `"infra"`, `"model"` or `"error"`.
    """
    if _matches(infra_patterns, error_type, error_text):
        return "infra"
    if _matches(rollback_patterns, error_type, error_text):
        return "model"
    return "error"


def error_in_text(text: str) -> str | None:
    """Return the error type named by a traceback-style line of a tool's returned text, if there is one."""
    match = _ERROR_LINE.search(text[-4000:])  # the error line of a traceback is at the end
    if match is None:
        return None
    return match.group(0).strip().rstrip(":").strip().split(".")[-1]


def _call_with_timeout(fn, kwargs: dict, timeout: float) -> Any:
    if not timeout:
        return fn(**kwargs)
    box: dict[str, Any] = {}

    def target():
        try:
            box["result"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the model as a message
            box["error"] = e

    # A daemon thread per call: a hung tool leaks its thread but never blocks the trainer or later calls.
    thread = threading.Thread(target=target, daemon=True, name="trl-agentic-tool")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ToolTimeout(f"tool did not return within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def run_tool_call(
    call: dict,
    sync_tools: dict,
    async_tools: dict,
    *,
    timeout: float,
    max_chars: int,
    infra_patterns: list[str],
    rollback_patterns: list[str],
    async_loop: asyncio.AbstractEventLoop | None = None,
) -> ToolOutcome:
    """Execute one parsed tool call and turn whatever happens into a `ToolOutcome`.

    Args:
        call: TRL's call dict `{"type": "function", "function": {"name": ..., "arguments": {...}}}`.
        sync_tools / async_tools: Name → callable for this rollout.
        timeout: Seconds before a call is abandoned (`0` = no limit).
        max_chars: Truncation limit for the text shown to the model.
        infra_patterns / rollback_patterns: Patterns used by `classify`.
        async_loop: Event loop (running in another thread) for async tools.

    Returns:
        The outcome; never raises.
    """
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name", "unknown") if isinstance(function, dict) else "unknown"
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
        return _failure(
            name,
            "ToolCallError",
            f"unsupported tool call {str(call)[:200]}",
            max_chars,
            infra_patterns,
            rollback_patterns,
        )
    arguments = function.get("arguments") or {}
    if not isinstance(arguments, dict):
        return _failure(
            name, "TypeError", f"arguments of {name!r} must be an object", max_chars, infra_patterns, rollback_patterns
        )
    try:
        if name in sync_tools:
            result = _call_with_timeout(sync_tools[name], arguments, timeout)
        elif name in async_tools:
            if async_loop is None:
                raise RuntimeError("no event loop available for async tools")
            future = asyncio.run_coroutine_threadsafe(async_tools[name](**arguments), async_loop)
            try:
                result = future.result(timeout or None)
            except TimeoutError as e:
                future.cancel()
                raise ToolTimeout(f"tool did not return within {timeout:g} s") from e
        else:
            available = ", ".join(sorted([*sync_tools, *async_tools])) or "none"
            return _failure(
                name,
                "ToolNotFoundError",
                f"unknown tool {name!r}; available tools: {available}",
                max_chars,
                infra_patterns,
                rollback_patterns,
            )
    except Exception as e:  # noqa: BLE001 - every failure must reach the model as a message
        return _failure(name, type(e).__name__, str(e), max_chars, infra_patterns, rollback_patterns)
    full = result if isinstance(result, str) else _to_text(result)
    text = truncate(full, max_chars)
    if isinstance(result, dict) and "error" in result:  # TRL convention for tools that report errors
        outcome = _classified(name, text, "ToolError", str(result["error"]), infra_patterns, rollback_patterns)
    elif (
        (in_text := error_in_text(text)) is not None
        or _matches(rollback_patterns, text)
        or _matches(infra_patterns, text)
    ):
        outcome = _classified(name, text, in_text, text, infra_patterns, rollback_patterns)
    else:
        outcome = ToolOutcome(name=name, content=text, category="ok")
    outcome.truncated = len(full) > max_chars
    return outcome


def _to_text(result: Any) -> str:
    try:
        return str(result)
    except Exception as e:  # noqa: BLE001 - a result whose __str__ fails is still reported
        return f"<unprintable {type(result).__name__}: {type(e).__name__}>"


def _classified(name, content, error_type, error_text, infra_patterns, rollback_patterns) -> ToolOutcome:
    category = classify(error_type, error_text, infra_patterns=infra_patterns, rollback_patterns=rollback_patterns)
    return ToolOutcome(name=name, content=content, category=category, error_type=error_type, error_text=error_text)


def _failure(name, error_type, message, max_chars, infra_patterns, rollback_patterns) -> ToolOutcome:
    content = truncate(f"{error_type}: {message}", max_chars)
    return _classified(name, content, error_type, message, infra_patterns, rollback_patterns)
