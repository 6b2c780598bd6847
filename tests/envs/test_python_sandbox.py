"""`PythonSandboxEnv` against real sandbox subprocesses: state, errors, limits, isolation and cleanup."""

import gc
import os
import socket
import subprocess
import threading
import time

import pytest

from trl_agentic.envs.errors import SandboxCrashed, SandboxInfraError, SandboxMemoryError, SandboxTimeout
from trl_agentic.envs.python_sandbox import PythonSandboxEnv


@pytest.fixture
def make_env():
    """Builds sandbox envs and closes them after the test, even when it fails."""
    envs = []

    def make(**kwargs) -> PythonSandboxEnv:
        env = PythonSandboxEnv(**kwargs)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env._close()


class SandboxProcesses:
    """Finds every process (zombies included) belonging to one sandbox, however it got there.

    A process belongs to the sandbox if it is in its session, in its pid namespace, in its cgroup, or runs with the
    sandbox's working directory as command-line marker or cwd (a user subprocess that called `setsid()`).
    """

    def __init__(self, env: PythonSandboxEnv):
        process = env._process
        assert process is not None, "start the interpreter first"
        self.session = process.pid
        self.workdir = process.workdir
        self.cgroup = process.cgroup
        namespace = os.readlink(f"/proc/{process.pid}/ns/pid_for_children")
        self.pid_namespace = None if namespace == os.readlink("/proc/self/ns/pid") else namespace

    def _belongs(self, pid: str) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                session = int(f.read().rsplit(")", 1)[1].split()[3])
            if session == self.session:
                return True
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if self.workdir.encode() in f.read():
                    return True
            if os.readlink(f"/proc/{pid}/cwd").startswith(self.workdir):
                return True
            return self.pid_namespace is not None and os.readlink(f"/proc/{pid}/ns/pid") == self.pid_namespace
        except (OSError, IndexError):
            return False  # exited while we looked

    def live(self) -> set[int]:
        found = {int(pid) for pid in os.listdir("/proc") if pid.isdigit() and self._belongs(pid)}
        if self.cgroup is not None:
            try:
                with open(os.path.join(self.cgroup, "cgroup.procs")) as f:
                    found |= {int(line) for line in f if line.strip()}
            except FileNotFoundError:
                pass  # removed with the sandbox
        return found

    def settle(self, expected: int, timeout: float = 2.0) -> set[int]:
        """Polls until exactly `expected` processes remain (zombies take a moment to be reaped)."""
        deadline = time.monotonic() + timeout
        while True:
            live = self.live()
            if len(live) == expected or time.monotonic() > deadline:
                return live
            time.sleep(0.02)


def test_state_persists_and_outputs_are_captured(make_env):
    env = make_env()
    assert env.reset(question="ignored") is None
    assert env.python("x = 20\nprint('hello')\nimport sys\nprint('warning', file=sys.stderr)") == "hello\nwarning"
    assert env.last_error_type is None
    assert env.python("x + 1") == "21"  # a trailing expression is displayed, as in a notebook
    assert env.python("y = x * 2") == "(no output)"
    assert env.python("def f(a):\n    return a + y\nf(2)") == "42"
    assert env.python("import subprocess; subprocess.run(['echo', 'from a child process'])") == (
        "from a child process\nCompletedProcess(args=['echo', 'from a child process'], returncode=0)"
    )
    assert env.python("input()") == "EOFError: EOF when reading a line"  # stdin is /dev/null, not the protocol pipe


def test_exited_children_are_reaped_without_breaking_popen(make_env):
    env = make_env()
    env.python("import os, subprocess, time\np = subprocess.Popen(['sh', '-c', 'exit 7'])")
    time.sleep(0.3)  # it exits between cells, where the sandbox reaps children (zombies count against the budget)
    assert env.python("p.poll(), p.wait()") == "(7, 7)"  # the reaper handed the real exit code to the Popen
    assert env.python("pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)[0] == pid") == "True"


