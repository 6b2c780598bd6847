"""The vLLM server of `vllm_server_start` does not outlive the process that started it (`server.die_with_parent`).

The server runs in a session of its own (so that stopping it stops its engine processes), so a trainer killed by
SIGTERM (a scheduler's cancel or preemption) or SIGKILL, which runs no `finally`, used to leave it running with its
memory and cores; seen live on 2026-11-29. These tests kill a real parent process and watch a real child; the vLLM
tier checks the real server (`tests/vllm_tier/test_async_agentic.py`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from trl_agentic.async_grpo.server import _SUPERVISOR, die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        # A zombie still answers kill(0); it has exited.
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):  # gone, or reaped between the two
        return False


def _wait_gone(pid: int, limit_s: float = 60.0) -> bool:
    deadline = time.monotonic() + limit_s  # a hang guard, not a speed check
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_the_child_dies_with_the_process_that_started_it(how):
    """A parent starts `sleep` through `die_with_parent` in a new session, as `VLLMServer.start` does, and is killed
    without running any cleanup: the child gets SIGTERM from the kernel and exits. Without the wrapper it survives."""
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from trl_agentic.async_grpo.server import die_with_parent
        argv = ["sleep", "1000"]
        wrapped = die_with_parent(argv) if sys.argv[1] == "wrapped" else argv
        child = subprocess.Popen(wrapped, start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(1000)
        """
    )
    children = {}
    for mode in ("wrapped", "plain"):
        parent = subprocess.Popen([sys.executable, "-c", script, mode], stdout=subprocess.PIPE, text=True)
        children[mode] = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while not _sleeps(children[mode]) and time.monotonic() < deadline:  # the supervisor has started `sleep`
            time.sleep(0.05)
        assert _sleeps(children[mode])
        if mode == "wrapped":
            sleeper = _sleeps(children[mode])[0]
            assert sleeper != children[mode]  # the supervisor's child
        parent.send_signal(how)
        parent.wait()
    try:
        assert _wait_gone(children["wrapped"]) and _wait_gone(sleeper)
        assert _alive(children["plain"])  # the control: a child in its own session outlives its parent
    finally:
        for pid in (*children.values(), sleeper):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _sleeps(pid: int) -> list[int]:
    """`pid` itself if it runs `sleep`, or its children that do."""
    if _exe(pid) == "sleep":
        return [pid]
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid and _exe(int(p)) == "sleep"]


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _exe(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def test_the_wrapped_command_runs_with_its_arguments_and_exit_status():
    out = subprocess.run(
        die_with_parent([sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(3)", "a b", "c"]),
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "['a b', 'c']" and out.returncode == 3
    # A command a signal ended: 128 + its number, as a shell says it.
    out = subprocess.run(die_with_parent([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]))
    assert out.returncode == 128 + 9


def test_a_parent_gone_before_the_signal_was_armed_stops_the_command():
    """The race: the starting process died between fork and the prctl (the supervisor then has another parent). The
    command is not run."""
    wrong_parent = str(os.getpid() + 10**6)
    out = subprocess.run(
        [sys.executable, _SUPERVISOR, wrong_parent, "30", "echo", "ran"], capture_output=True, text=True
    )
    assert out.returncode == 143 and "ran" not in out.stdout


# Ignores SIGTERM, as vLLM's server does while its graceful shutdown waits for a connection that never closes, and
# starts a process in its group that ignores it too (vLLM's engine process). Says so once both run.
_STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # SIG_IGN is inherited
    print("started", flush=True)
    time.sleep(300)
    """
)

# Starts `argv` (a command line) through `die_with_parent` in a new session, says the supervisor's pid, and sleeps.
_STARTER = textwrap.dedent(
    """
    import json, subprocess, sys, time
    from trl_agentic.async_grpo.server import die_with_parent
    child = subprocess.Popen(die_with_parent(json.loads(sys.argv[1]), grace=float(sys.argv[2])), start_new_session=True)
    print("supervisor", child.pid, flush=True)
    time.sleep(300)
    """
)


def _start(command: list[str], grace: float) -> subprocess.Popen:
    import json

    return subprocess.Popen(
        [sys.executable, "-c", _STARTER, json.dumps(command), str(grace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid and _alive(int(p))]


def _stubborn_pids(parent: subprocess.Popen, pids: list[int]) -> None:
    """The supervisor, the command and its engine, appended to `pids` as each is known."""
    tag, supervisor = parent.stdout.readline().split()
    assert tag == "supervisor"
    pids.append(int(supervisor))
    assert parent.stdout.readline().strip() == "started"  # the command has started its engine
    (command,) = _children(pids[0])
    pids.append(command)
    (engine,) = _children(command)
    pids.append(engine)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(how):
    """The starter dies while the command ignores SIGTERM (as vLLM's server did, waiting forever for a connection in
    its graceful shutdown; CI, 2026-12-04): the supervisor SIGKILLs it after the grace, and the process it started in
    the group too. The control: both are still alive after a SIGTERM sent to them directly."""
    parent = _start([sys.executable, "-c", _STUBBORN], grace=1)
    pids: list[int] = []
    try:
        _stubborn_pids(parent, pids)
        supervisor, command, engine = pids
        for pid in (command, engine):
            os.kill(pid, signal.SIGTERM)
        time.sleep(1)
        assert _alive(command) and _alive(engine)  # the control: SIGTERM alone does not stop them
        parent.send_signal(how)
        parent.wait()
        assert all(_wait_gone(pid) for pid in pids)
        assert "still running 1 s after SIGTERM: SIGKILL" in parent.stderr.read()
    finally:
        parent.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_command_that_stops_within_the_grace_is_not_killed(tmp_path):
    """The grace is given: a command that takes a moment to shut down after SIGTERM finishes its shutdown and exits
    with its own status; nothing is SIGKILLed."""
    done = tmp_path / "done"
    polite = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    time.sleep(0.5)\n"
        f"    open({str(done)!r}, 'w').write('clean')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('started', flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = _start([sys.executable, "-c", polite], grace=30)
    pids: list[int] = []
    try:
        tag, supervisor = parent.stdout.readline().split()
        pids.append(int(supervisor))
        assert parent.stdout.readline().strip() == "started"
        pids += _children(pids[0])
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert all(_wait_gone(pid) for pid in pids)
        assert done.read_text() == "clean"
        assert "SIGKILL" not in parent.stderr.read()
    finally:
        parent.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_stop_takes_the_server_down_after_its_supervisor_died_alone(monkeypatch):
    """`VLLMServer.stop()` signals the server's process group, not just its process (the supervisor): a supervisor
    SIGKILLed on its own (the OOM killer) leaves a server that ignores SIGTERM, and `stop()` still SIGKILLs it and its
    engine process, at the grace (0 here: not one wait), since no supervisor is left to. The control: both outlive
    the supervisor."""
    from trl_agentic.async_grpo import server as server_module
    from trl_agentic.async_grpo.server import VLLMServer

    waits = []
    sleep = server_module.time.sleep
    monkeypatch.setattr(server_module.time, "sleep", lambda s: (waits.append(s), sleep(s)))

    server = VLLMServer("unused", shutdown_grace=0)
    server.process = subprocess.Popen(
        die_with_parent([sys.executable, "-c", _STUBBORN], grace=0),
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [server.process.pid]
    try:
        assert server.process.stdout.readline().strip() == "started"
        (command,) = _children(pids[0])
        (engine,) = _children(command)
        pids += [command, engine]
        os.kill(pids[0], signal.SIGKILL)
        server.process.wait()
        time.sleep(1)
        assert _alive(command) and _alive(engine)  # the control: the server's parent-death SIGTERM is ignored
        waits.clear()  # `time` is the module every caller shares: count stop()'s waits only
        server.stop()
        assert waits == []  # the 30 s a live supervisor gets to SIGKILL at the grace were not waited for
        assert _wait_gone(command) and _wait_gone(engine)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("leader", [True, False])
def test_what_the_command_leaves_in_the_group_is_killed(leader):
    """The command exits on its own (a crashed server) and leaves a process in its group (an engine process): a
    supervisor that leads the group (as `VLLMServer` starts it) SIGKILLs it after the grace and exits with the command's
    status. The control: one that does not lead its group leaves it alone (run in a throwaway group led by a wrapper,
    so that a broken check could not hit pytest's own group)."""
    leftover = (  # the sleeper must not hold the captured pipes open
        "import subprocess, sys; d = subprocess.DEVNULL; "
        "print(subprocess.Popen(['sleep', '300'], stdout=d, stderr=d).pid, flush=True); sys.exit(5)"
    )
    command = [sys.executable, "-c", leftover]
    if leader:
        argv = die_with_parent(command, grace=0.5)
    else:  # a wrapper leads the new group and starts the supervisor in it
        wrapper = (
            "import subprocess, sys; from trl_agentic.async_grpo.server import die_with_parent; "
            "sys.exit(subprocess.run(die_with_parent(sys.argv[1:], grace=0.5)).returncode)"
        )
        argv = [sys.executable, "-c", wrapper, *command]
    out = subprocess.run(argv, start_new_session=True, capture_output=True, text=True)
    sleeper = int(out.stdout)
    try:
        assert out.returncode == 5
        assert _wait_gone(sleeper) if leader else _alive(sleeper)
    finally:
        if _alive(sleeper):
            os.kill(sleeper, signal.SIGKILL)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_the_rollout_workers_child_dies_with_the_trainer(tmp_path, how):
    """TRL's rollout worker child is a daemon process spawned by multiprocessing, stopped only by a normal exit of the
    trainer. A child that calls `die_with_trainer` (both loop classes the trainer spawns do, first thing) exits once
    its parent is killed without any cleanup; the control child, spawned alike without it, outlives its parent."""
    (tmp_path / "children.py").write_text(
        textwrap.dedent(
            """
            import time

            def armed():
                from trl_agentic.async_grpo.worker import die_with_trainer

                die_with_trainer()
                print("ready", flush=True)
                time.sleep(1000)

            def plain():
                print("ready", flush=True)
                time.sleep(1000)
            """
        )
    )
    (tmp_path / "parent.py").write_text(
        textwrap.dedent(
            """
            import multiprocessing, sys, time
            import children

            if __name__ == "__main__":
                target = getattr(children, sys.argv[1])
                child = multiprocessing.get_context("spawn").Process(target=target, daemon=True)
                child.start()
                print(child.pid, flush=True)
                time.sleep(1000)
            """
        )
    )
    pids = {}
    for mode in ("armed", "plain"):
        parent = subprocess.Popen([sys.executable, "parent.py", mode], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        pids[mode] = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"  # the child armed its signal (or, plain, did not)
        parent.send_signal(how)
        parent.wait()
    try:
        assert _wait_gone(pids["armed"])
        assert _alive(pids["plain"])
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_both_loop_classes_arm_the_signal_first(monkeypatch):
    """`TRLRolloutLoop` (every feature off) and `AgenticAsyncRolloutLoop` call `die_with_trainer` before TRL's
    `__init__` runs: the child is covered before it opens any connection."""
    from trl_agentic.async_grpo import worker
    from trl_agentic.async_grpo.compat import worker_module

    order = []
    monkeypatch.setattr(worker, "die_with_trainer", lambda: order.append("armed"))

    def trl_init(self, **kwargs):
        order.append("trl")
        raise RuntimeError("stop here")

    monkeypatch.setattr(worker_module()._AsyncRolloutLoop, "__init__", trl_init)
    for cls in (worker.TRLRolloutLoop, worker.AgenticAsyncRolloutLoop):
        order.clear()
        with pytest.raises(RuntimeError, match="stop here"):
            cls()
        assert order == ["armed", "trl"], cls
    # TRLRolloutLoop changes nothing else of TRL's loop.
    assert (
        set(vars(worker.TRLRolloutLoop))
        - {"__module__", "__qualname__", "__doc__", "__init__", "__firstlineno__", "__static_attributes__"}
        == set()
    )


def test_a_refused_parent_death_signal_is_said_and_the_process_runs_on(monkeypatch, capsys):
    """A prctl refused (a seccomp sandbox): one line on stderr naming what would outlive whom, and no exception; the
    supervisor and the rollout worker share this code."""
    from trl_agentic.async_grpo import supervisor

    calls = []

    class Refusing:
        def prctl(self, *args):
            calls.append(args[:2])
            return -1

    monkeypatch.setattr(supervisor.ctypes, "CDLL", lambda *a, **k: Refusing())
    supervisor.set_parent_death_signal(signal.SIGTERM, "this rollout worker", "the trainer")
    supervisor.set_parent_death_signal(signal.SIGTERM, "this server")
    assert calls == [(1, signal.SIGTERM)] * 2  # PR_SET_PDEATHSIG is option 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("trl-agentic: PR_SET_PDEATHSIG failed (errno ") for line in err)
    assert err[0].endswith("this rollout worker will not stop if the trainer dies without stopping it")
    assert err[1].endswith("this server will not stop if its starter dies without stopping it")
