"""Child side of `PythonSandboxEnv`: isolation set-up, a supervisor, and the persistent interpreter loop.

`SandboxProcess` runs this file as `python -I -u -B _sandbox_child.py '<json config>'`, with stdin carrying JSON-lines
commands and stdout JSON-lines responses. It uses the standard library only and never imports `trl_agentic`, so the
child starts fast and user code sees a clean module table.

Three processes, all in the session the parent created (so the parent can `killpg` them as a last resort):

- launcher: joins the `pids` cgroup, unshares the network and pid namespaces, forks the supervisor and waits for it.
- supervisor (pid 1 of the new pid namespace): forks the interpreter, reaps orphans, reports the interpreter's death,
  and ends everything when the parent closes the command pipe (or dies). As pid 1 its exit makes the kernel kill every
  process left in the namespace, including ones that called `setsid()`. Without a pid namespace it is a child
  subreaper instead and kills the cgroup's processes and its own children until none is left.
- interpreter: redirects fds 1/2 to a capture file, applies rlimits, drops capabilities, and runs the cells.

The process budget is the `pids` cgroup the parent created (see `pids_cgroup.py`) or, for non-root users without
one, `RLIMIT_NPROC`. The network is cut by an empty network namespace or, failing that, by disabling `socket.socket`.
A private mount namespace makes the whole filesystem read-only except the working directory and a private /dev/shm.

Commands: `{"code": str}`. Responses: `{"ready": true, "isolation": {...}}` once, then one
`{"text": str, "error_type": str | null}` per command, or a final `{"dead": true, ...}` from the supervisor.
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
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
# mount_setattr(2) (Linux 5.12+) has this number in the x86_64 table and the generic one (arm64, riscv, ...) alike.
SYS_MOUNT_SETATTR = {"x86_64": 442, "aarch64": 442, "riscv64": 442}.get(os.uname().machine)
MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "out of memory")

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> bool:
    return _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), 0) == 0


def _unshare(flags: int) -> bool:
    return _libc.unshare(ctypes.c_int(flags)) == 0


def _write_file(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def _write_message(fd: int, message: dict) -> None:
    data = (json.dumps(message, ensure_ascii=False) + "\n").encode("utf-8", "replace")
    while data:
        data = data[os.write(fd, data) :]


# ----------------------------------------------------------------------------------------------------------- launcher


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _mount(source: str | None, target: str, fs_type: str | None, flags: int, data: str | None = None) -> bool:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    return _libc.mount(encode(source), encode(target), encode(fs_type), ctypes.c_ulong(flags), encode(data)) == 0


def _set_read_only(path: str, read_only: bool, recursive: bool) -> bool:
    if SYS_MOUNT_SETATTR is None:
        return False
    attr = _MountAttr(attr_set=MOUNT_ATTR_RDONLY) if read_only else _MountAttr(attr_clr=MOUNT_ATTR_RDONLY)
    flags = AT_RECURSIVE if recursive else 0
    result = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    return result == 0


def _read_only_filesystem(workdir: str, shm_mb: int) -> bool:
    """In a private mount namespace, makes every mount read-only except the sandbox's directory and a fresh /dev/shm.

    The interpreter runs as root (minus capabilities): without this it could still modify any file root owns, and
    write itself out of its cgroup.
    """
    if not _unshare(CLONE_NEWNS) or not _mount(None, "/", None, MS_REC | MS_PRIVATE):  # nothing propagates to the host
        return False
    if not _mount(workdir, workdir, None, MS_BIND):  # its own mount, so it can stay writable
        return False
    os.chdir(workdir)  # our cwd still points into the mount below the bind mount
    # multiprocessing needs a writable /dev/shm; a private tmpfs is freed with the namespace.
    shm = _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={shm_mb}m,mode=1777")
    if not _set_read_only("/", True, recursive=True):
        return False
    if not _set_read_only(workdir, False, recursive=False):
        _set_read_only("/", False, recursive=True)  # a sandbox that cannot write its own directory would not work
        return False
    if shm:
        _set_read_only("/dev/shm", False, recursive=False)
    return True


def _launch(config: dict) -> None:
    isolation = {
        "network": "allowed",
        "pid_namespace": False,
        "process_limit": None,
        "filesystem": "writable",
        "capabilities": "unchanged",
    }
    if config["cgroup"] and _write_file(os.path.join(config["cgroup"], "cgroup.procs"), str(os.getpid())):
        isolation["process_limit"] = "cgroup"

    if config["use_namespaces"] and os.geteuid() != 0:
        # Unprivileged: a user namespace grants the capabilities needed to create the other namespaces.
        uid, gid = os.getuid(), os.getgid()
        if _unshare(CLONE_NEWUSER):
            _write_file("/proc/self/setgroups", "deny")
            _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
            _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    if not config["allow_network"]:
        # A fresh network namespace has only a down loopback device: no route to anything, localhost included.
        netns = config["use_namespaces"] and _unshare(CLONE_NEWNET)
        isolation["network"] = "namespace" if netns else "socket-disabled"
    isolation["pid_namespace"] = bool(config["use_namespaces"] and _unshare(CLONE_NEWPID))
    if config["use_namespaces"] and _read_only_filesystem(config["workdir"], config["max_file_mb"]):
        isolation["filesystem"] = "read-only"  # except the working directory and /dev/shm

    if isolation["process_limit"] is None and os.getuid() != 0:
        # RLIMIT_NPROC counts all tasks of the uid, so allow what already runs plus the sandbox's budget.
        limit = _count_user_tasks(os.getuid()) + config["max_processes"] + 3
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        isolation["process_limit"] = "rlimit"

    pid = os.fork()
    if pid == 0:
        _supervise(config, isolation)
    # Only the supervisor and interpreter hold the pipes, so their death is an immediate EOF for the parent.
    os.close(0)
    os.close(1)
    _, status = os.waitpid(pid, 0)
    os._exit(min(max(os.waitstatus_to_exitcode(status), 0), 255))


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


# --------------------------------------------------------------------------------------------------------- supervisor


def _supervise(config: dict, isolation: dict) -> None:
    if not isolation["pid_namespace"]:
        # Without a pid namespace, become the reaper of orphaned user processes so they stay in our session.
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
    capture_fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o600)  # unnamed: invisible to the user's os.listdir()
    hangup_fd = os.dup(0)
    report_fd = os.dup(1)
    interpreter = os.fork()
    if interpreter == 0:
        os.close(hangup_fd)
        os.close(report_fd)
        _interpret(config, isolation, capture_fd)
    os.close(0)
    os.close(1)

    poller = select.poll()
    # Event mask 0: only POLLHUP/POLLERR, i.e. the parent closed the command pipe (or died).
    poller.register(hangup_fd, 0)
    try:
        exit_fd = os.pidfd_open(interpreter)
        poller.register(exit_fd, select.POLLIN)
    except (AttributeError, OSError):
        pass  # old kernel: the 100 ms poll timeout below still notices the exit
    while True:
        for fd, _ in poller.poll(100):
            if fd == hangup_fd:
                _end_all(isolation, config["cgroup"])
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == interpreter:
                _report_death(report_fd, capture_fd, status)
                _end_all(isolation, config["cgroup"])


def _report_death(report_fd: int, capture_fd: int, status: int) -> None:
    if os.WIFSIGNALED(status):
        how = f"was killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        how = f"exited with code {os.WEXITSTATUS(status)}"
    # A fatal error (e.g. "Fatal Python error: ... MemoryError") lands in the capture file, which is the child's fd 2.
    size = os.fstat(capture_fd).st_size
    tail = os.pread(capture_fd, 2000, max(size - 2000, 0)).decode("utf-8", "replace")
    memory = any(marker in tail for marker in MEMORY_MARKERS)
    try:
        _write_message(report_fd, {"dead": True, "how": how, "memory": memory, "detail": tail[-500:]})
    except OSError:
        pass


def _children() -> list[int]:
    # /proc/<pid>/task/<tid>/children needs CONFIG_PROC_CHILDREN, which not every kernel has: scan parent pids.
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                        children.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass  # exited meanwhile
    return children


def _cgroup_members(cgroup: str) -> list[int]:
    try:
        with open(os.path.join(cgroup, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except OSError:
        return []


def _end_all(isolation: dict, cgroup: str | None) -> None:
    if isolation["pid_namespace"]:
        os._exit(0)  # pid 1 exiting: the kernel SIGKILLs everything else in the namespace
    # No pid namespace. The cgroup lists every sandbox process at once, however deep or setsid'ed (a fork bomb dies in
    # one round); as subreaper we also inherit every orphaned descendant, so our children cover the no-cgroup case.
    # Reaping them here leaves no zombie for init to collect.
    protected = {os.getpid(), os.getppid()}
    for _ in range(1000):
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        members = _cgroup_members(cgroup) if isolation["process_limit"] == "cgroup" else []
        victims = (set(members) | set(_children())) - protected
        if not victims:
            os._exit(0)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        select.select([], [], [], 0.002)
    os.killpg(0, signal.SIGKILL)


# -------------------------------------------------------------------------------------------------------- interpreter


def _drop_capabilities() -> bool:
    # Root without capabilities cannot setns() back to the host network, mount, read other processes' memory or
    # environment, or raise rlimits again. (In a user namespace, a non-root process holds capabilities there too.)
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
    # Fallback when no network namespace could be created: best effort, Python-level only.
    import socket

    def refuse(self, *args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")

    socket.socket.__init__ = refuse


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
            pid, status = os.waitpid(-1, os.WNOHANG)
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


def _run_cell(code: str, namespace: dict) -> None:
    tree = compile(code, "<cell>", "exec", ast.PyCF_ONLY_AST)
    # Like a notebook: the value of a trailing expression is printed.
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
        if value is not None:
            print(repr(value))


def _interpret(config: dict, isolation: dict, capture_fd: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    commands = os.fdopen(os.dup(0), "rb")
    responses = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)

    memory = config["memory_limit_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_size = config["max_file_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # oversized writes raise OSError instead of killing us
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if isolation["network"] == "socket-disabled":
        _disable_sockets()
    if _drop_capabilities():
        isolation["capabilities"] = "dropped"

    my_pid = os.getpid()
    limit = config["max_output_chars"]
    stdout, stderr = sys.stdout, sys.stderr
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    # Pre-built so that an interpreter close to its memory limit can still answer.
    out_of_memory = (json.dumps({"text": "MemoryError", "error_type": "MemoryError"}) + "\n").encode()
    _write_message(responses, {"ready": True, "isolation": isolation})

    # Between cells, children that exit (e.g. forked copies still unwinding) are reaped as they go. During a cell the
    # user's own SIGCHLD disposition applies, so subprocess.run() & co. collect their children themselves.
    user_sigchld = signal.signal(signal.SIGCHLD, lambda *_: _reap_children())
    for line in commands:
        code = json.loads(line)["code"]
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
        _reap_children()
        user_sigchld = signal.signal(signal.SIGCHLD, lambda *_: _reap_children())
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        try:
            error = _clip(error, limit // 2) if error else None
            output, total = _read_capture(capture_fd, limit - len(error or ""))
            if total > len(output):
                output += f"\n...[truncated {total - len(output)} chars]"
            text = "\n".join(part for part in (output.rstrip("\n"), error) if part)
            _write_message(responses, {"text": text, "error_type": error_type})
        except MemoryError:
            os.write(responses, out_of_memory)
    os._exit(0)


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]))
