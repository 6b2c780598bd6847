"""Model-written code that attacks the machine, against both isolation policies (docs/reliability.md has the table).

Every attack must be contained, reach the model as a model error (a `ToolCallError` subclass raised by the tool) or
as an output that states the failure, leave the trainer untouched, and leave an environment that restores
(`_checkpoint` / `_restore`) and keeps working. "required" is full isolation (bubblewrap + cgroups); "best_effort" is
the fallback of a machine without bubblewrap (simulated), where some attacks are only partly contained: those tests
assert exactly the documented gap, and that the start-up warning names it.
"""

import os
import signal
import socket
import subprocess
import threading
import time

import pytest
from rollout_helpers import ScriptBackend, call, run_tools_loop
from sandbox_helpers import POLICIES, EnvFactory, SandboxProcesses, time_limit

from trl_agentic.envs.errors import CodeError, SandboxError, SandboxMemoryError, SandboxRestoreError, SandboxTimeout
from trl_agentic.errors import InfrastructureError, ToolCallError
from trl_agentic.rollout.loop import LoopConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=list(POLICIES))
def policy(request):
    return request.param


@pytest.fixture
def make_env(policy):
    factory = EnvFactory(**POLICIES[policy])
    yield factory
    factory.close()


@pytest.fixture
def make_required_env():
    """For attacks that only full isolation contains: without bubblewrap they would really hit this machine (fill
    its disk, write into the checkout, signal every process of the uid). The best-effort warning names these gaps
    (`test_python_sandbox.py::test_best_effort_policy_warns_once_naming_the_absent_protection`)."""
    factory = EnvFactory(**POLICIES["required"])
    yield factory
    factory.close()


def attack(env, code: str) -> tuple[str, ToolCallError | None]:
    """Runs a cell; returns (output, None) or (message, the model error). Anything else (an infrastructure error, a
    crash of the trainer) fails the test."""
    try:
        return env.python(code), None
    except ToolCallError as exc:
        assert not isinstance(exc, InfrastructureError)
        return str(exc), exc


def assert_restores_and_works(env):
    """The env keeps its episode state across the attack, and a checkpoint taken before restores."""
    assert env.python("state") == "'before'"
    checkpoint = env._checkpoint()
    env.python("state = 'after'")
    env._restore(checkpoint)
    assert env.python("state") == "'before'"


def start(env) -> SandboxProcesses:
    env.python("import os, subprocess, sys, time\nstate = 'before'")
    processes = SandboxProcesses(env)
    assert len(processes.live()) == processes.own
    return processes


@pytest.fixture
def listener():
    """A TCP server on the host's loopback that must never see a connection from the sandbox."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    yield server
    server.close()


def accepted(server) -> bool:
    try:
        connection, _ = server.accept()
    except TimeoutError:
        return False
    connection.close()
    return True


# ------------------------------------------------------------------------------------------------------- processes


def test_fork_bomb_hits_the_process_limit(make_env):
    env = make_env(max_processes=16)
    processes = start(env)
    text, error = attack(env, "while True:\n    os.fork()")
    assert isinstance(error, CodeError) and error.error_type == "BlockingIOError", text  # fork fails past pids.max
    assert len(processes.settle(processes.own)) == processes.own  # every copy is gone with the cell
    assert_restores_and_works(env)


def test_persistent_fork_bomb_that_leaves_its_session_is_stopped(make_env):
    # Children leave the session with setsid() and ignore fork failures: only the time limit stops this one.
    env = make_env(timeout=60.0, max_processes=16)
    processes = start(env)
    peak = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak.append(len(processes.cgroup.pids()))
            done.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        code = "while True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n    except OSError:\n        pass"
        # Nothing but the limit ends this cell; 3 s leaves the bomb time to fill its budget on a loaded machine.
        with time_limit(env, 3.0):
            text, error = attack(env, code)
    finally:
        done.set()
        watcher.join()
    assert isinstance(error, SandboxTimeout), text
    assert 5 < max(peak) <= 16 + 3  # the bomb really ran, within the cgroup's budget
    assert processes.settle(0) == set()
    assert_restores_and_works(env)


# A classic daemon: double fork, new session; its pid is left in `daemon`.
DAEMON_CELL = (
    "r, w = os.pipe()\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        os.write(w, str(os.getpid()).encode())\n"
    "        time.sleep(600)\n"
    "    os._exit(0)\n"
    "daemon = int(os.read(r, 32))\n"
    "print('started')"
)


def test_background_processes_do_not_outlive_their_cell(make_env):
    env = make_env()
    processes = start(env)
    code = "server = subprocess.Popen(['sleep', '600'], start_new_session=True)\n" + DAEMON_CELL
    assert env.python(code) == "started"
    assert len(processes.settle(processes.own)) == processes.own  # from the host: only the sandbox's own processes
    for name in ("server.pid", "daemon"):
        error = attack(env, f"os.kill({name}, 0)")[1]
        assert isinstance(error, CodeError) and error.error_type == "ProcessLookupError"
    assert_restores_and_works(env)


def supervisor_pid(env) -> int:
    """Host pid of the sandbox's supervisor: the launcher itself, or bubblewrap's monitor's one child."""
    launcher = env._process.pid
    if not env._process.namespaces:
        return launcher
    with open(f"/proc/{launcher}/task/{launcher}/children") as f:
        (child,) = f.read().split()
    return int(child)


