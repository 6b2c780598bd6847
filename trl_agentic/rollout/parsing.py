"""Hermes-style tool-call parsing (`<tool_call>{json}</tool_call>`), total: it never raises.

TRL's `parse_response` silently returns plain text when a tool call is malformed, so the rollout would just end. We
re-check the raw text with this parser to turn such turns into a `ToolCallParseError` that the model sees and the
metrics count. The same parser serves as the fallback for tokenizers without a response schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# Bound the work on adversarial inputs: a turn with more calls than this is an error, not a parse.
MAX_CALLS = 32
# Arguments nested deeper than this are an error of the loop's (`too_deep`; the parser, like TRL's, takes them): it
# copies calls and the environments that keep them (negative rows, context deletion, checkpoints) with
# `copy.deepcopy`, which recurses, and about 500 levels (1 KB of `[[[`) already exceed Python's recursion limit.
MAX_ARGUMENT_DEPTH = 64


@dataclass
class ToolCallParse:
    """Result of `parse_tool_calls`.

    Attributes:
        content: The text outside the tool-call blocks, stripped.
        calls: Parsed calls in TRL's format: `{"type": "function", "function": {"name": str, "arguments": dict}}`.
        errors: One message per block that could not be parsed (empty when everything parsed).
    """

    content: str
    calls: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_markup(self) -> bool:
        return bool(self.calls or self.errors)


def _parse_block(body: str) -> tuple[dict | None, str | None]:
    body = body.strip()
    if not body:
        return None, "empty <tool_call> block"
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: deeply nested JSON
        return None, f"invalid JSON in <tool_call> block ({type(e).__name__}: {str(e)[:120]})"
    if not isinstance(obj, dict):
        return None, f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, 'a tool call needs a non-empty string "name"'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None, f'"arguments" of tool {name!r} is a string that is not valid JSON'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, f'"arguments" of tool {name!r} must be a JSON object, got {type(args).__name__}'
    return {"type": "function", "function": {"name": name, "arguments": args}}, None


def nesting_depth(value) -> int:
    """How deeply lists and dicts nest in `value` (a scalar: 0, `{"a": [1]}`: 2), without recursion."""
    depth, level = 0, [value]
    while True:
        containers = [x for x in level if isinstance(x, (list, dict))]
        if not containers:
            return depth
        depth += 1
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]


def too_deep(call: dict) -> str | None:
    """The error of a call whose arguments nest deeper than `MAX_ARGUMENT_DEPTH`, else None."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if nesting_depth(arguments) > MAX_ARGUMENT_DEPTH:
        name = function.get("name")
        return f'"arguments" of tool {name!r} nest deeper than {MAX_ARGUMENT_DEPTH} levels'
    return None


def parse_tool_calls(text: str) -> ToolCallParse:
    """Parse every `<tool_call>…</tool_call>` block of an assistant turn.

    Never raises: malformed blocks (unclosed tags, invalid JSON, missing name, non-object arguments, too many calls)
    are reported in `errors`. Runs in linear time (plain `str.find`, no regular expressions).

    Args:
        text: The decoded assistant turn (special tokens such as the end-of-turn marker may be present).

    Returns:
        `ToolCallParse` with the outside text, the parsed calls and the errors.
    """
    if not isinstance(text, str):
        return ToolCallParse(content="", errors=[f"expected text, got {type(text).__name__}"])
    calls, errors, outside = [], [], []
    pos = 0
    while True:
        start = text.find(OPEN_TAG, pos)
        if start < 0:
            stray_close = text.find(CLOSE_TAG, pos)
            if stray_close >= 0:
                errors.append("</tool_call> without a matching <tool_call>")
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_start = start + len(OPEN_TAG)
        end = text.find(CLOSE_TAG, body_start)
        if end < 0:
            errors.append("unclosed <tool_call> tag")
            break
        body = text[body_start:end]
        if OPEN_TAG in body:
            errors.append("nested <tool_call> tag")
        elif len(calls) + len(errors) >= MAX_CALLS:
            errors.append(f"more than {MAX_CALLS} tool calls in one turn")
            break
        else:
            call, error = _parse_block(body)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        pos = end + len(CLOSE_TAG)
    return ToolCallParse(content="".join(outside).strip(), calls=calls, errors=errors)