def test_model_errors_are_returned_as_text(make_env):
    env = make_env()
    assert env.python("print(x)") == "NameError: name 'x' is not defined"
    assert env.last_error_type == "NameError"

    text = env.python("print('before')\nx = = 1")
    assert text.endswith("SyntaxError: invalid syntax") and "before" not in text  # nothing ran
    assert env.last_error_type == "SyntaxError"

    assert env.python("print('partial')\n1 / 0") == "partial\nZeroDivisionError: division by zero"
    assert env.last_error_type == "ZeroDivisionError"
    assert env.python("raise SystemExit(3)") == "SystemExit: 3"  # does not end the interpreter
    assert env.python("import os\nos.getpid()") == "2"  # the same interpreter (pid 2 in its own pid namespace)
    assert env.last_error_type is None


def test_timeout_kills_an_infinite_loop_in_time(make_env):
    env = make_env(timeout=1.0)
    env.python("x = 41")
    processes = SandboxProcesses(env)
    assert len(processes.live()) == 3  # launcher, supervisor, interpreter
    start = time.monotonic()
    with pytest.raises(SandboxTimeout) as info:
        env.python("while True:\n    pass")
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 2.0
    assert str(info.value) == "SandboxTimeout: execution exceeded 1.0 s"
    assert isinstance(info.value, SandboxInfraError) and isinstance(info.value, RuntimeError)
    assert env.last_error_type == "SandboxTimeout"
    assert processes.settle(0) == set()
    assert not os.path.exists(processes.workdir)
    # A new interpreter replays the cells that succeeded: the episode state survives the timeout.
    assert env.python("x + 1") == "42"


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_fork_bomb_is_stopped_without_stray_processes(make_env, use_namespaces):
    env = make_env(timeout=1.0, max_processes=16, use_namespaces=use_namespaces)
    env.python("import os")
    processes = SandboxProcesses(env)
    assert len(processes.live()) == 3  # before: launcher, supervisor, interpreter
    assert env.isolation["pid_namespace"] is use_namespaces
    limited = env.isolation["process_limit"] is not None

    start = time.monotonic()
    try:
        text = env.python("while True:\n    os.fork()")
        assert env.last_error_type == "BlockingIOError", text  # fork fails once the process budget is used up
    except SandboxTimeout:
        assert not limited  # without a process limit only the timeout stops it
    assert time.monotonic() - start < 1.0 + 1.0
    if limited:
        assert len(processes.settle(3)) == 3  # every forked copy exited; only the sandbox's own processes are left
        assert env.python("os.getpid() > 0") == "True"
    env._close()
    assert processes.settle(0) == set()


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_persistent_fork_bomb_that_escapes_its_session_is_killed(make_env, use_namespaces):
    # Children leave the session with setsid() and ignore fork failures: only the timeout can stop this one.
    env = make_env(timeout=1.0, max_processes=16, use_namespaces=use_namespaces)
    env.python("import os")
    processes = SandboxProcesses(env)
    assert processes.cgroup is not None, "this test measures the bomb through its cgroup"
    peak = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                with open(os.path.join(processes.cgroup, "cgroup.procs")) as f:
                    peak.append(sum(1 for _ in f))
            except FileNotFoundError:
                return  # the timeout already removed the sandbox and its cgroup
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        with pytest.raises(SandboxTimeout):
            env.python(
                "while True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n    except OSError:\n        pass"
            )
    finally:
        done.set()
        watcher.join()
    assert time.monotonic() - start < 1.0 + 1.0
    assert 5 < max(peak) <= 16 + 3  # the bomb really ran, within the cgroup's budget
    assert processes.settle(0) == set()


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_network_is_blocked(make_env, use_namespaces):
    env = make_env(use_namespaces=use_namespaces)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        text = env.python(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
        with pytest.raises(TimeoutError):
            listener.accept()
    assert "connected" not in text
    assert env.last_error_type in ("OSError", "PermissionError"), text
    expected = "Network is unreachable" if use_namespaces else "network access is disabled"
    assert expected in text
    assert env.isolation["network"] == ("namespace" if use_namespaces else "socket-disabled")


def test_network_can_be_allowed(make_env):
    # The positive control for `test_network_is_blocked`: the same connection works when allowed.
    env = make_env(allow_network=True)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(5)
        port = listener.getsockname()[1]
        text = env.python(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
        connection, _ = listener.accept()
        connection.close()
    assert text == "connected"
    assert env.isolation["network"] == "allowed"


def test_environment_variables_are_not_inherited(make_env, monkeypatch):
    monkeypatch.setenv("TRL_AGENTIC_TEST_SECRET", "hunter2-secret-value")
    # A process whose /proc/<pid>/environ holds the secret (ours only shows the environment we were started with).
    victim = subprocess.Popen(["sleep", "30"])
    env = make_env()
    assert env.python("import os\nprint(os.environ.get('TRL_AGENTIC_TEST_SECRET'))") == "None"
    assert env.python("os.environ['HOME'] == os.getcwd() == os.environ['TMPDIR']") == "True"
    assert env.python("'PATH' in os.environ and 'LANG' in os.environ") == "True"
    # Nor through /proc: without capabilities the sandbox cannot read other processes' environments.
    scan = (
        "found = []\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        found.append(b'hunter2-secret-value' in open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError:\n"
        "        pass\n"
        "any(found)"
    )
    try:
        assert env.python(scan) == "False"
        with open(f"/proc/{victim.pid}/environ", "rb") as f:
            assert b"hunter2-secret-value" in f.read()  # it was there to be found
    finally:
        victim.kill()
        victim.wait()


def test_each_episode_gets_a_fresh_directory_removed_at_reset(make_env):
    env = make_env()
    workdir = env.python("import os\nprint(os.getcwd())")
    assert os.path.basename(workdir).startswith("trl_agentic_sandbox_")
    assert env.python("open('notes.txt', 'w').write('abc')") == "3"
    assert env.python("print(open('notes.txt').read(), os.listdir('.'))") == "abc ['notes.txt']"
    assert os.path.isfile(os.path.join(workdir, "notes.txt"))

    env.reset()
    assert not os.path.exists(workdir)
    assert env.python("print(os.getcwd())") == "NameError: name 'os' is not defined"  # fresh interpreter
    new_workdir = env.python("import os\nprint(os.getcwd())")
    assert new_workdir != workdir
    assert env.python("os.listdir('.')") == "[]"


def test_filesystem_is_read_only_outside_the_workdir(make_env):
    env = make_env()
    assert env.python("import os\nopen('mine.txt', 'w').write('ok')") == "2"
    assert env.isolation["filesystem"] == "read-only"
    host_probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_write_probe.txt")
    try:
        for path in (host_probe, "/tmp/trl_agentic_write_probe.txt"):
            assert env.python(f"open({path!r}, 'w')") == f"OSError: [Errno 30] Read-only file system: {path!r}"
            assert not os.path.exists(path)
    finally:
        for path in (host_probe, "/tmp/trl_agentic_write_probe.txt"):
            if os.path.exists(path):
                os.remove(path)
    # Nor can it leave its cgroup, or change files through a subprocess.
    text = env.python("open('/sys/fs/cgroup/pids/cgroup.procs', 'w').write(str(os.getpid()))")
    assert text.startswith("OSError: [Errno 30] Read-only file system")
    text = env.python(f"import subprocess\nsubprocess.run(['touch', {host_probe!r}], capture_output=True).returncode")
    assert text == "1" and not os.path.exists(host_probe)
    # A private /dev/shm keeps multiprocessing working.
    assert env.python("import multiprocessing as mp\nq = mp.Queue()\nq.put(7)\nq.get(timeout=5)") == "7"
    assert env.python("open('/dev/shm/scratch', 'w').write('x')") == "1"
    assert not os.path.exists("/dev/shm/scratch")


def test_checkpoint_and_restore_replay_successful_cells(make_env):
    env = make_env()
    env.python("x = 1\nopen('log.txt', 'a').write('x')")
    env.python("undefined_name")  # failed cells are not part of the state
    state = env._checkpoint()
    assert state == ["x = 1\nopen('log.txt', 'a').write('x')"]
    env.python("x = 2\nopen('log.txt', 'a').write('y')")
    assert env.python("print(x)") == "2"

    env._restore(state)
    assert env.python("print(x, open('log.txt').read())") == "1 x"  # files are re-created by the replay, not doubled
    env.python("x = 3")
    env._restore(state)  # the same checkpoint again
    assert env.python("print(x)") == "1"


def test_memory_error_is_a_model_error(make_env):
    env = make_env(memory_limit_mb=256)
    env.python("kept = 'still here'")
    text = env.python("block = bytearray(1024 ** 3)")
    assert text == "MemoryError: the sandbox memory limit (256 MiB) was exceeded"
    assert env.last_error_type == "MemoryError"
    assert env.python("print(kept)") == "still here"  # the interpreter survived


def test_dead_interpreter_raises_infra_errors_and_recovers(make_env):
    env = make_env()
    env.python("import os\nx = 5")
    with pytest.raises(SandboxCrashed, match=r"^SandboxCrashed: the interpreter exited with code 3$"):
        env.python("os._exit(3)")
    assert env.last_error_type == "SandboxCrashed"
    assert env.python("x") == "5"  # restarted, with the successful cells replayed

    with pytest.raises(SandboxCrashed, match=r"killed by signal SIGABRT") as info:
        env.python("os.abort()")
    assert not isinstance(info.value, SandboxMemoryError)
    # How CPython dies when it cannot recover from an allocation failure: a fatal error, then abort().
    with pytest.raises(SandboxMemoryError, match=r"^SandboxMemoryError: the interpreter was killed by signal SIGABRT"):
        env.python("import ctypes\nctypes.pythonapi.Py_FatalError(b'Cannot allocate memory')")
    assert env.last_error_type == "SandboxMemoryError"
    assert env.python("x * 2") == "10"


def test_output_is_truncated_in_the_child(make_env):
    env = make_env(max_output_chars=1000, max_file_mb=4)
    text = env.python("print('a' * 5000)")
    assert text == "a" * 1000 + "\n...[truncated 4001 chars]"

    text = env.python("print('b' * 3000)\nraise ValueError('bad')")
    # The error message is always kept; the output gets what is left of the budget.
    assert text == "b" * (1000 - 15) + "\n...[truncated 2016 chars]\nValueError: bad"
    assert len(text) < 1100

    # Endless output stops at the file size limit instead of filling the disk or the pipe.
    start = time.monotonic()
    text = env.python("while True:\n    print('c' * 100_000)")
    assert time.monotonic() - start < 5.0
    assert env.last_error_type == "OSError" and text.endswith("OSError: [Errno 27] File too large")
    truncated = int(text.split("...[truncated ")[1].split(" chars]")[0])
    assert 4 * 1024 * 1024 - 200_000 <= truncated <= 4 * 1024 * 1024
    assert len(text) < 1100


def test_sandbox_processes_end_with_the_env(make_env):
    env = make_env()
    env.python("import subprocess\nsleeper = subprocess.Popen(['sleep', '60'])")
    processes = SandboxProcesses(env)
    assert len(processes.live()) == 4  # launcher, supervisor, interpreter, sleep
    workdir = processes.workdir
    env._close()
    env._close()  # idempotent
    assert processes.settle(0) == set()
    assert not os.path.exists(workdir)
    assert processes.cgroup is None or not os.path.exists(processes.cgroup)

    # Garbage collection of an env that was never closed.
    env = PythonSandboxEnv()
    env.python("import subprocess\nsleeper = subprocess.Popen(['sleep', '60'])")
    processes = SandboxProcesses(env)
    del env
    gc.collect()
    assert processes.settle(0) == set()
    assert not os.path.exists(processes.workdir)


def test_fallback_without_namespaces_still_cleans_up(make_env):
    env = make_env(timeout=1.0, use_namespaces=False)
    env.python("import subprocess\nsleeper = subprocess.Popen(['sleep', '60'])")
    assert env.isolation["pid_namespace"] is False and env.isolation["network"] == "socket-disabled"
    processes = SandboxProcesses(env)
    assert len(processes.live()) == 4
    with pytest.raises(SandboxTimeout):
        env.python("while True:\n    pass")
    assert processes.settle(0) == set()


def test_numpy_works_within_the_limits(make_env):
    env = make_env()
    assert env.python("import numpy as np\nint(np.arange(10).sum())") == "45"


def test_constructor_validates_limits():
    with pytest.raises(ValueError, match="timeout"):
        PythonSandboxEnv(timeout=0)
    with pytest.raises(ValueError, match="memory_limit_mb"):
        PythonSandboxEnv(memory_limit_mb=10)