def test_a_cell_returns_only_once_its_daemons_are_reaped(make_env):
    """A killed daemon is the supervisor's zombie (its subreaper, or pid 1) until reaped, and a zombie's pid still
    answers `os.kill(pid, 0)`: the cell must wait for the reaping, or the next cell sees the daemon as alive (a flaky
    CI failure of the test above). The supervisor is stopped for 0.2 s to make its reaping late for sure (the next cell
    would run within milliseconds; in a pid namespace the cell's cleanup waits about 1 s for the reaping)."""
    env = make_env()
    start(env)
    supervisor = supervisor_pid(env)
    os.kill(supervisor, signal.SIGSTOP)
    resume = threading.Timer(0.2, os.kill, (supervisor, signal.SIGCONT))
    resume.start()
    try:
        assert env.python(DAEMON_CELL) == "started"
        error = attack(env, "os.kill(daemon, 0)")[1]
    finally:
        resume.cancel()
        os.kill(supervisor, signal.SIGCONT)
    assert isinstance(error, CodeError) and error.error_type == "ProcessLookupError"
    assert_restores_and_works(env)


def test_a_process_whose_main_thread_exited_does_not_outlive_its_cell(make_env):
    """Its leader shows "Z" in /proc while a thread still runs: a cleanup that skips zombies would leave it alive."""
    env = make_env()
    processes = start(env)
    code = (
        "import ctypes, threading\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.setsid()\n"
        "    threading.Thread(target=time.sleep, args=(600,)).start()\n"
        "    os.write(w, b'x')\n"
        "    ctypes.CDLL(None).pthread_exit(None)\n"
        "os.read(r, 1)\n"
        "while open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z':\n"
        "    time.sleep(0.01)\n"
        "status = open(f'/proc/{pid}/status').read()\n"
        "print([line for line in status.splitlines() if line.startswith('Threads:')][0].split()[1])"
    )
    assert env.python(code) == "2"  # the leader is "Z", and a thread of its group still runs (a plain zombie: 1)
    assert len(processes.settle(processes.own)) == processes.own
    assert_restores_and_works(env)


