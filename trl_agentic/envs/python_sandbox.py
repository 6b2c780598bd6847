"""`PythonSandboxEnv`: a TRL tool environment exposing a persistent, sandboxed Python interpreter."""

from __future__ import annotations

import numbers

from ..field_checks import check_finite
from .errors import CodeError, SandboxError, SandboxRestoreError, SandboxUnavailable
from .sandbox_isolation import resolve_isolation
from .sandbox_process import SandboxProcess

MAX_SANDBOX_TIMEOUT = 1e6  # seconds; as `tool_timeout`'s bound (a larger one overflows the poll's milliseconds)


def check_timeout(name: str, value) -> None:
    """A sandbox call's limit, `name` as the caller calls it (`PythonSandboxEnv`, `TaskArguments`): positive, finite,
    at most `MAX_SANDBOX_TIMEOUT` seconds."""
    check_finite(name, value)
    if not 0 < value <= MAX_SANDBOX_TIMEOUT:
        raise ValueError(f"`{name}` must be positive and at most {MAX_SANDBOX_TIMEOUT:g} s, got {value}.")


class PythonSandboxEnv:
    """
    TRL environment with one tool, `python`, backed by a persistent interpreter in an isolated subprocess.

    Use it as `GRPOTrainer(..., environment_factory=PythonSandboxEnv)` (or a `functools.partial` to change limits).
    Each episode (between two `reset` calls) gets a fresh interpreter in a fresh working directory, started lazily on
    the first tool call. Model-written code is treated as hostile; see docs/reliability.md for what stops each attack.

    Isolation (checked when the environment is constructed, i.e. at trainer start-up; see `sandbox_isolation.py`):
    bubblewrap namespaces (no network, no host processes, no host files but the read-only system and Python
    directories, none of the trainer's environment variables) and cgroups for limits that hold for all processes of a
    cell together (memory, processes, cores). With `isolation="required"` (the default) a machine that lacks any of
    them is refused with `SandboxUnavailable` naming what is missing; `"best_effort"` runs with what there is and logs
    once what protection is absent.

    Errors, in trl-agentic's taxonomy (`trl_agentic.errors`):

    - the code raised → `CodeError` (a model error) whose `error_type` is the exception's class name and whose message
      is the printed output then the error line;
    - the code ran past the time limit, killed the interpreter or went over the memory limit → `SandboxTimeout`,
      `SandboxCrashed`, `SandboxMemoryError` (model errors). The next call starts a new interpreter and replays the
      cells that had run to completion, so the episode state survives;
    - a replay that does not reproduce a cell's outcome → `SandboxRestoreError`, a model error (see below);
    - the sandbox cannot start → `SandboxUnavailable` (an infrastructure error: retried, not the model's fault).

    A cell's processes never outlive it: when a call returns, every process the cell started has been killed. Not its
    threads: a thread the cell started keeps running between calls (inside the interpreter, within the cpu and pids
    cgroups), and may start processes there, which the next call's end kills; `reset` and a restore end them all.

    The state for rollback (`_checkpoint`/`_restore`) is the list of cells that ran to completion, each with its
    outcome: the cells that succeeded *and* the cells that raised (their statements before the exception did run).
    Restoring restarts the interpreter (and its directory) and, at the next call, replays them in order, each under
    `replay_timeout_factor` times the call's time limit (each ran within the limit before; the slack keeps a machine
    that is busier now than then from cutting a deterministic cell), expecting each to end as it did the first time
    (success, or the same exception type). So a cell `x = 1; 1/0` is replayed (it sets `x`, then raises as before) and
    a later `while 'x' not in globals(): pass` ends as it did. Cells that killed the interpreter (time limit, crash,
    memory) are not replayed: their interpreter was lost when they ran. What a restore brings back is what re-running
    those cells produces: variables, imports, function definitions and files, if the cells are deterministic. It does
    not bring back anything that depends on time, randomness without a fixed seed, the process id or other outside
    state. When a replayed cell ends differently from its first run (it times out, crashes, raises where it had
    succeeded, or the reverse), the restore stops there: the call raises `SandboxRestoreError` without running its
    code, the state keeps the cells before the divergent one and drops the rest. This is a model error, never an
    infrastructure error: retrying cannot help, and the rollout keeps its reward.

    Args:
        timeout (`float`, *optional*, defaults to `5.0`):
            Wall-clock limit of one call, in seconds.
        memory_limit_mb (`int`, *optional*, defaults to `512`):
            Memory of all processes of the sandbox together (memory cgroup), and `RLIMIT_AS` of each, in MiB.
        max_output_chars (`int`, *optional*, defaults to `4000`):
            Longer output is cut, with a `"...[truncated N chars]"` marker.
        allow_network (`bool`, *optional*, defaults to `False`):
            Whether user code may use the network.
        max_processes (`int`, *optional*, defaults to `32`):
            How many processes/threads user code may run at once (pids cgroup).
        max_file_mb (`int`, *optional*, defaults to `64`):
            Largest file (and total output of one call) user code may write, in MiB.
        max_disk_mb (`int`, *optional*, defaults to `128`):
            Size of the working directory (a tmpfs); `/dev/shm` gets a quarter of it on top. Its number of files is
            bounded by the memory cgroup (each file is kernel memory charged to the sandbox).
        max_cpus (`float`, *optional*, defaults to `1.0`):
            Cores the sandbox's processes may use together (cpu cgroup): a call uses at most `max_cpus x timeout` of
            CPU time (threads a cell leaves running use the same cores between calls).
        replay_timeout_factor (`float`, *optional*, defaults to `3.0`):
            A replayed cell's limit is this times `timeout`: it ran to completion within `timeout` before, so only a
            slower machine (load) or code that now runs forever can stop it. A replay slower than that is a
            `SandboxRestoreError` (a model error). 1.0 replays under the call's own limit.
        isolation (`str`, *optional*, defaults to `"required"`):
            `"required"`: refuse to run without every isolation mechanism. `"best_effort"`: use what the machine has
            and log what is missing.
        without (`tuple[str, ...]`, *optional*, defaults to `()`):
            Mechanisms to leave unused as if the machine lacked them (`"bwrap"`, `"memory_cgroup"`, `"pids_cgroup"`,
            `"cpu_cgroup"`): for tests of the refusal and fallback paths.
    """

    def __init__(
        self,
        timeout: float = 5.0,
        memory_limit_mb: int = 512,
        max_output_chars: int = 4000,
        allow_network: bool = False,
        max_processes: int = 32,
        max_file_mb: int = 64,
        max_disk_mb: int = 128,
        max_cpus: float = 1.0,
        replay_timeout_factor: float = 3.0,
        isolation: str = "required",
        without: tuple[str, ...] = (),
    ):
        # Types and finiteness first: `nan` passes every comparison below, and a non-integer size only fails when
        # the sandbox starts (every call an infrastructure failure).
        check_timeout("timeout", timeout)
        for name, value in (("max_cpus", max_cpus), ("replay_timeout_factor", replay_timeout_factor)):
            check_finite(name, value)
        for name, value in (
            ("memory_limit_mb", memory_limit_mb),
            ("max_output_chars", max_output_chars),
            ("max_processes", max_processes),
            ("max_file_mb", max_file_mb),
            ("max_disk_mb", max_disk_mb),
        ):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"`{name}` must be an integer, got {value!r}.")
        if memory_limit_mb < 64:
            raise ValueError(
                f"`memory_limit_mb` must be at least 64 (the interpreter needs it), got {memory_limit_mb}."
            )
        if max_output_chars < 100:
            raise ValueError(f"`max_output_chars` must be at least 100, got {max_output_chars}.")
        if max_processes < 1:
            raise ValueError(f"`max_processes` must be at least 1, got {max_processes}.")
        if not 1 <= max_file_mb <= max_disk_mb:
            raise ValueError(f"need 1 <= `max_file_mb` <= `max_disk_mb`, got {max_file_mb} and {max_disk_mb}.")
        if max_cpus <= 0:
            raise ValueError(f"`max_cpus` must be positive, got {max_cpus}.")
        if not 1 <= replay_timeout_factor <= 100:
            raise ValueError(f"`replay_timeout_factor` must be between 1 and 100, got {replay_timeout_factor}.")
        self.timeout = float(timeout)
        self.replay_timeout_factor = float(replay_timeout_factor)
        self.isolation_policy = isolation
        self.mechanisms = resolve_isolation(isolation, without)  # refuses here, at start-up, when "required"
        self._process_kwargs = {
            "mechanisms": self.mechanisms,
            "memory_limit_mb": memory_limit_mb,
            "max_output_chars": max_output_chars,
            "allow_network": allow_network,
            "max_processes": max_processes,
            "max_file_mb": max_file_mb,
            "max_disk_mb": max_disk_mb,
            "max_cpus": max_cpus,
        }
        self._process: SandboxProcess | None = None
        # (code, error type or None): every cell that ran to completion, with how it ended (replayed on restore).
        self._cells: list[tuple[str, str | None]] = []
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
        There is no network access, each call has a time limit, and processes started by a call end with it.

        Args:
            code: The Python code to run.

        Returns:
            The printed output (stdout and stderr), or "(no output)".
        """
        try:
            result = self._interpreter().run(code, self.timeout)
        except (SandboxError, SandboxUnavailable) as exc:
            self.last_error_type = type(exc).__name__
            raise
        self.last_error_type = result["error_type"]
        self._cells.append((code, result["error_type"]))
        if result["error_type"] is not None:
            raise CodeError(result["text"], error_type=result["error_type"])
        return result["text"] or "(no output)"

    @property
    def isolation(self) -> dict | None:
        """`dict` or `None`: The policy, the mechanisms in use and what the running interpreter got."""
        if self._process is None:
            return None
        return {
            "policy": self.isolation_policy,
            "mechanisms": sorted(self.mechanisms),
            "filesystem": "private" if self._process.namespaces else "host",
            "limits": sorted(self._process.controllers),
            **self._process.isolation,
        }

    def _interpreter(self) -> SandboxProcess:
        if self._process is not None and self._process.alive:
            return self._process
        process = SandboxProcess(**self._process_kwargs)  # SandboxUnavailable here: the infrastructure's
        self._process = process
        for k, (cell, outcome) in enumerate(self._cells):
            # Every cell replayed here ran to completion before, ending with `outcome`. One that now ends otherwise
            # (times out, crashes, raises where it had not, or the reverse) diverged because of what the model's code
            # does (it is not deterministic): a model error. Retrying it as infrastructure would only diverge again.
            try:
                result = process.run(cell, self.timeout * self.replay_timeout_factor)
                failure = None
                if result["error_type"] != outcome:
                    lines = (result["text"] or "").splitlines()
                    ended = f"raised {result['error_type']}" if result["error_type"] else "succeeded"
                    first = f"raised {outcome}" if outcome else "succeeded"
                    failure = f"it {ended} where it had {first}" + (f": {lines[-1]}" if result["error_type"] else "")
            except SandboxError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            if failure is not None:
                lost = len(self._cells) - k
                self._cells = self._cells[:k]
                self._close()
                raise SandboxRestoreError(
                    f"the interpreter restarted and could not restore its state: replaying earlier cell {k + 1} of "
                    f"{k + lost} failed this time ({failure}). What that cell and the {lost - 1} after it defined is "
                    "lost; this call's code did not run."
                )
        return process

    def _checkpoint(self) -> list[tuple[str, str | None]]:
        return list(self._cells)

    def _restore(self, state: list[tuple[str, str | None]]) -> None:
        # Lazy: the interpreter restarts and replays `state` on the next call, only if there is one.
        self._close()
        self._cells = list(state)

    def _close(self) -> None:
        if self._process is not None:
            self._process.close()
            self._process = None
