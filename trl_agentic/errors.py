"""How trl-agentic tells the outcomes of a tool call apart, and the one format in which an error reaches the model.

A tool call ends in one of three ways:

- **a result**: the tool returned a value. Whatever it is, it is data, shown to the model as TRL shows it: a string
  that contains `"ValueError: ..."` (model-written code may catch an exception and print it) and a return value that
  looks like an error, such as `{"error": "..."}` or code printing it, are results. TRL's own loop counts only raised
  exceptions as failures (`tools/failure_frequency`), and so does ours.
- **a model error**: the tool raised anything other than an infrastructure error (or the loop refused the call: an
  unknown tool, malformed call markup, a call past `tool_timeout`). The call failed because of what the model asked.
  Its *type* is the exception's class name, or the `error_type` of a `ToolCallError` (e.g. the sandbox reports
  `"NameError"` for model code that raised `NameError`). An environment whose API reports failures as return values
  raises a `ToolCallError` for them (BFCL's APIs: type `"ToolError"`). Model errors whose type is listed in
  `rollback_on_errors` can trigger a rollback (and a negative row); the others are shown to the model and the rollout
  goes on.
- **an infrastructure error**: the tool raised an `InfrastructureError` (or a type listed in `infra_error_types`):
  the failure is not the model's (a sandbox that cannot start, a tool server that refuses connections). The call is
  retried in place; if it keeps failing, the rollout is kept out of the loss and of its group's statistics.

Types are read from the exception's class hierarchy, never from text; an infrastructure error from the hierarchy alone
(a `ToolCallError`'s `error_type` is the model's code speaking: a cell that defines and raises `InfrastructureError`
is a model error).

Every error reaches the model exactly as TRL's `GRPOTrainer` renders it: the tool message content is
`str({"error": message})`, e.g. `"{'error': \"name 'x' is not defined\"}"`. A successful result can print the same
text, so text never tells a failure: the failure is recorded where it happens. trl-agentic's loop builds the tool
message of a failed call as a `FailedToolMessage` (a dict equal to TRL's message, rendered identically), which
`tool_call_failed` reads wherever tool messages are read back (evaluation, the HTML report, `LoopResult.tool_failed`).
Under TRL's own loop (every loop feature off) TRL keeps only the count; an environment that needs per-call outcomes in
its reward records them itself (`CalculatorEnv.last_call_answered`, whether the last successful call returned the
answer, read by `tool_use_reward`).
"""

from __future__ import annotations

__all__ = [
    "FailedToolMessage",
    "InfrastructureError",
    "ToolCallError",
    "error_type_names",
    "render_tool_error",
    "tool_call_failed",
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
    return list(dict.fromkeys(names + class_names(exc)))


def class_names(exc: BaseException) -> list[str]:
    """
    The class names of an exception's hierarchy, most specific first, without the catch-all bases (`Exception`,
    `BaseException`) unless the exception is of that class itself (`raise Exception("HTTP 404")`, the commonest
    failure of user tools, is `["Exception"]`, never no name): what `infra_error_types` is matched against. A
    `ToolCallError`'s `error_type` is not among them: model-written code chooses it (a cell that raises its own
    `InfrastructureError` is the model's error).
    """
    names = [type(exc).__name__]
    for cls in type(exc).__mro__[1:]:
        if cls in (object, BaseException, Exception):
            break
        names.append(cls.__name__)
    return names


def render_tool_error(message: str) -> str:
    """The content of the tool message for a failed call, exactly as TRL's `GRPOTrainer` renders it."""
    return str({"error": message})


class FailedToolMessage(dict):
    """
    The tool message (`{"role": "tool", "name": ..., "content": ...}`) of a call that failed.

    A plain `dict` subclass: it compares equal to the same message built by TRL, chat templates render it identically,
    and it survives copies and pickling (`gather_object`). Its type is the record that the call failed.
    """


def tool_call_failed(message) -> bool:
    """
    Whether a tool message is that of a failed call (the tool raised, or the loop refused the call).

    Read from the message's type (`FailedToolMessage`), never from its text: a successful result may print anything,
    `{"error": ...}` included. A message built by TRL's own loop carries no record (TRL keeps only the failure count),
    so it reads as not failed.

    Args:
        message: A chat message (`dict`).

    Returns:
        `bool`
    """
    return isinstance(message, FailedToolMessage)