def test_cleanup_waits_for_the_zombies_a_sandbox_process_will_reap_and_kills_what_still_runs(monkeypatch):
    """`_sandbox_members` on a made-up process table (pid -> parent, session, dead): the cleanup's rule without
    /proc's timing. Roots: the supervisor 10 (the sandbox's session) and the interpreter 11."""
    from trl_agentic.envs import _sandbox_child as child

    table = {
        10: (1, 10, False),  # supervisor
        11: (10, 10, False),  # interpreter
        12: (11, 10, False),  # a live child: killed
        13: (10, 99, True),  # a setsid'ed orphan's zombie, the supervisor's to reap: waited for
        14: (11, 10, True),  # the interpreter's zombie: waited for (reaped by `reap`)
        15: (1, 10, True),  # a zombie of the session reparented outside (no subreaper): nobody here reaps it
        16: (1, 10, False),  # a zombie leader whose threads still run (not dead), reparented outside: killed
        20: (1, 20, False),  # the host: not the sandbox's
    }
    monkeypatch.setattr(child, "_process_table", lambda: table)
    config = {"cgroup_procs": [], "session": 10}
    assert child._sandbox_members(config, {10, 11}) == {12: False, 13: True, 14: True, 16: False}
    killed = []
    monkeypatch.setattr(child.os, "kill", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(child.select, "select", lambda *args: None)
    assert child._kill_until_gone(config, {10, 11}, reap=lambda: None) is False  # the table never changes
    assert set(killed) == {12, 16}  # the dead are waited for, never signalled


def test_cpu_of_all_processes_is_capped(make_env):
    env = make_env(max_cpus=0.2)
    processes = start(env)
    # Two busy processes for 0.5 s of wall time; they can get at most 0.2 core between them.
    code = (
        "start, cpu = time.monotonic(), os.times()\n"
        "pids = [os.fork() for _ in range(2)]\n"
        "if 0 in pids:\n"
        "    while time.monotonic() - start < 0.5:\n"
        "        pass\n"
        "    os._exit(0)\n"
        "for pid in pids:\n"
        "    os.waitpid(pid, 0)\n"
        "now = os.times()\n"
        "used = now.children_user + now.children_system + now.user + now.system - cpu.user - cpu.system\n"
        "print(round(used, 3), round(time.monotonic() - start, 3))"
    )
    used, wall = map(float, env.python(code).split())
    # The quota is 20 ms per 100 ms period; one period of slack for the accounting granularity.
    assert 0 < used <= 0.2 * wall + 0.1
    path, _ = processes.cgroup.dirs["cpu"]
    with open(os.path.join(path, "cpu.stat")) as f:
        stats = dict(line.split() for line in f)
    assert int(stats["nr_throttled"]) > 0
    assert_restores_and_works(env)


# ----------------------------------------------------------------------------------------------------------- memory


def test_memory_bomb_across_many_processes_is_stopped(make_env):
    # Each process stays under its own address-space limit; together they are far over the cell's limit.
    env = make_env(memory_limit_mb=128, max_disk_mb=8, max_file_mb=4, timeout=30)
    processes = start(env)
    code = (
        "pids = []\n"
        "for _ in range(8):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'\\x01' * (60 << 20)\n"  # touched: really resident
        "        time.sleep(3)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print([os.waitpid(pid, 0)[1] for pid in pids])"
    )
    text, error = attack(env, code)
    assert isinstance(error, SandboxMemoryError), text
    assert "memory limit (128 MiB for all its processes together)" in text
    # Closed with the cell (it is not recorded, so its effects go too), nothing of it left; the episode restarts.
    assert processes.settle(0) == set()
    assert_restores_and_works(env)


def test_a_cell_whose_child_was_killed_for_memory_leaves_no_state_behind(make_env):
    """The cell itself ran to its end, but one of its processes was killed over the memory limit: a
    `SandboxMemoryError`, so the cell is not recorded for replay. Its effects stayed in the running interpreter (`x`),
    so a later restore, replaying the recorded cells, diverged (`SandboxRestoreError`). The interpreter is closed
    now: the episode goes on without the cell, and restores."""
    env = make_env(memory_limit_mb=128, max_disk_mb=8, max_file_mb=4, timeout=30)
    start(env)
    code = (
        "x = 42\n"
        "hog = 'import time\\nb = bytearray(100 << 20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\ntime.sleep(2)'\n"
        "procs = [subprocess.Popen([sys.executable, '-c', hog]) for _ in range(3)]\n"
        "print([p.wait() for p in procs])"
    )
    text, error = attack(env, code)
    assert isinstance(error, SandboxMemoryError), text
    assert "NameError" in attack(env, "x")[0]
    assert_restores_and_works(env)


@pytest.mark.timeout(120)  # the defect was a hang: past this, the test fails instead of blocking the suite
def test_a_large_cell_sent_to_an_interpreter_that_does_not_read_times_out(make_env):
    """The command pipe holds 64 KiB. A cell's thread stopped its own process after the call returned, so the next
    call's 200 KB command could not be written: the write blocked forever, past the time limit (and `close` behind
    it). The write has the cell's deadline now."""
    env = make_env(timeout=30)
    start(env)
    env.python(
        "import threading\nthreading.Thread(target=lambda: (time.sleep(0.5), os.kill(os.getpid(), 19))).start()"
    )
    time.sleep(1.5)  # the interpreter is stopped (SIGSTOP) by now
    big = "data = " + repr("x" * 200_000) + "\nlen(data)"
    with time_limit(env, 3.0):
        text, error = attack(env, big)
    assert isinstance(error, SandboxTimeout), text
    env.reset()
    assert env.python("1 + 1") == "2"


def test_a_sandbox_starts_and_runs_past_file_descriptor_1024(make_env):
    """A trainer with many open files gives a new sandbox descriptors past 1024, which `select` refused with a bare
    `ValueError` (neither a model nor an infrastructure error). `poll` has no such limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) > 1024
        env = make_env()
        assert env.python("print(6 * 7)") == "42"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_process_forked_from_the_trainer_does_not_hold_a_sandboxs_command_pipe(make_env):
    """A DataLoader or `multiprocessing` worker forked after a sandbox started inherited the write end of its command
    pipe, so closing the sandbox never saw the hang-up: every reset waited 2 s and fell back to SIGKILL. In a fork,
    the pipe's descriptor now points to /dev/null."""
    import multiprocessing

    env = make_env()
    start(env)
    fd = env._process._popen.stdin.fileno()
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while os.readlink(f"/proc/{worker.pid}/fd/{fd}").startswith("pipe:") and time.monotonic() < deadline:
            time.sleep(0.01)  # the fork hook runs as the worker starts
        assert os.readlink(f"/proc/{worker.pid}/fd/{fd}") == os.devnull
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")  # the trainer's own is untouched
        assert env.python("state") == "'before'"
    finally:
        worker.kill()
        worker.join()


_RESPONSE_PIPE = (
    "import stat\n"
    "def _fifo(n):\n"
    "    try:\n"
    "        return stat.S_ISFIFO(os.fstat(n).st_mode)\n"
    "    except OSError:\n"
    "        return False\n"
    "fd = max(int(n) for n in os.listdir('/proc/self/fd') if n.isdigit() and _fifo(int(n)))\n"
)


@pytest.mark.parametrize(
    "forged",
    [
        b"[1]\n",
        b"{}\n",
        b'{"dead": true}\n',
        b'{"text": 5, "error_type": null, "n": 2}\n',
        b'{"text": "x", "error_type": null}\n',
        b"[" * 60000 + b"\n",  # deeper than the JSON parser goes: a bare RecursionError, one answer behind after
    ],
    ids=lambda forged: repr(forged[:24]),
)
def test_a_message_a_cell_writes_to_the_protocol_pipe_is_not_an_answer(make_env, forged):
    """A cell can write to the interpreter's response pipe. Another shape escaped as a bare `KeyError` &c.; a
    well-formed extra line was taken for the answer, and every later call got the answer of the call before. Each
    answer now echoes its command's number: anything else ends the interpreter, a model error, and the episode
    goes on with its own answers."""
    env = make_env()
    start(env)
    text, error = attack(env, _RESPONSE_PIPE + f"os.write(fd, {forged!r})")
    assert isinstance(error, SandboxError), text
    assert [env.python(f"print({c!r})") for c in "AB"] == ["A", "B"]
    assert_restores_and_works(env)


_PTRACE = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.ptrace.restype = ctypes.c_long\n"
    "libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]\n"
)


