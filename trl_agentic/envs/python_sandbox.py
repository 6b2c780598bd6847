"""`PythonSandboxEnv`: a TRL tool environment exposing a persistent, sandboxed Python interpreter."""

from .errors import SandboxInfraError
from .sandbox_process import SandboxProcess


class PythonSandboxEnv:
    """
    TRL environment with one tool, `python`, backed by a persistent interpreter in an isolated subprocess.

    Use it as `GRPOTrainer(..., environment_factory=PythonSandboxEnv)` (or a `functools.partial` to change limits).
    Each episode (between two `reset` calls) gets a fresh interpreter in a fresh temporary directory, started lazily
    on the first tool call, with a minimal environment (none of the trainer's variables), an address-space limit, a
    process budget, a read-only view of the rest of the filesystem and, unless `allow_network=True`, no network. What
    the machine allowed is reported by `isolation` (see `_sandbox_child.py` for the mechanisms and their fallbacks).
    This contains accidents and runaway code; it is not hardened against deliberately malicious code.

    Errors are split in two kinds:

    - the model's errors (an exception raised by its code, including `SyntaxError` and a caught `MemoryError`) are
      returned as text ending with e.g. `"NameError: name 'x' is not defined"`, and their class name is stored in
      `last_error_type`;
    - infrastructure errors (`SandboxTimeout`, `SandboxCrashed`, `SandboxMemoryError`) are raised, for the trainer to
      retry. The interpreter is gone after them; the next call starts a new one and silently replays the cells that
      had succeeded, so the episode state survives.

    The state for rollback (`_checkpoint`/`_restore`) is the list of cells that ran without error: restoring restarts
    the interpreter (and its directory) and replays them. Cells that raised are not replayed, so side effects they had
    before raising are lost, and replaying assumes the cells are deterministic (files they write are re-created).

    Args:
        timeout (`float`, *optional*, defaults to `5.0`):
            Wall-clock limit of one call, in seconds.
        memory_limit_mb (`int`, *optional*, defaults to `512`):
            Address-space limit (`RLIMIT_AS`) of the interpreter, in MiB.
        max_output_chars (`int`, *optional*, defaults to `4000`):
            Longer output is cut, with a `"...[truncated N chars]"` marker.
        allow_network (`bool`, *optional*, defaults to `False`):
            Whether user code may use the network.
        max_processes (`int`, *optional*, defaults to `32`):
            How many processes/threads user code may run at once (enforced by a `pids` cgroup when available, see
            `pids_cgroup.py`).
        max_file_mb (`int`, *optional*, defaults to `64`):
            Largest file (and total output of one call) user code may write, in MiB.
        use_namespaces (`bool`, *optional*, defaults to `True`):
            Isolate network, processes and the filesystem with Linux namespaces when permitted; otherwise sockets are
            disabled in Python, the filesystem stays writable and processes are ended through the cgroup.
    """

    def __init__(
        self,
        timeout: float = 5.0,
        memory_limit_mb: int = 512,
        max_output_chars: int = 4000,
        allow_network: bool = False,
        max_processes: int = 32,
        max_file_mb: int = 64,
        use_namespaces: bool = True,
    ):
        if timeout <= 0:
            raise ValueError(f"`timeout` must be positive, got {timeout}.")
        if memory_limit_mb < 64:
            raise ValueError(
                f"`memory_limit_mb` must be at least 64 (the interpreter needs it), got {memory_limit_mb}."
            )
        if max_output_chars < 100:
            raise ValueError(f"`max_output_chars` must be at least 100, got {max_output_chars}.")
        if max_processes < 1:
            raise ValueError(f"`max_processes` must be at least 1, got {max_processes}.")
        self.timeout = float(timeout)
        self._process_kwargs = {
            "memory_limit_mb": memory_limit_mb,
            "max_output_chars": max_output_chars,
            "allow_network": allow_network,
            "max_processes": max_processes,
            "max_file_mb": max_file_mb,
            "use_namespaces": use_namespaces,
        }
        self._process: SandboxProcess | None = None
        self._cells: list[str] = []
        self.last_error_type: str | None = None

    def reset(self, **row) -> None:
        """
        Ends the previous episode: kills its interpreter and removes its directory. The next one starts lazily.

        Args:
            **row: The dataset row (ignored).
        """
        self._close()
        self._cells = []
        self.last_error_type = None

    def python(self, code: str) -> str:
        """
        Run Python code in a persistent interpreter and return its printed output.

        Variables, imports and files persist between calls, and the value of a final expression is printed.
        There is no network access and each call has a time limit.

        Args:
            code: The Python code to run.

        Returns:
            The printed output (stdout and stderr), then the error message if the code raised, or "(no output)".
        """
        try:
            result = self._interpreter().run(code, self.timeout)
        except SandboxInfraError as exc:
            self.last_error_type = type(exc).__name__
            raise
        self.last_error_type = result["error_type"]
        if result["error_type"] is None:
            self._cells.append(code)
        return result["text"] or "(no output)"

    @property
    def isolation(self) -> dict | None:
        """`dict` or `None`: What the running interpreter got (network, pid namespace, process limit, capabilities)."""
        return None if self._process is None else dict(self._process.isolation)

    def _interpreter(self) -> SandboxProcess:
        if self._process is not None and self._process.alive:
            return self._process
        process = SandboxProcess(**self._process_kwargs)
        self._process = process
        for cell in self._cells:
            # Cells that raise now are ignored: they succeeded before, so the state is as close as we can get.
            process.run(cell, self.timeout)
        return process

    def _checkpoint(self) -> list[str]:
        return list(self._cells)

    def _restore(self, state: list[str]) -> None:
        # Lazy: the interpreter restarts and replays `state` on the next call, only if there is one.
        self._close()
        self._cells = list(state)

    def _close(self) -> None:
        if self._process is not None:
            self._process.close()
            self._process = None
