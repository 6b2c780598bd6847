"""Child side of `PythonSandboxEnv`: the launcher, a supervisor, and the persistent interpreter loop.

`SandboxProcess` runs this file as `python -I -u -B _sandbox_child.py launch '<json config>'`, with stdin carrying
JSON-lines commands and stdout JSON-lines responses. It uses the standard library only and never imports `trl_agentic`
(inside bubblewrap, `trl_agentic` is not even visible), so the child starts fast and user code sees a clean module
table.

- launcher: joins the sandbox's cgroups (their limits then hold for every process it starts), then either `exec`s
  bubblewrap, which runs `_sandbox_child.py supervise` as pid 1 of fresh namespaces (see `sandbox_isolation.py`), or,
  without bubblewrap, becomes the supervisor itself.
- supervisor: forks the interpreter, reaps orphans, reports the interpreter's death, and ends everything when the
  parent closes the command pipe (or dies). As pid 1 of the pid namespace its exit makes the kernel kill every process
  left there. Without a pid namespace it is a child subreaper and kills the sandbox's processes (cgroup members, its
  session, its descendants) until none is left.
- interpreter: redirects fds 1/2 to the capture file, applies rlimits, drops capabilities, and runs the cells. After
  each cell it kills every process the cell started: nothing outlives its cell.

Commands: `{"code": str, "n": int}`. Responses: `{"ready": true, "isolation": {...}}` once, then one
`{"text": str, "error_type": str | null, "n": int}` per command (its `n`: the cell's code can write to the pipe too,
and a message it wrote must not pass for the answer), or a final `{"dead": true, ...}` from the supervisor.
"""

import ast
import builtins
import codecs
import ctypes
import gc
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
# waitpid options: WNOHANG | __WALL, which also reaps children cloned with an exit signal other than SIGCHLD (a raw
# clone() through ctypes in model code); without it such a zombie would stay.
WAIT_ANY_CHILD = os.WNOHANG | 0x40000000
LINUX_CAPABILITY_VERSION_3 = 0x20080522
MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "out of memory")
# The launcher exits with this code, after writing CGROUP_FAILED_MESSAGE to its stderr, when it cannot join the
# cgroups: the parent reports the sandbox unavailable (an infrastructure error, so the rollout is not trained).
EXIT_CGROUP_FAILED = 97
CGROUP_FAILED_MESSAGE = "cannot join the sandbox cgroup"
# The interpreter exits with this code when the protocol's own work between cells runs out of memory.
EXIT_OUT_OF_MEMORY = 98

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> bool:
    return _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), 0) == 0


def _write_message(fd: int, message: dict) -> None:
    data = (json.dumps(message, ensure_ascii=False) + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(fd, data) :]


# ----------------------------------------------------------------------------------------------------------- launcher


def _launch(config: dict) -> None:
    config["session"] = os.getsid(0)  # the parent started us in a new session: every sandbox process starts in it
    for procs in config["cgroup_procs"]:
        try:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        except OSError as exc:
            sys.stderr.write(f"{CGROUP_FAILED_MESSAGE} {procs}: {exc}\n")
            os._exit(EXIT_CGROUP_FAILED)
    if config["exec"]:
        os.execv(config["exec"][0], config["exec"])  # bubblewrap, which runs `supervise` inside the namespaces
    _supervise(config)


# --------------------------------------------------------------------------------------------------------- supervisor