def test_the_supervisor_cannot_be_traced(make_env, policy):
    """The supervisor (the namespace's pid 1 under bubblewrap) has the cells' uid and holds the host capture file: a
    cell that could ptrace it or write its memory could run any system call in it (write past `max_file_mb` into the
    host's /tmp, exit with the launcher's cgroup-failure code, which is an infrastructure error and kept the rollout
    out of the loss). It is not dumpable, so both need a capability the cells lack."""
    env = make_env()
    start(env)
    code = _PTRACE + (
        "parent = os.getppid()\n"
        "attached = libc.ptrace(16, parent, None, None)\n"  # PTRACE_ATTACH
        "errno = ctypes.get_errno()\n"
        "try:\n"
        "    open(f'/proc/{parent}/mem', 'r+b').close()\n"
        "    mem = 'opened'\n"
        "except OSError as e:\n"
        "    mem = type(e).__name__\n"
        "print(parent if policy == 'required' else 'supervisor', attached, errno, mem)"
    )
    text, error = attack(env, f"policy = {policy!r}\n" + code)
    assert error is None, text
    assert text == f"{1 if policy == 'required' else 'supervisor'} -1 1 PermissionError"  # EPERM both ways
    # The interpreter itself stays dumpable: its own children can still read its /proc files.
    assert attack(env, "subprocess.run(['cat', f'/proc/{os.getpid()}/environ'], capture_output=True).returncode") == (
        "0",
        None,
    )
    assert_restores_and_works(env)


