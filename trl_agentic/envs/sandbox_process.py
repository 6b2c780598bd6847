"""The parent's handle on one sandboxed Python interpreter process (see `_sandbox_child.py` for the child side)."""

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

from .errors import SandboxCrashed, SandboxMemoryError, SandboxTimeout
from .pids_cgroup import cgroup_pids, create_pids_cgroup, remove_pids_cgroup

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
# Launcher + supervisor + interpreter count against the cgroup's pids.max on top of the user's budget.
_OWN_PROCESSES = 3


def _minimal_env(workdir: str) -> dict[str, str]:
    # Nothing from the parent's environment (tokens, credentials) reaches user code.
    path = os.pathsep.join(dict.fromkeys([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]))
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


def _teardown(popen: subprocess.Popen, workdir: str, cgroup: str | None, owner_pid: int) -> None:
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
        # Processes that left our session with setsid() are still in the cgroup (the pid namespace, when there is one,
        # already ended them). The cgroup caps their number, so a few rounds of SIGKILL catch a fork bomb too.
        for _ in range(100):
            pids = cgroup_pids(cgroup)
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
    if cgroup is not None:
        remove_pids_cgroup(cgroup)
    shutil.rmtree(workdir, ignore_errors=True)


class SandboxProcess:
    """
    One isolated, persistent Python interpreter running in a subprocess.

    The process gets its own temporary working directory (also `HOME` and `TMPDIR`, the only writable place), a
    minimal environment, an address space limit, a file size limit, no network and a process budget (see
    `_sandbox_child.py` for how each is enforced and `isolation` for what was actually available). It is started by the constructor and torn down by `close`, or
    when the handle is garbage collected, or at interpreter exit.

    Args:
        memory_limit_mb (`int`, *optional*, defaults to `512`):
            `RLIMIT_AS` of the interpreter, in MiB.
        max_output_chars (`int`, *optional*, defaults to `4000`):
            Output (stdout + stderr + error) longer than this is cut by the child before it is sent.
        allow_network (`bool`, *optional*, defaults to `False`):
            Whether user code may open network connections.
        max_processes (`int`, *optional*, defaults to `32`):
            How many processes/threads user code may run at once, besides the sandbox's own three.
        max_file_mb (`int`, *optional*, defaults to `64`):
            `RLIMIT_FSIZE`: the largest file user code may write, which also bounds the captured output.
        use_namespaces (`bool`, *optional*, defaults to `True`):
            Use Linux network, pid and mount namespaces when permitted. With `False` (or when unsharing fails), network
            is blocked at the Python `socket` level only, the filesystem stays writable, and processes are ended
            through the cgroup and by the supervisor, a child subreaper.
        startup_timeout (`float`, *optional*, defaults to `10.0`):
            Seconds to wait for the interpreter to report ready.
    """

    def __init__(
        self,
        memory_limit_mb: int = 512,
        max_output_chars: int = 4000,
        allow_network: bool = False,
        max_processes: int = 32,
        max_file_mb: int = 64,
        use_namespaces: bool = True,
        startup_timeout: float = 10.0,
    ):
        self.max_output_chars = max_output_chars
        self.workdir = tempfile.mkdtemp(prefix="trl_agentic_sandbox_")
        self.cgroup = create_pids_cgroup(max_processes + _OWN_PROCESSES)
        config = {
            "memory_limit_mb": memory_limit_mb,
            "max_output_chars": max_output_chars,
            "allow_network": allow_network,
            "max_processes": max_processes,
            "max_file_mb": max_file_mb,
            "use_namespaces": use_namespaces,
            "cgroup": self.cgroup,
            "workdir": self.workdir,  # the one writable place; also makes the command line unique and easy to find
        }
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-I", "-u", "-B", CHILD_SCRIPT, json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.workdir,
                env=_minimal_env(self.workdir),
                start_new_session=True,  # own process group: killpg reaches every process of the sandbox
            )
        except BaseException:
            if self.cgroup is not None:
                remove_pids_cgroup(self.cgroup)
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _teardown, self._popen, self.workdir, self.cgroup, os.getpid())
        self._buffer = b""
        # A well-behaved child never sends more than this per message (text is clipped in the child).
        self._max_message_bytes = 16 * max_output_chars + 65536
        hello = self._receive(time.monotonic() + startup_timeout, "startup", startup_timeout)
        if not hello.get("ready"):
            self.close()
            raise SandboxCrashed(f"unexpected first message from the interpreter: {hello!r}")
        self.isolation: dict = hello["isolation"]

    @property
    def pid(self) -> int:
        """`int`: Pid of the launcher process, which is also the process group id of the whole sandbox."""
        return self._popen.pid

    @property
    def alive(self) -> bool:
        """`bool`: Whether the sandbox has not been closed (it may still have died unnoticed)."""
        return self._finalizer.alive

    def run(self, code: str, timeout: float) -> dict:
        """
        Executes one cell in the interpreter.

        Args:
            code (`str`):
                Python source code.
            timeout (`float`):
                Wall-clock limit in seconds. On expiry the sandbox is closed and `SandboxTimeout` raised.

        Returns:
            `dict`: `{"text": str, "error_type": str | None}`: the (clipped) output followed by the error message, and
            the exception class name if the code raised.

        Raises:
            `SandboxTimeout`, `SandboxCrashed`, `SandboxMemoryError`: the sandbox is closed after any of these.
        """
        if not self.alive:
            raise SandboxCrashed("the interpreter was already closed")
        try:
            self._popen.stdin.write((json.dumps({"code": code}) + "\n").encode())
            self._popen.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the interpreter died: _receive reads its death report or EOF
        return self._receive(time.monotonic() + timeout, "execution", timeout)

    def close(self) -> None:
        """Kills every process of the sandbox and removes its working directory and cgroup. Idempotent."""
        self._finalizer()

    def _receive(self, deadline: float, phase: str, timeout: float) -> dict:
        fd = self._popen.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            ready = select.select([fd], [], [], remaining)[0] if remaining > 0 else []
            if not ready:
                self.close()
                raise SandboxTimeout(f"{phase} exceeded {timeout} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                stderr = self._stderr_tail()
                self.close()
                raise SandboxCrashed(f"the interpreter exited unexpectedly during {phase}{stderr}")
            self._buffer += chunk
            if len(self._buffer) > self._max_message_bytes:
                self.close()
                raise SandboxCrashed("the interpreter sent an oversized message")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            self.close()
            raise SandboxCrashed(f"the interpreter sent a malformed message: {line[:200]!r}") from None
        if message.get("dead"):
            self.close()
            error = SandboxMemoryError if message["memory"] else SandboxCrashed
            detail = message["detail"].strip()
            raise error(f"the interpreter {message['how']}" + (f": {detail[-300:]}" if detail else ""))
        return message

    def _stderr_tail(self) -> str:
        # Only launcher/supervisor start-up failures reach the real stderr; read what is there without blocking.
        fd = self._popen.stderr.fileno()
        if not select.select([fd], [], [], 0.2)[0]:
            return ""
        text = os.read(fd, 1 << 16).decode("utf-8", "replace").strip()
        return f": {text[-500:]}" if text else ""