def _supervise(config: dict) -> None:
    pid_namespace = os.getpid() == 1
    if not pid_namespace:
        # Become the reaper of orphaned user processes, so they stay our descendants and can be found and ended.
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
    capture_fd = config["capture_fd"]
    hangup_fd = os.dup(0)
    report_fd = os.dup(1)
    config["supervisor"] = os.getpid()
    # The cells run as our uid: dumpable, we could be ptraced by them (our /proc/pid/mem written, our system calls
    # replaced: host files written past their rlimits, our exit code made the launcher's cgroup failure, which is an
    # infrastructure error). Not dumpable, that needs CAP_SYS_PTRACE, which the cells lack. Set before the fork, so
    # that no cell can run before it; the interpreter is dumpable again (its own children read its /proc files).
    _prctl(PR_SET_DUMPABLE, 0)
    interpreter = os.fork()
    if interpreter == 0:
        _prctl(PR_SET_DUMPABLE, 1)
        os.close(hangup_fd)
        os.close(report_fd)
        _interpret(config, pid_namespace, capture_fd)
    os.close(0)
    os.close(1)

    # Orphans are reparented to us: reap them at once (zombies count against the process limit).
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    poller = select.poll()
    # Event mask 0: only POLLHUP/POLLERR, i.e. the parent closed the command pipe (or died).
    poller.register(hangup_fd, 0)
    poller.register(wake_read, select.POLLIN)
    while True:
        for fd, _ in poller.poll(100):
            if fd == hangup_fd:
                _end_all(pid_namespace, config)
            elif fd == wake_read:
                os.read(wake_read, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, WAIT_ANY_CHILD)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == interpreter:
                _report_death(report_fd, capture_fd, status)
                _end_all(pid_namespace, config)


def _report_death(report_fd: int, capture_fd: int, status: int) -> None:
    if os.WIFSIGNALED(status):
        how = f"was killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    elif os.WEXITSTATUS(status) == EXIT_OUT_OF_MEMORY:
        how = "ran out of memory reading the cell or ending the one before"
    else:
        how = f"exited with code {os.WEXITSTATUS(status)}"
    # A fatal error (e.g. "Fatal Python error: ... MemoryError") lands in the capture file, which is the child's fd 2.
    size = os.fstat(capture_fd).st_size
    tail = os.pread(capture_fd, 2000, max(size - 2000, 0)).decode("utf-8", "replace")
    # Only the interpreter's own fatal error counts, not the cell's output ("checking for out of memory" printed
    # before `os._exit(1)` made a crash a memory error, which rollback matches by type).
    memory = (os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_OUT_OF_MEMORY) or any(
        line.startswith("Fatal Python error") and any(marker in line for marker in MEMORY_MARKERS)
        for line in tail.splitlines()
    )
    try:
        _write_message(report_fd, {"dead": True, "how": how, "memory": memory, "detail": tail[-500:]})
    except OSError:
        pass


def _process_table() -> dict[int, tuple[int, int, bool]]:
    """pid -> (parent pid, session id, dead) of every process we can see. Dead: a zombie with no live thread (a
    leader whose main thread exited shows "Z" while its other threads run)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                table[int(entry)] = (int(fields[1]), int(fields[3]), fields[0] == b"Z" and int(fields[17]) <= 1)
            except (OSError, IndexError, ValueError):
                pass  # exited meanwhile
    return table


def _sandbox_members(config: dict, roots: set[int]) -> dict[int, bool]:
    """Without a pid namespace: pid -> dead (see `_process_table`) of the sandbox's processes other than `roots`
    (cgroup members, processes of the sandbox's session, and every descendant of `roots`), however deep or setsid'ed.

    A dead one is left out when no process of the sandbox will reap it: its parent is outside (orphans go to the
    host's init when the supervisor could not become their subreaper), so waiting for it would never end."""
    members: set[int] = set()
    for procs in config["cgroup_procs"]:
        try:
            with open(procs) as f:
                members |= {int(line) for line in f if line.strip()}
        except OSError:
            pass
    table = _process_table()
    members |= {pid for pid, (_, session, _) in table.items() if session == config.get("session")}
    seen, frontier = set(roots), set(roots)
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in table.items() if ppid in frontier and pid not in seen}
        seen |= frontier
    members = {pid for pid in members | seen if pid in table}
    return {pid: table[pid][2] for pid in members - roots if not table[pid][2] or table[pid][0] in members}


def _kill_until_gone(config: dict, roots: set[int], reap) -> bool:
    """Without a pid namespace: SIGKILLs the sandbox's other processes, round after round, until none is left.

    Done means reaped, not only dead: a zombie's pid still answers `os.kill(pid, 0)`, so the next cell would see a
    killed daemon as alive. Our own children are reaped by `reap`; orphans by the supervisor (their subreaper), which
    may run a moment later, so the rounds wait for it.
    """
    for _ in range(1000):
        reap()
        members = _sandbox_members(config, roots)
        if not members:
            return True
        for pid, dead in members.items():
            if not dead:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):  # gone, and its pid reused by another user's process
                    pass
        select.select([], [], [], 0.002)
    return False