_LEAVE_CGROUPS = """
for line in open('/proc/self/cgroup'):
    _, controllers, path = line.strip().split(':', 2)
    for controller in filter(None, controllers.split(',')) if 'trl_agentic_sandbox_' in path else ():
        try:
            with open(f'/sys/fs/cgroup/{controller}{os.path.dirname(path)}/cgroup.procs', 'w') as f:
                f.write(str(os.getpid()))
        except OSError:
            pass
print(sum('trl_agentic_sandbox_' in line for line in open('/proc/self/cgroup')))
"""


def test_a_cell_that_moves_itself_out_of_its_cgroups(make_env, policy):
    """Under bubblewrap no cgroup file is visible inside. Without it (best_effort) the cells run with the trainer's
    uid, which owns the cgroup tree: the code can leave its memory, pids and cpu cgroups. A documented gap, named by
    the best-effort warning (`PROTECTS["bwrap"]`)."""
    from trl_agentic.envs.sandbox_isolation import PROTECTS

    env = make_env()
    start(env)
    inside = attack(env, "sum('trl_agentic_sandbox_' in line for line in open('/proc/self/cgroup'))")[0]
    text, error = attack(env, _LEAVE_CGROUPS)
    assert error is None, text
    if policy == "required":
        assert text == inside  # still in every one
    else:
        assert (
            int(inside) > 0
            and text == "0"
            and "move itself out of its memory, pids and cpu cgroups" in PROTECTS["bwrap"]
        )
    os.kill(os.getpid(), 0)


# ------------------------------------------------------------------------------------------------------------- disk


def test_disk_fill_stops_at_the_sandbox_size(make_required_env):
    env = make_required_env(max_disk_mb=16, max_file_mb=4)
    start(env)
    code = (
        "i = 0\nwhile True:\n    with open(f'fill{i // 4}', 'ab') as f:\n        f.write(b'x' * (1 << 20))\n    i += 1"
    )
    text, error = attack(env, code)
    assert isinstance(error, CodeError) and error.error_type == "OSError" and "[Errno 28] No space left" in text
    assert env.python("i") in ("15", "16")  # 16 MiB fit, minus what the filesystem keeps for itself
    assert env.python("import shutil\nfor f in os.listdir('.'):\n    os.remove(f)\nshutil.disk_usage('.').used") == "0"
    assert_restores_and_works(env)


def test_inode_fill_is_bounded(make_required_env):
    env = make_required_env(memory_limit_mb=64, max_disk_mb=8, max_file_mb=4, timeout=3)
    processes = start(env)
    text, error = attack(env, "n = 0\nwhile True:\n    open(f'f{n}', 'w').close()\n    n += 1")
    # Each file is kernel memory charged to the sandbox's memory cgroup: the kernel stops it, or the time limit does.
    assert isinstance(error, (SandboxMemoryError, SandboxTimeout, CodeError)), text
    if isinstance(error, CodeError):
        assert error.error_type == "OSError", text
    expected = processes.own if env._process.alive else 0  # the sandbox is closed when its interpreter was killed
    assert len(processes.settle(expected)) == expected
    assert_restores_and_works(env)
    assert env.python("len(os.listdir('.'))") == "0"  # the restored episode has a fresh directory


# ---------------------------------------------------------------------------------------------------------- network


def test_raw_socket_module_cannot_reach_the_host(make_env, policy, listener):
    env = make_env()
    start(env)
    port = listener.getsockname()[1]
    code = (
        f"import _socket\ns = _socket.socket()\ns.settimeout(5)\ns.connect(('127.0.0.1', {port}))\nprint('connected')"
    )
    text, error = attack(env, code)
    if policy == "required":
        # Its own network namespace: a loopback of its own (nobody listens there) and no other interface.
        assert isinstance(error, CodeError) and error.error_type == "ConnectionRefusedError", text
        assert not accepted(listener)
        assert env.python("import socket\n[name for _, name in socket.if_nameindex()]") == "['lo']"
    else:  # documented gap: the socket block is Python-level only
        assert text == "connected" and accepted(listener)
    assert_restores_and_works(env)


