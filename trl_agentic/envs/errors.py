"""Infrastructure errors raised by sandboxed tool environments.

These signal that the *sandbox* failed (the interpreter hung, died or ran out of memory), not that the model wrote bad
code: the trainer retries the turn and never trains on it. Errors in the model's own code are returned to the model as
tool output text instead (see `PythonSandboxEnv.python`).
"""


class SandboxInfraError(RuntimeError):
    """
    Base class of sandbox infrastructure failures.

    The message always starts with the class name (e.g. `"SandboxTimeout: execution exceeded 5.0 s"`), so it stays
    recognizable after the trainer turns the exception into text.

    Args:
        detail (`str`):
            What went wrong, appended after the class name.
    """

    def __init__(self, detail: str):
        self.detail = detail
        super().__init__(f"{type(self).__name__}: {detail}")


class SandboxTimeout(SandboxInfraError):
    """A call exceeded its wall-clock limit; the interpreter and all its processes were killed."""


class SandboxCrashed(SandboxInfraError):
    """The interpreter process died or failed to start (e.g. a segfault, `os._exit`, or a broken pipe)."""


class SandboxMemoryError(SandboxCrashed):
    """The interpreter died because it ran out of memory (a `MemoryError` caught in user code is not this)."""