def _reap_all() -> None:
    while True:
        try:
            if os.waitpid(-1, WAIT_ANY_CHILD)[0] == 0:
                return
        except ChildProcessError:
            return


def _end_all(pid_namespace: bool, config: dict) -> None:
    if pid_namespace:
        os._exit(0)  # pid 1 exiting: the kernel SIGKILLs everything else in the namespace
    if not _kill_until_gone(config, {os.getpid()}, _reap_all):
        os.killpg(0, signal.SIGKILL)
    os._exit(0)


# -------------------------------------------------------------------------------------------------------- interpreter


def _drop_capabilities() -> bool:
    # Only matters without bubblewrap when the trainer is root: root without capabilities cannot raise rlimits again,
    # read other processes' memory or environment, or override file permissions. (Inside bubblewrap the sandbox runs
    # as a non-root user of its user namespace, which has no capabilities to begin with.)
    for cap in range(64):
        _prctl(PR_CAPBSET_DROP, cap)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    dropped = _libc.capset(ctypes.byref(Header(LINUX_CAPABILITY_VERSION_3, 0)), (Data * 2)()) == 0
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    return dropped


def _disable_sockets() -> None:
    # Fallback when no network namespace could be created: Python-level only (`_socket` or a subprocess gets out).
    import socket

    def refuse(self, *args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")

    socket.socket.__init__ = refuse


def _count_user_tasks(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                pass
    return count


def _read_capture(fd: int, limit: int) -> tuple[str, int]:
    """Returns the first `limit` characters of the capture file and the total number of characters in it."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    head, kept, total, offset = [], 0, 0, 0
    while True:
        chunk = os.pread(fd, 1 << 16, offset)
        offset += len(chunk)
        text = decoder.decode(chunk, final=not chunk)
        total += len(text)
        if kept < limit and text:
            head.append(text[: limit - kept])
            kept += len(head[-1])
        if not chunk:
            return "".join(head), total


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n...[truncated {len(text) - limit} chars]"


def _reap_children() -> None:
    """Reaps exited children: zombies left by `os.fork()` would count against the process budget until we exit."""
    exit_codes = {}
    while True:
        try:
            pid, status = os.waitpid(-1, WAIT_ANY_CHILD)
        except ChildProcessError:
            break
        if pid == 0:
            break
        exit_codes[pid] = os.waitstatus_to_exitcode(status)
    if not exit_codes:
        return
    # Hand the exit codes to the Popen objects that own them, so their poll()/wait() still report the truth.
    owners = ("subprocess", "Popen"), ("multiprocessing.popen_fork", "Popen")
    types = tuple(cls for module, name in owners if (cls := getattr(sys.modules.get(module), name, None)))
    if types:
        for obj in gc.get_objects():
            if isinstance(obj, types) and obj.returncode is None and obj.pid in exit_codes:
                obj.returncode = exit_codes[obj.pid]


def _exit_if_orphaned(config: dict) -> None:
    # PR_SET_PDEATHSIG kills us when the supervisor dies; this check covers a supervisor that died before the prctl and
    # guards the cleanup: an orphan's new parent (a subreaper, or the host's init) must never become a root whose
    # descendants we kill.
    if os.getppid() != config["supervisor"]:
        os._exit(1)


def _end_cell_processes(config: dict, pid_namespace: bool) -> None:
    """Kills every process the cell started (background servers, daemons, `setsid()` escapees): none outlives it."""
    if pid_namespace:
        # kill(-1) reaches every process of our pid namespace except pid 1 (the supervisor) and ourselves. A process
        # being killed cannot fork any more, so a round or two clears a fork bomb; zombies keep it succeeding until
        # they are reaped (our children by us, orphans by the supervisor).
        for _ in range(2000):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                break
            _reap_children()
            time.sleep(0.0005)
    else:
        _exit_if_orphaned(config)
        _kill_until_gone(config, {os.getpid(), config["supervisor"]}, _reap_children)
    _reap_children()


def _run_cell(code: str, namespace: dict) -> None:
    tree = compile(code, "<cell>", "exec", ast.PyCF_ONLY_AST)
    # Like a notebook: the value of a trailing expression is printed.
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
        if value is not None:
            print(repr(value))


def _interpret(config: dict, pid_namespace: bool, capture_fd: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _exit_if_orphaned(config)
    commands = os.fdopen(os.dup(0), "rb")
    responses = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)

    memory = config["memory_limit_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))  # one huge allocation: a MemoryError, not an OOM kill
    file_size = config["max_file_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # oversized writes raise OSError instead of killing us
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    isolation = {
        "pid_namespace": pid_namespace,
        "network": "allowed" if config["allow_network"] else ("namespace" if config["namespaces"] else "socket"),
        "process_limit": "cgroup" if config["pids_cgroup"] else None,
    }
    if not config["pids_cgroup"] and os.getuid() != 0:
        # RLIMIT_NPROC counts all tasks of the uid, so allow what already runs plus the sandbox's budget.
        limit = _count_user_tasks(os.getuid()) + config["max_processes"]
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        isolation["process_limit"] = "rlimit"
    if isolation["network"] == "socket":
        _disable_sockets()
    if not config["namespaces"]:
        _drop_capabilities()

    my_pid = os.getpid()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    _write_message(responses, {"ready": True, "isolation": isolation})

    # Between cells, children that exit (e.g. forked copies still unwinding) are reaped as they go. During a cell the
    # user's own SIGCHLD disposition applies, so subprocess.run() & co. collect their children themselves.
    user_sigchld = signal.signal(signal.SIGCHLD, lambda *_: _reap_children())
    try:
        _serve(commands, responses, config, namespace, capture_fd, pid_namespace, my_pid, user_sigchld)
    except MemoryError:
        # The protocol's own work (reading the next command, ending the cell's processes) ran out of memory, not a
        # cell (its MemoryError is answered): a memory death, told by the exit code, not by the output's text.
        os._exit(EXIT_OUT_OF_MEMORY)
    os._exit(0)


def _serve(commands, responses, config, namespace, capture_fd, pid_namespace, my_pid, user_sigchld) -> None:
    limit = config["max_output_chars"]
    stdout, stderr = sys.stdout, sys.stderr
    for line in commands:
        command = json.loads(line)
        code, number = command["code"], command["n"]
        # Pre-built per command (the echoed number lets the parent tell this answer from one a cell wrote itself).
        out_of_memory = (json.dumps({"text": "MemoryError", "error_type": "MemoryError", "n": number}) + "\n").encode()
        signal.signal(signal.SIGCHLD, user_sigchld)
        # User code may have replaced sys.stdout or closed fds 1/2 in an earlier cell: re-point them every time.
        os.ftruncate(capture_fd, 0)
        os.dup2(capture_fd, 1)
        os.dup2(capture_fd, 2)
        os.lseek(1, 0, os.SEEK_SET)
        sys.stdout, sys.stderr = stdout, stderr
        error_type = error = None
        try:
            _run_cell(code, namespace)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt are the model's errors too
            error_type = type(exc).__name__
            try:
                error = "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")
            except BaseException:
                error = error_type
            if error == "MemoryError":
                error = f"MemoryError: the sandbox memory limit ({config['memory_limit_mb']} MiB) was exceeded"
            del exc
        if os.getpid() != my_pid:
            os._exit(0)  # a process forked by user code must never answer on the protocol pipe
        user_sigchld = signal.signal(signal.SIGCHLD, lambda *_: _reap_children())
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        _end_cell_processes(config, pid_namespace)
        try:
            error = _clip(error, limit // 2) if error else None
            output, total = _read_capture(capture_fd, limit - len(error or ""))
            if total > len(output):
                output += f"\n...[truncated {total - len(output)} chars]"
            text = "\n".join(part for part in (output.rstrip("\n"), error) if part)
            _write_message(responses, {"text": text, "error_type": error_type, "n": number})
        except MemoryError:
            os.write(responses, out_of_memory)


if __name__ == "__main__":
    (_launch if sys.argv[1] == "launch" else _supervise)(json.loads(sys.argv[2]))
