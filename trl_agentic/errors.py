"""How trl-agentic tells the outcomes of a tool call apart, and the one format in which an error reaches the model.

A tool call ends in one of three ways:

- **a result**: the tool returned a value. Its text is shown to the model as it is, even if it contains words like
  `"ValueError: ..."` (model-written code may catch an exception and print it: that is not a failed call).
- **a model error**: the tool raised anything other than an infrastructure error. The call failed because of what the
  model asked (unknown tool, wrong arguments, code that raised, looped past its time limit, crashed or ran out of
  memory). Its *type* is the exception's class name, or the `error_type` of a `ToolCallError` (e.g. the sandbox
  reports `"NameError"` for model code that raised `NameError`). A tool that returns `{"error": ...}` (TRL's own
  convention) has failed too, with type `"ToolError"`. Model errors whose type is listed in `rollback_on_errors` can
  trigger a rollback (and a negative row); the others are shown to the model and the rollout goes on.
- **an infrastructure error**: the tool raised an `InfrastructureError` (or a type listed in `infra_error_types`):
  the failure is not the model's (a sandbox that cannot start, a tool server that refuses connections). The call is
  retried in place; if it keeps failing, the rollout is kept out of the loss and of its group's statistics.

Types are read from the exception's class hierarchy, never searched for in text.

Every error reaches the model exactly as TRL's `GRPOTrainer` renders it: the tool message content is
`str({"error": message})`, e.g. `"{'error': \"name 'x' is not defined\"}"`. `tool_error_message` recognises that format
wherever tool results are read back (reward helpers, evaluation, the HTML report).
"""

from __future__ import annotations

import ast

__all__ = [
    "InfrastructureError",
    "ToolCallError",
    "error_type_names",
    "render_tool_error",
    "tool_error_message",
]


class InfrastructureError(RuntimeError):
    """
    Raised by a tool or an environment when a call failed for a reason that is not the model's.

    The call is retried in place (up to `max_infra_retries` times), so raise it *before* the call changes the
    environment's state. Nothing of a rollout that keeps failing is trained on.
    """


class ToolCallError(Exception):
    """
    A model error with an explicit type, for tools that run model-written code or wrap another error.

    Args:
        message (`str`):
            What the model is shown (inside TRL's `{"error": message}`).
        error_type (`str`, *optional*):
            The error's type name as `rollback_on_errors` and `negative_reward_by_error` see it; the class name when
            unset.
    """

    def __init__(self, message: str, error_type: str | None = None):
        super().__init__(message)
        self.error_type = error_type or type(self).__name__


def error_type_names(exc: BaseException) -> list[str]:
    """
    The names under which an exception is matched: its `error_type` (for a `ToolCallError`), then every class name of
    its hierarchy up to `BaseException` (so `"OSError"` also matches a `FileNotFoundError`).

    Args:
        exc (`BaseException`): The exception a tool raised.

    Returns:
        `list[str]`: Names, most specific first, without duplicates.
    """
    names = [exc.error_type] if isinstance(getattr(exc, "error_type", None), str) else []
    for cls in type(exc).__mro__:
        if cls in (object, BaseException, Exception):
            break
        names.append(cls.__name__)
    return list(dict.fromkeys(names))


def render_tool_error(message: str) -> str:
    """The content of the tool message for a failed call, exactly as TRL's `GRPOTrainer` renders it."""
    return str({"error": message})


def tool_error_message(content) -> str | None:
    """
    The error message of a tool result in TRL's error format, or None when the result is not an error.

    Args:
        content: A tool message's content (or a tool's return value).

    Returns:
        `str | None`: The `"error"` entry (when not None) of `content` if it is a dict or the `str` of one, else
        None.
    """
    if isinstance(content, str) and content.startswith("{") and "'error':" in content:
        try:
            content = ast.literal_eval(content)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    if isinstance(content, dict) and content.get("error") is not None:
        return str(content["error"])
    return None
