"""The parent's handle on one sandboxed Python interpreter (see `_sandbox_child.py` for the child side)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref

from .errors import SandboxCrashed, SandboxMemoryError, SandboxTimeout, SandboxUnavailable
from .sandbox_cgroup import CellCgroup
from .sandbox_isolation import CHILD_PATH, SANDBOX_DIR, bwrap_command, sandbox_executable

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
# bubblewrap's monitor, the supervisor and the interpreter count against the cgroup's pids.max on top of the budget.
_OWN_PROCESSES = 3
_EXIT_CGROUP_FAILED = 97  # `_sandbox_child.EXIT_CGROUP_FAILED`
_CGROUP_FAILED_MESSAGE = "cannot join the sandbox cgroup"  # `_sandbox_child.CGROUP_FAILED_MESSAGE`


def _minimal_env(workdir: str, executable: str = sys.executable) -> dict[str, str]:
    # Nothing from the parent's environment (tokens, credentials) reaches user code.
    path = os.pathsep.join(dict.fromkeys([os.path.dirname(executable), "/usr/local/bin", "/usr/bin", "/bin"]))
    return {
        "PATH": path,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        # One BLAS/OpenMP thread: each thread counts against the process budget and reserves address space.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


_live_processes: weakref.WeakSet = weakref.WeakSet()


def _release_command_pipes() -> None:
    """In a process forked from the trainer (a DataLoader or `multiprocessing` worker): the sandboxes' command pipes
    point to /dev/null, so that closing a sandbox in the trainer hangs its pipe up at once (each close otherwise
    waited 2 s for a hang-up that the fork's copy of the pipe held back). `dup2`, not `close`: the fd number stays
    valid for the copied file objects that close it later."""
    for process in list(_live_processes):
        try:
            fd = process._popen.stdin.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
        except (OSError, ValueError):
            continue
        try:
            os.dup2(null, fd)
        except OSError:
            pass
        finally:
            os.close(null)


os.register_at_fork(after_in_child=_release_command_pipes)


def _wait(fd: int, event: int, seconds: float) -> bool:
    """Whether `fd` is ready for `event` (or hung up / failed, which the read or write then reports) within `seconds`.
    `poll`, not `select`: a trainer with many open files gives a new sandbox descriptors past `select`'s 1024."""
    if seconds <= 0:
        seconds = 0.0
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(min(seconds, 1e6) * 1000.0))


def _well_formed(message, command: int | None) -> bool:
    """Whether `message` is what `_sandbox_child` sends: a death report, the ready message (`command` None, at
    start-up), or the answer to command number `command`."""
    if not isinstance(message, dict):
        return False
    if message.get("dead") is True:
        return (
            isinstance(message.get("how"), str)
            and isinstance(message.get("memory"), bool)
            and isinstance(message.get("detail"), str)
        )
    if command is None:
        return message.get("ready") is True and isinstance(message.get("isolation"), dict)
    return (
        set(message) == {"text", "error_type", "n"}
        and isinstance(message["text"], str)
        and (message["error_type"] is None or isinstance(message["error_type"], str))
        and message["n"] == command
        and not isinstance(message["n"], bool)
    )


def _teardown(popen: subprocess.Popen, workdir: str | None, cgroup: CellCgroup | None, capture, owner_pid: int):
    # Module-level so `weakref.finalize` can call it without keeping the handle alive.
    if os.getpid() != owner_pid:
        return  # a forked copy of the trainer (e.g. a dataloader worker) must not kill the parent's sandbox
    try:
        popen.stdin.close()  # the supervisor sees POLLHUP and ends every process of the sandbox
    except OSError:
        pass
    try:
        popen.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        # Last resort. The launcher is not reaped yet, so its pid (our process group id) cannot have been reused.
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if cgroup is not None:
        # Whatever is still in the cgroup (the pid namespace, when there is one, already ended it). The cgroup caps
        # the number of processes, so a few rounds of SIGKILL catch a fork bomb too.
        for _ in range(100):
            pids = cgroup.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
    popen.wait()
    for stream in (popen.stdout, popen.stderr):
        stream.close()
    capture.close()
    if cgroup is not None:
        cgroup.remove()
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