def test_subprocess_network_clients_cannot_reach_the_host(make_env, policy, listener):
    env = make_env(timeout=60)
    start(env)
    port = listener.getsockname()[1]
    client = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5); print('connected')"
    code = (
        f"py = subprocess.run([sys.executable, '-c', {client!r}], capture_output=True, text=True)\n"
        f"curl = subprocess.run(['curl', '-sS', '-m', '2', 'http://127.0.0.1:{port}/'], capture_output=True, text=True)\n"
        "print(py.returncode, py.stdout.strip(), curl.returncode)"
    )
    text, error = attack(env, code)
    assert error is None
    if policy == "required":
        assert text == "1  7" and not accepted(listener)  # Python: ConnectionRefusedError; curl: "couldn't connect"
    else:  # documented gap: a subprocess has its own, unpatched socket module
        assert text.startswith("0 connected") and accepted(listener)
    assert_restores_and_works(env)


# ---------------------------------------------------------------------------------------------------------- signals


def test_killing_the_parent_does_not_reach_the_trainer(make_env, policy):
    env = make_env()
    start(env)
    if policy == "required":
        # The parent is the sandbox's pid 1, which ignores signals from inside its namespace.
        text, error = attack(env, "os.kill(os.getppid(), 9)\nos.getppid()")
        assert (text, error) == ("1", None)
    else:
        # The parent is the sandbox's supervisor; the interpreter dies with it (PR_SET_PDEATHSIG). The trainer is not
        # its parent. kill() returns before its target is dead, so the cell waits for the supervisor to be gone:
        # without the wait the cell's output can race out before the death (seen once in CI). If the interpreter
        # survived its supervisor, the loop ends and the new parent's pid comes back as the text.
        code = "parent = os.getppid()\nos.kill(parent, 9)\nwhile os.getppid() == parent:\n    time.sleep(0.01)\nos.getppid()"
        text, error = attack(env, code)
        assert isinstance(error, SandboxError), text
    os.kill(os.getpid(), 0)  # we, the trainer, are alive
    assert_restores_and_works(env)


def test_signals_to_host_processes(make_env, policy):
    victim = subprocess.Popen(["sleep", "600"])
    try:
        env = make_env()
        start(env)
        text, error = attack(env, f"os.kill({victim.pid}, {int(signal.SIGTERM)})\nos.kill({os.getpid()}, 0)")
        if policy == "required":
            # Host pids do not exist in the sandbox's pid namespace.
            assert isinstance(error, CodeError) and error.error_type == "ProcessLookupError", text
            assert victim.poll() is None
        else:  # documented gap: without a pid namespace a same-uid process can be signalled
            assert error is None and victim.wait(timeout=60) == -signal.SIGTERM
        if policy == "required":  # (without a pid namespace this would signal every process of the uid)
            code = "p = subprocess.Popen(['sleep', '60'])\nos.kill(-1, 9)\np.wait()"
            assert attack(env, code) == ("-9", None)  # only its own processes: pid 1 and itself are spared
        os.kill(os.getpid(), 0)
        if policy == "required":
            assert_restores_and_works(env)
        else:
            # The cell signalled a host process, which is gone: its replay ends otherwise (ProcessLookupError), so a
            # restore stops there as the model's error and keeps the cells before it.
            assert env.python("state") == "'before'"
            env._restore(env._checkpoint())
            with pytest.raises(SandboxRestoreError, match="raised ProcessLookupError where it had succeeded"):
                env.python("state")
            assert env.python("state") == "'before'"
    finally:
        victim.kill()
        victim.wait()


# ------------------------------------------------------------------------------------------------------- filesystem


