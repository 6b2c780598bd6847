"""Errors raised by the Python sandbox (`PythonSandboxEnv`), placed in trl-agentic's taxonomy (see `trl_agentic.errors`).

Model errors (the model's code is at fault; shown to the model, may trigger a rollback, never retried):

- `CodeError`: the code raised an exception. Its `error_type` is the exception's class name (e.g. `"NameError"`).
- `SandboxError` and its subclasses `SandboxTimeout`, `SandboxCrashed`, `SandboxMemoryError`: the code ran past the
  time limit, killed its interpreter, or went over the cell's memory limit. The sandbox cleaned up after it.
- `SandboxRestoreError` (a `SandboxError`): the interpreter had to restart (after a rollback, a timeout or a crash) and
  replaying the earlier successful cells did not give the same result (a cell ran past `replay_timeout_factor` times
  the limit, crashed or raised this time): the model's earlier code is not replayable. The call's own code did not run;
  the state from that cell on is lost.

Infrastructure errors (not the model's fault; retried in place, never trained on):

- `SandboxUnavailable`: the sandbox could not start, or the isolation it was asked to require is missing.
"""

from ..errors import InfrastructureError, ToolCallError

__all__ = [
    "CodeError",
    "SandboxCrashed",
    "SandboxError",
    "SandboxMemoryError",
    "SandboxRestoreError",
    "SandboxTimeout",
    "SandboxUnavailable",
]


class CodeError(ToolCallError):
    """
    The model's code raised an exception (a `SyntaxError`, a `NameError`, a caught-and-reraised `MemoryError`, ...).

    Args:
        message (`str`):
            What the model reads: the output the cell printed, then the error line (e.g.
            `"partial\\nZeroDivisionError: division by zero"`).
        error_type (`str`):
            The exception's class name.
    """


class SandboxError(ToolCallError):
    """
    Base class of the sandbox failures caused by the model's code. The sandbox ended every process of the cell.

    Args:
        message (`str`):
            What went wrong, as the model reads it.
    """


class SandboxTimeout(SandboxError):
    """The cell exceeded its wall-clock limit; its interpreter and all its processes were killed."""


class SandboxCrashed(SandboxError):
    """The interpreter died during the cell (e.g. `os._exit`, a segfault, `os.abort()`)."""


class SandboxMemoryError(SandboxCrashed):
    """The cell's processes together went over the memory limit (the kernel killed one), or the interpreter died of an
    allocation failure. A `MemoryError` that the code raises and does not catch is a `CodeError` instead."""


class SandboxRestoreError(SandboxError):
    """Replaying the episode's earlier successful cells into a restarted interpreter diverged: a cell timed out,
    crashed or raised this time (e.g. it waited for a variable that a cell which raised had set). Caused by the model's
    code, so a model error; the cells from the divergent one on are dropped from the episode's state."""


class SandboxUnavailable(InfrastructureError):
    """The sandbox cannot start here, or isolation it was asked to require is missing (the message names what and the
    opt-in). Not the model's fault."""
