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

from trl_agentic.async_grpo.server import _DIE_WITH_PARENT, die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


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
        while _exe(children[mode]) != "sleep" and time.monotonic() < deadline:  # past the launcher's exec
            time.sleep(0.05)
        assert _exe(children[mode]) == "sleep"
        parent.send_signal(how)
        parent.wait()
    try:
        assert _wait_gone(children["wrapped"])
        assert _alive(children["plain"])  # the control: a child in its own session outlives its parent
    finally:
        for pid in children.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


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


def test_a_parent_gone_before_the_signal_was_armed_stops_the_command():
    """The race: the starting process died between fork and the prctl (the launcher then has another parent). The
    command is not run."""
    wrong_parent = str(os.getpid() + 10**6)
    out = subprocess.run(
        [sys.executable, "-c", _DIE_WITH_PARENT, wrong_parent, "echo", "ran"], capture_output=True, text=True
    )
    assert out.returncode == 143 and "ran" not in out.stdout


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