def test_writes_into_the_checkout_and_home_fail(make_required_env):
    env = make_required_env()
    start(env)
    home = os.path.expanduser("~")
    targets = [os.path.join(REPO, "sandbox_probe.txt"), os.path.join(REPO, "trl_agentic", "__init__.py")]
    targets += [os.path.join(home, "sandbox_probe.txt"), os.path.join(home, ".bashrc")]
    before = {path: os.stat(path).st_mtime_ns for path in targets if os.path.exists(path)}
    try:
        for path in targets:
            text, error = attack(env, f"open({path!r}, 'a').write('pwned')")
            assert isinstance(error, CodeError), text
            assert error.error_type in ("OSError", "FileNotFoundError", "PermissionError"), text
        text, error = attack(
            env, f"subprocess.run(['touch', {targets[0]!r}, {targets[2]!r}], capture_output=True).returncode"
        )
        assert error is None and text == "1"
        # Nor can it read them: nothing of the checkout is in the sandbox (when the venv lives inside the checkout, as
        # `make install` puts it, its read-only mount makes an otherwise empty directory of the checkout's path).
        readme, source = os.path.join(REPO, "README.md"), os.path.join(REPO, "trl_agentic", "__init__.py")
        probe = f"os.path.exists({readme!r}), os.path.exists({source!r}), os.path.exists('/etc/shadow')"
        assert env.python(probe) == "(False, False, False)"
        visible = env.python(f"sorted(os.listdir({REPO!r})) if os.path.isdir({REPO!r}) else []")
        assert visible in ("[]", "['.venv']"), visible
    finally:
        created = [path for path in targets if os.path.exists(path) and path not in before]
        for path in created:
            os.remove(path)
    assert created == []
    assert {path: os.stat(path).st_mtime_ns for path in before} == before
    assert_restores_and_works(env)


def test_trainer_environment_variables_do_not_leak(make_env, monkeypatch):
    monkeypatch.setenv("TRL_AGENTIC_TEST_SECRET", "hunter2-secret-value")
    # A process whose /proc/<pid>/environ holds the secret (ours only shows the environment we were started with).
    victim = subprocess.Popen(["sleep", "600"])
    try:
        env = make_env()
        start(env)
        assert env.python("print(os.environ.get('TRL_AGENTIC_TEST_SECRET'))") == "None"
        assert env.python("sorted(set(os.environ) - {'PWD'})") == repr(
            sorted(
                ["HOME", "LANG", "LC_ALL", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PATH"]
                + ["PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "PYTHONIOENCODING", "PYTHONUNBUFFERED", "TMPDIR"]
            )
        )
        scan = (
            "found = []\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n"
            "        found.append(b'hunter2-secret-value' in open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except OSError:\n"
            "        pass\n"
            "any(found)"
        )
        assert env.python(scan) == "False"
        assert env.python("subprocess.run(['env'], capture_output=True).stdout.count(b'hunter2')") == "0"
        with open(f"/proc/{victim.pid}/environ", "rb") as f:
            assert b"hunter2-secret-value" in f.read()  # it was there to be found
        assert_restores_and_works(env)
    finally:
        victim.kill()
        victim.wait()


# ------------------------------------------------------------------------------------------------ training continues


def test_rollout_loop_goes_on_after_attacks(tiny_tokenizer, policy):
    """The env driven by the real rollout loop: each attack reaches the model as a tool message, the trajectory
    continues, and the state of the episode is intact at the end."""
    factory = EnvFactory(**POLICIES[policy], timeout=60.0, max_processes=16)
    env = factory()
    spin = "while True:\n    pass"

    def python(code: str) -> str:
        # Only the endless cell runs under the short limit; the others (and the replays) under the generous one.
        with time_limit(env, 1.0 if code == spin else env.timeout):
            return env.python(code)

    try:
        turns = [
            call("python", code="while True:\n    import os; os.fork()"),
            call("python", code=spin),
            call("python", code="import os\nos._exit(3)"),
            call("python", code="print(x + 1)"),
        ]
        backend = ScriptBackend(tiny_tokenizer, [[turn] for turn in turns[1:]] + [["done<|im_end|>"]])
        # The sandbox's failures are model errors (trl_agentic.errors): shown to the model, the rollout goes on.
        config = LoopConfig(rollback_on_errors=[], tool_timeout=0.0)
        env.python("x = 41")
        _, _, trl_tuple, result = run_tools_loop(backend, [turns[0]], [{"python": python}], config, envs=[env])
        messages = trl_tuple[1][0]
        tool_contents = [m["content"] for m in messages if m["role"] == "tool"]
        assert len(tool_contents) == 4
        assert "BlockingIOError" in tool_contents[0]
        assert "exceeded its time limit (1 s)" in tool_contents[1]
        assert "exited with code 3" in tool_contents[2]
        assert tool_contents[3] == "42"  # the state survived all three
        assert result.infra_failed == [False]
        assert messages[-1]["role"] == "assistant" and messages[-1]["content"] == "done"
    finally:
        factory.close()