class SandboxProcess:
    """
    One isolated, persistent Python interpreter running in a subprocess.

    With bubblewrap (`"bwrap"` in `mechanisms`) the interpreter runs in its own user, pid, network, mount and IPC
    namespaces, sees only the system and Python directories (read-only), and works in a tmpfs of `max_disk_mb` at
    `/tmp` (also `HOME` and `TMPDIR`) that disappears with it. Without it, it works in a host temporary directory and
    is isolated only by rlimits, a Python-level socket block and process bookkeeping. The cgroup controllers in
    `mechanisms` add limits for all processes of the sandbox together. Started by the constructor and torn down by
    `close`, when the handle is garbage collected, or at interpreter exit.

    Args:
        mechanisms (`Iterable[str]`):
            The isolation mechanisms to use (see `sandbox_isolation.resolve_isolation`).
        memory_limit_mb (`int`, *optional*, defaults to `512`):
            Memory of all processes together (memory cgroup, plus the tmpfs budgets), and `RLIMIT_AS` of each.
        max_output_chars (`int`, *optional*, defaults to `4000`):
            Output (stdout + stderr + error) longer than this is cut by the child before it is sent.
        allow_network (`bool`, *optional*, defaults to `False`):
            Whether user code may open network connections.
        max_processes (`int`, *optional*, defaults to `32`):
            How many processes/threads user code may run at once, besides the sandbox's own three.
        max_file_mb (`int`, *optional*, defaults to `64`):
            `RLIMIT_FSIZE`: the largest file user code may write, which also bounds the captured output.
        max_disk_mb (`int`, *optional*, defaults to `128`):
            Size of the working directory's tmpfs (bubblewrap only); `/dev/shm` gets a quarter of it.
        max_cpus (`float`, *optional*, defaults to `1.0`):
            Cores all processes may use together (cpu cgroup).
        startup_timeout (`float`, *optional*, defaults to `30.0`):
            Seconds to wait for the interpreter to report ready.
    """

    def __init__(
        self,
        mechanisms,
        memory_limit_mb: int = 512,
        max_output_chars: int = 4000,
        allow_network: bool = False,
        max_processes: int = 32,
        max_file_mb: int = 64,
        max_disk_mb: int = 128,
        max_cpus: float = 1.0,
        startup_timeout: float = 30.0,
    ):
        mechanisms = frozenset(mechanisms)
        self.max_output_chars = max_output_chars
        self.memory_limit_mb = memory_limit_mb
        self.namespaces = "bwrap" in mechanisms
        shm_mb = max(1, max_disk_mb // 4)
        # Files in the sandbox's tmpfs are memory too (charged to the cgroup): each budget stays usable on its own.
        memory_bytes = (memory_limit_mb + (max_disk_mb + shm_mb if self.namespaces else 0)) * 1024 * 1024
        controllers = [c for c in ("memory", "pids", "cpu") if f"{c}_cgroup" in mechanisms]
        self.workdir = None if self.namespaces else tempfile.mkdtemp(prefix="trl_agentic_sandbox_")
        self._capture = tempfile.TemporaryFile(prefix="trl_agentic_sandbox_output_")  # the child's stdout/stderr
        try:
            self.cgroup = (
                CellCgroup(memory_bytes, max_processes + _OWN_PROCESSES, max_cpus, controllers)
                if controllers
                else None
            )
        except OSError as exc:
            self._capture.close()
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
            raise SandboxUnavailable(f"could not create the sandbox's cgroup: {exc}") from exc
        self.controllers = set(self.cgroup.dirs) if self.cgroup is not None else set()
        config = {
            "memory_limit_mb": memory_limit_mb,
            "max_output_chars": max_output_chars,
            "allow_network": allow_network,
            "max_processes": max_processes,
            "max_file_mb": max_file_mb,
            "namespaces": self.namespaces,
            "pids_cgroup": "pids" in self.controllers,
            "capture_fd": self._capture.fileno(),
            "cgroup_procs": self.cgroup.procs_files if self.cgroup is not None else [],
            "exec": None,
        }
        workdir = SANDBOX_DIR if self.namespaces else self.workdir
        if self.namespaces:
            inside = dict(config, cgroup_procs=[])  # nothing of /sys is visible inside
            executable = sandbox_executable()
            config["exec"] = bwrap_command(
                shutil.which("bwrap") or "bwrap",
                allow_network=allow_network,
                disk_bytes=max_disk_mb * 1024 * 1024,
                shm_bytes=shm_mb * 1024 * 1024,
                child_script=CHILD_SCRIPT,
                argv=[executable, "-I", "-u", "-B", CHILD_PATH, "supervise", json.dumps(inside)],
                env=_minimal_env(workdir, executable),
            )
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-I", "-u", "-B", CHILD_SCRIPT, "launch", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir if self.workdir is not None else "/",
                env=_minimal_env(workdir),
                pass_fds=(self._capture.fileno(),),
                start_new_session=True,  # own session and process group: killpg reaches the launcher's processes
            )
        except BaseException as exc:
            self._capture.close()
            if self.cgroup is not None:
                self.cgroup.remove()
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
            if isinstance(exc, OSError):
                raise SandboxUnavailable(f"could not start the sandbox: {exc}") from exc
            raise
        self._finalizer = weakref.finalize(
            self, _teardown, self._popen, self.workdir, self.cgroup, self._capture, os.getpid()
        )
        os.set_blocking(self._popen.stdin.fileno(), False)  # `_send` writes with a deadline
        _live_processes.add(self)
        self._buffer = b""
        self._commands = 0  # commands sent; each answer echoes its number
        # A well-behaved child never sends more than this per message (text is clipped in the child).
        self._max_message_bytes = 16 * max_output_chars + 65536
        try:
            hello = self._receive(time.monotonic() + startup_timeout, None)
        except (SandboxTimeout, SandboxCrashed) as exc:
            raise SandboxUnavailable(f"the sandbox did not start: {exc}") from exc
        if not hello.get("ready"):
            self.close()
            raise SandboxUnavailable(f"unexpected first message from the sandbox: {hello!r}")
        self.isolation: dict = hello["isolation"]

    @property
    def pid(self) -> int:
        """`int`: Pid of the launcher (bubblewrap's monitor, or the supervisor), the sandbox's process group id."""
        return self._popen.pid

    @property
    def alive(self) -> bool:
        """`bool`: Whether the sandbox has not been closed (it may still have died unnoticed)."""
        return self._finalizer.alive

    def run(self, code: str, timeout: float) -> dict:
        """
        Executes one cell in the interpreter. When it returns, every process the cell started is gone.

        Args:
            code (`str`):
                Python source code.
            timeout (`float`):
                Wall-clock limit in seconds. On expiry the sandbox is closed and `SandboxTimeout` raised.

        Returns:
            `dict`: `{"text": str, "error_type": str | None}`: the (clipped) output followed by the error message, and
            the exception class name if the code raised.

        Raises:
            `SandboxTimeout`, `SandboxCrashed`, `SandboxMemoryError` (a process of the cell went over the memory
            limit): the sandbox is closed after these, so a cell that failed leaves no state behind.
        """
        if not self.alive:
            raise SandboxCrashed("the interpreter was already closed")
        oom_kills = self.cgroup.oom_kills() if self.cgroup is not None else 0
        deadline = time.monotonic() + timeout
        self._commands += 1
        try:
            self._send((json.dumps({"code": code, "n": self._commands}) + "\n").encode(), deadline)
            message = self._receive(deadline, timeout, oom_kills)
        except SandboxTimeout:
            raise SandboxTimeout(f"the cell exceeded its time limit ({timeout:g} s) and was stopped") from None
        killed = (self.cgroup.oom_kills() if self.cgroup is not None else 0) - oom_kills
        if killed > 0:
            # The cell ran to its end but a process of it was killed: closed, so that its effects are gone as the
            # cell is not recorded (a restore would replay the cells without it and diverge).
            self.close()
            raise SandboxMemoryError(self._over_memory(killed))
        return message

    def _send(self, data: bytes, deadline: float) -> None:
        """Write a command within the cell's deadline. The pipe holds 64 KiB: an interpreter that does not read (a
        thread of an earlier cell holding the GIL, a stopped process) blocked a larger cell's write forever, past
        the limit (and `close`, behind the writer's lock). Raw, non-blocking writes: the buffered writer is unused."""
        fd = self._popen.stdin.fileno()
        view = memoryview(data)
        while view:
            if not _wait(fd, select.POLLOUT, deadline - time.monotonic()):
                self.close()
                raise SandboxTimeout("execution exceeded its time limit")
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError):
                return  # the interpreter died: _receive reads its death report or EOF

    def close(self) -> None:
        """Kills every process of the sandbox and removes its cgroup and working directory. Idempotent."""
        self._finalizer()

    def _over_memory(self, killed: int) -> str:
        return (
            f"the cell went over the sandbox memory limit ({self.memory_limit_mb} MiB for all its processes "
            f"together): {killed} of its processes {'was' if killed == 1 else 'were'} killed"
        )

    def _receive(self, deadline: float, timeout: float | None, oom_kills: int = 0) -> dict:
        phase = "startup" if timeout is None else "execution"
        fd = self._popen.stdout.fileno()
        while b"\n" not in self._buffer:
            if not _wait(fd, select.POLLIN, deadline - time.monotonic()):
                self.close()
                raise SandboxTimeout(f"{phase} exceeded its time limit")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                stderr = self._stderr_tail()
                killed = (self.cgroup.oom_kills() if self.cgroup is not None else 0) - oom_kills
                self.close()
                # Both the code and the launcher's own message: an exit code alone could come from the cells.
                if self._popen.returncode == _EXIT_CGROUP_FAILED and _CGROUP_FAILED_MESSAGE in stderr:
                    raise SandboxUnavailable(f"the sandbox could not join its cgroup{stderr}")
                if killed > 0 and timeout is not None:
                    raise SandboxMemoryError(self._over_memory(killed))
                raise SandboxCrashed(f"the interpreter exited unexpectedly during {phase}{stderr}")
            self._buffer += chunk
            if len(self._buffer) > self._max_message_bytes:
                self.close()
                raise SandboxCrashed("the interpreter sent an oversized message")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):  # the cell's code can write a line nested deeper than the parser goes
            message = None
        # The cell's code can write to the response pipe too: a message of another shape, or not the answer to this
        # command (one it wrote, or the answer to an earlier command after it did: every later call would get the
        # answer of the call before), ends the interpreter.
        if not _well_formed(message, None if timeout is None else self._commands):
            self.close()
            raise SandboxCrashed(f"the interpreter sent a message that is not the answer: {line[:200]!r}")
        if message.get("dead"):
            killed = (self.cgroup.oom_kills() if self.cgroup is not None else 0) - oom_kills
            self.close()
            if killed > 0:
                raise SandboxMemoryError(self._over_memory(killed))
            error = SandboxMemoryError if message["memory"] else SandboxCrashed
            detail = message["detail"].strip()
            raise error(f"the interpreter {message['how']}" + (f": {detail[-300:]}" if detail else ""))
        return message

    def _stderr_tail(self) -> str:
        # Only launcher/bubblewrap/supervisor failures reach the real stderr; read what is there without blocking.
        fd = self._popen.stderr.fileno()
        if not _wait(fd, select.POLLIN, 0.2):
            return ""
        text = os.read(fd, 1 << 16).decode("utf-8", "replace").strip()
        return f": {text[-500:]}" if text else ""
