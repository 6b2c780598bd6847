"""`PythonSandboxEnv` against real sandbox subprocesses: state, the error taxonomy, limits, policy and cleanup.

The attacks of model-written code (fork bombs, network, signals, ...) are in `test_sandbox_adversarial.py`.
"""

import gc
import logging
import os

import pytest
from sandbox_helpers import POLICIES, EnvFactory, SandboxProcesses, time_limit

from trl_agentic.envs import sandbox_isolation, sandbox_process
from trl_agentic.envs.errors import (
    CodeError,
    SandboxCrashed,
    SandboxError,
    SandboxMemoryError,
    SandboxRestoreError,
    SandboxTimeout,
    SandboxUnavailable,
)
from trl_agentic.envs.python_sandbox import PythonSandboxEnv
from trl_agentic.errors import InfrastructureError, ToolCallError, error_type_names


@pytest.fixture(params=list(POLICIES))
def make_env(request):
    """Builds sandbox envs under each isolation policy and closes them after the test, even when it fails."""
    factory = EnvFactory(**POLICIES[request.param])
    yield factory
    factory.close()


def code_error(env: PythonSandboxEnv, code: str) -> CodeError:
    with pytest.raises(CodeError) as info:
        env.python(code)
    return info.value


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
    # stdin is /dev/null, not the protocol pipe
    assert str(code_error(env, "input()")) == "EOFError: EOF when reading a line"


def test_children_report_their_exit_codes_within_a_cell(make_env):
    env = make_env()
    code = "import os, subprocess, time\np = subprocess.Popen(['sh', '-c', 'exit 7'])\np.wait(), p.poll()"
    assert env.python(code) == "(7, 7)"
    assert env.python("pid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)[0] == pid") == "True"
    # A child still running when the cell ends is killed with it; its Popen learns the real exit status.
    env.python("q = subprocess.Popen(['sleep', '60'])")
    assert env.python("q.poll()") == "-9"


def test_model_errors_raise_code_error_with_the_exception_type(make_env):
    env = make_env()
    error = code_error(env, "print(x)")
    assert str(error) == "NameError: name 'x' is not defined"
    assert error.error_type == env.last_error_type == "NameError"
    assert isinstance(error, ToolCallError) and not isinstance(error, InfrastructureError)
    assert error_type_names(error)[:2] == ["NameError", "CodeError"]

    error = code_error(env, "print('before')\nx = = 1")
    assert str(error).endswith("SyntaxError: invalid syntax") and "before" not in str(error)  # nothing ran
    assert error.error_type == "SyntaxError"

    error = code_error(env, "print('partial')\n1 / 0")
    assert str(error) == "partial\nZeroDivisionError: division by zero"  # the output, then the error line
    assert code_error(env, "raise SystemExit(3)").error_type == "SystemExit"  # does not end the interpreter
    assert env.python("import os\nos.getpid() > 1") == "True"
    assert env.last_error_type is None
    # A cell that merely prints an error's text succeeded.
    assert env.python("print('ValueError: not really')") == "ValueError: not really"
    assert env.last_error_type is None


def test_timeout_is_a_model_error_and_the_state_survives(make_env):
    env = make_env(timeout=60.0)
    env.python("x = 41")
    processes = SandboxProcesses(env)
    assert len(processes.live()) == processes.own
    with pytest.raises(SandboxTimeout) as info, time_limit(env, 1.0):  # only this endless cell meets the 1 s
        env.python("while True:\n    pass")
    assert str(info.value) == "the cell exceeded its time limit (1 s) and was stopped"
    assert isinstance(info.value, SandboxError) and isinstance(info.value, ToolCallError)
    assert not isinstance(info.value, InfrastructureError)
    assert error_type_names(info.value)[:3] == ["SandboxTimeout", "SandboxError", "ToolCallError"]
    assert env.last_error_type == "SandboxTimeout"
    assert processes.settle(0) == set()
    assert processes.workdir is None or not os.path.exists(processes.workdir)
    # A new interpreter replays the cells that succeeded: the episode state survives the timeout.
    assert env.python("x + 1") == "42"


def test_each_episode_gets_a_fresh_directory(make_env):
    env = make_env()
    workdir = env.python("import os\nprint(os.getcwd())")
    assert env.python("os.environ['HOME'] == os.getcwd() == os.environ['TMPDIR']") == "True"
    assert env.python("open('notes.txt', 'w').write('abc')") == "3"
    assert env.python("print(open('notes.txt').read(), os.listdir('.'))") == "abc ['notes.txt']"
    host_dir = env._process.workdir  # None inside bubblewrap: the directory is a tmpfs of the sandbox's own
    if host_dir is not None:
        assert workdir == host_dir and os.path.isfile(os.path.join(host_dir, "notes.txt"))

    env.reset()
    assert host_dir is None or not os.path.exists(host_dir)
    assert code_error(env, "print(os.getcwd())").error_type == "NameError"  # a fresh interpreter
    assert env.python("import os\nos.listdir('.')") == "[]"


def test_checkpoint_and_restore_replay_every_completed_cell(make_env):
    env = make_env()
    env.python("x = 1\nopen('log.txt', 'a').write('x')")
    code_error(env, "undefined_name")  # a cell that raised is part of the state, with its outcome
    state = env._checkpoint()
    assert state == [("x = 1\nopen('log.txt', 'a').write('x')", None), ("undefined_name", "NameError")]
    env.python("x = 2\nopen('log.txt', 'a').write('y')")
    assert env.python("print(x)") == "2"

    env._restore(state)
    assert env.python("print(x, open('log.txt').read())") == "1 x"  # files are re-created by the replay, not doubled
    env.python("x = 3")
    env._restore(state)  # the same checkpoint again
    assert env.python("print(x)") == "1"


def test_a_cell_that_raised_is_replayed_with_what_it_did_before_raising(make_env):
    """Issue 35's reproduction: a cell sets `x` then raises, a later cell waits for `x`, a rollback restores the
    checkpoint. 009b255 did not replay the raising cell, so the waiting cell looped on replay and the restore failed as
    `SandboxUnavailable` (infrastructure: retried, then the rollout dropped with a NaN reward). Replaying the raising
    cell too (it raises again, as before) restores exactly what the model saw."""
    env = make_env(timeout=60.0)  # every cell ends at once; the limit only guards against a hang
    code_error(env, "x = 1\n1/0")
    assert env.python("while 'x' not in globals(): pass\ny = 2") == "(no output)"
    assert env.python("z = y + 1") == "(no output)"
    state = env._checkpoint()
    code_error(env, "undefined_name")
    env._restore(state)
    assert env.python("print(x, y, z)") == "1 2 3"
    assert env.last_error_type is None


def test_a_divergent_replay_is_a_model_error_not_infrastructure(make_env):
    """A cell that depends on what cannot be replayed (fresh randomness) ends otherwise on replay: the restore stops
    there with `SandboxRestoreError`, a model error, the call's code does not run and the divergent cell and the
    cells after it leave the state."""
    env = make_env(timeout=60.0)
    secret = env.python("import os\nsecret = os.urandom(8).hex()\nprint(secret)")
    assert env.python(f"assert secret == {secret!r}\nok = 1") == "(no output)"  # true the first time only
    env.python("after = 2")
    state = env._checkpoint()
    env._restore(state)
    with pytest.raises(SandboxRestoreError) as info:
        env.python("print('this call')")
    error = info.value
    assert isinstance(error, SandboxError) and not isinstance(error, InfrastructureError)
    assert error.error_type == env.last_error_type == "SandboxRestoreError"
    assert "replaying earlier cell 2 of 3" in str(error) and "raised AssertionError where it had succeeded" in str(
        error
    )
    assert "this call's code did not run" in str(error)
    assert [code for code, _ in env._checkpoint()] == [state[0][0]]
    assert code_error(env, "print(after)").error_type == "NameError"
    assert env.python("print('fresh')") == "fresh"


def test_a_replay_that_now_runs_forever_is_a_model_error(make_env):
    """The reproduction's shape with a cell that truly diverges: it waits for a value only its first run had. Its
    replay runs into the time limit, which is the model's error, not infrastructure. Only the never-ending cell
    depends on the short limit."""
    env = make_env(timeout=3.0)
    secret = env.python("import os\nsecret = os.urandom(8).hex()\nprint(secret)")
    env.python(f"while secret != {secret!r}: pass")
    env._restore(env._checkpoint())
    with pytest.raises(SandboxRestoreError, match=r"replaying earlier cell 2 of 2 failed this time \(SandboxTimeout"):
        env.python("print('this call')")
    assert env.python("print(len(secret))") == "16"  # the first cell was replayed and kept


def _slow_cell_replayed_under_half_a_second(env):
    """A cell that sleeps 1 s runs under a 60 s limit, then the limit is cut to 0.5 s before its replay (the ratio a
    2x slower machine gives): simulated without wall-clock luck."""
    env.python("import time\ntime.sleep(1.0)\nx = 1")
    env._restore(env._checkpoint())
    return time_limit(env, 0.5)


def test_a_replay_slower_than_the_call_limit_gets_the_replay_slack(make_env):
    """A cell that ran within its limit is replayed under `replay_timeout_factor` times the limit, so a machine that is
    busier at the replay than at the first run does not turn a deterministic cell into a divergence: with 4 x 0.5 s
    the 1 s cell replays and the state comes back."""
    env = make_env(timeout=60.0, replay_timeout_factor=4.0)
    with _slow_cell_replayed_under_half_a_second(env):
        assert env.python("print(x)") == "1"


def test_a_replay_past_its_slack_is_the_models_restore_error(make_env):
    """Without the slack (factor 1: 0.5 s for the 1 s cell) the replay is cut and reported as the model's
    `SandboxRestoreError`, as a replay that truly diverged is; the state is gone."""
    env = make_env(timeout=60.0, replay_timeout_factor=1.0)
    with _slow_cell_replayed_under_half_a_second(env):
        with pytest.raises(
            SandboxRestoreError, match=r"replaying earlier cell 1 of 1 failed this time \(SandboxTimeout"
        ):
            env.python("print(x)")
        assert code_error(env, "print(x)").error_type == "NameError"


def test_a_divergent_replay_keeps_the_rollout_and_its_reward(tiny_tokenizer):
    """Through the rollout loop with rollback: the divergent replay reaches the model as an error, the rollout is not
    lost to infrastructure (009b255: `infra_failed`, NaN reward)."""
    from rollout_helpers import ScriptBackend, call, run_tools_loop

    from trl_agentic.rollout.loop import LoopConfig

    env = EnvFactory(**POLICIES["best_effort"])(timeout=3.0)
    try:
        env.reset()
        secret = env.python("import os\nsecret = os.urandom(8).hex()\nprint(secret)")  # earlier in the episode
        turns = [
            call("python", code=f"while secret != {secret!r}: pass"),  # true now; loops when replayed
            call("python", code="undefined_name"),  # NameError: rolled back, the checkpoint replays the cells above
            call("python", code="print('after')"),
            "done<|im_end|>",
        ]
        backend = ScriptBackend(tiny_tokenizer, [[t] for t in turns[1:]])
        config = LoopConfig(
            enable_tool_rollback=True,
            save_negative_samples=True,
            rollback_on_errors=["NameError"],
            infra_error_types=["InfrastructureError"],
            max_infra_retries=2,
        )
        _, _, (_, completions, *_), result = run_tools_loop(
            backend, [turns[0]], [{"python": env.python}], config, envs=[env]
        )
    finally:
        env._close()
    assert result.infra_failed == [False] and result.stats.infra_retries == 0
    assert result.stats.rollback_attempts == 1 and len(result.extra_rows) == 1
    contents = [m["content"] for m in completions[0] if m["role"] == "tool"]
    assert contents[0] == "(no output)" and "SandboxRestoreError" not in contents[0]
    assert "could not restore its state" in contents[1] and result.tool_failed == [[False, True]]


@pytest.mark.parametrize(
    "code, error_type",
    [
        # a class of the model's own with the name of the default infrastructure type
        ("class InfrastructureError(Exception): pass\nraise InfrastructureError('not mine')", "InfrastructureError"),
        # the model's own network attempt, with `"ConnectionError"` listed as infrastructure as docs suggest
        ("raise ConnectionError('no network in the sandbox')", "ConnectionError"),
    ],
)
def test_model_code_cannot_make_its_error_an_infrastructure_error(tiny_tokenizer, code, error_type):
    """The sandbox reports model code's exception by name (`CodeError.error_type`); infrastructure is read from the
    class hierarchy of what the tool raised (a `CodeError`), never from that name. The model's failure is rolled back
    with a negative row; it was retried `max_infra_retries` times on the state it changed and dropped from the loss."""
    from rollout_helpers import ScriptBackend, call, run_tools_loop

    from trl_agentic.rollout.loop import LoopConfig

    env = EnvFactory(**POLICIES["best_effort"])(timeout=10.0)
    try:
        env.reset()
        turns = [call("python", code=code), call("python", code="print('fixed')"), "done<|im_end|>"]
        backend = ScriptBackend(tiny_tokenizer, [[t] for t in turns[1:]])
        config = LoopConfig(
            enable_tool_rollback=True,
            save_negative_samples=True,
            rollback_on_errors=[error_type],
            infra_error_types=["InfrastructureError", "ConnectionError"],
            max_infra_retries=2,
        )
        _, _, _, result = run_tools_loop(backend, [turns[0]], [{"python": env.python}], config, envs=[env])
        cells = len(env._cells)
    finally:
        env._close()
    assert result.infra_failed == [False] and result.stats.infra_retries == 0
    assert result.stats.rollback_attempts == 1 and result.stats.negatives_saved == 1
    assert [row.error_types for row in result.extra_rows] == [[error_type]]
    assert cells == 1  # the corrected cell; the failed one was run once and rolled back


def test_a_single_huge_allocation_is_a_code_error(make_env):
    env = make_env(memory_limit_mb=256)
    env.python("kept = 'still here'")
    error = code_error(env, "block = bytearray(1024 ** 3)")
    assert str(error) == "MemoryError: the sandbox memory limit (256 MiB) was exceeded"
    assert error.error_type == env.last_error_type == "MemoryError"
    assert env.python("print(kept)") == "still here"  # the interpreter survived


def test_dead_interpreter_raises_sandbox_crashed_and_recovers(make_env):
    env = make_env()
    env.python("import os\nx = 5")
    with pytest.raises(SandboxCrashed, match=r"^the interpreter exited with code 3$"):
        env.python("os._exit(3)")
    assert env.last_error_type == "SandboxCrashed"
    assert env.python("x") == "5"  # restarted, with the successful cells replayed

    with pytest.raises(SandboxCrashed, match=r"killed by signal SIGABRT") as info:
        env.python("os.abort()")
    assert not isinstance(info.value, SandboxMemoryError)
    # How CPython dies when it cannot recover from an allocation failure: a fatal error, then abort().
    with pytest.raises(SandboxMemoryError, match=r"^the interpreter was killed by signal SIGABRT"):
        env.python("import ctypes\nctypes.pythonapi.Py_FatalError(b'Cannot allocate memory')")
    assert env.last_error_type == "SandboxMemoryError"
    assert env.python("x * 2") == "10"
    # The cell's own output is not the interpreter's fatal error: these were memory errors (the markers were searched
    # in the whole output's tail), which rollback matches by type.
    for code in ("print('checking for out of memory conditions')\nos._exit(1)", "print('no MemoryError')\nos.abort()"):
        with pytest.raises(SandboxCrashed) as info:
            env.python(code)
        assert not isinstance(info.value, SandboxMemoryError), code


def test_an_interpreter_that_runs_out_of_memory_between_cells_is_a_memory_error(make_env):
    """A cell keeps memory within 2 MiB of the limit; the next, 8 MB cell cannot even be read. That death is the
    interpreter's own (told by its exit code, not by text a cell could print): a `SandboxMemoryError`."""
    env = make_env(memory_limit_mb=256, timeout=30)
    fill = "hog = []\ntry:\n    while True:\n        hog.append(bytearray(1 << 20))\nexcept MemoryError:\n    pass\n"
    env.python(fill + "hog.pop()\nhog.pop()\nprint(len(hog) > 0)")
    with pytest.raises(SandboxMemoryError, match="ran out of memory reading the cell"):
        env.python("s = " + repr("x" * (8 << 20)) + "\nlen(s)")


def test_output_is_truncated_in_the_child(make_env):
    env = make_env(max_output_chars=1000, max_file_mb=4)
    text = env.python("print('a' * 5000)")
    assert text == "a" * 1000 + "\n...[truncated 4001 chars]"

    error = str(code_error(env, "print('b' * 3000)\nraise ValueError('bad')"))
    # The error message is always kept; the output gets what is left of the budget.
    assert error == "b" * (1000 - 15) + "\n...[truncated 2016 chars]\nValueError: bad"

    # Endless output stops at the file size limit instead of filling the disk or the pipe.
    error = code_error(env, "while True:\n    print('c' * 100_000)")
    assert error.error_type == "OSError" and str(error).endswith("OSError: [Errno 27] File too large")
    truncated = int(str(error).split("...[truncated ")[1].split(" chars]")[0])
    assert 4 * 1024 * 1024 - 200_000 <= truncated <= 4 * 1024 * 1024
    assert len(str(error)) < 1100


def test_sandbox_processes_end_with_the_env(make_env):
    env = make_env()
    env.python("import os")
    processes = SandboxProcesses(env)
    assert len(processes.live()) == processes.own
    cgroup_dirs = [path for path, _ in processes.cgroup.dirs.values()]
    assert cgroup_dirs and all(os.path.isdir(path) for path in cgroup_dirs)
    env._close()
    env._close()  # idempotent
    assert processes.settle(0) == set()
    assert processes.workdir is None or not os.path.exists(processes.workdir)
    assert not any(os.path.exists(path) for path in cgroup_dirs)

    # Garbage collection of an env that was never closed.
    env = PythonSandboxEnv(**make_env.defaults)
    env.python("import os")
    processes = SandboxProcesses(env)
    assert len(processes.live()) == processes.own
    del env
    gc.collect()
    assert processes.settle(0) == set()


def test_numpy_works_within_the_limits(make_env):
    env = make_env()
    assert env.python("import numpy as np\nint(np.arange(10).sum())") == "45"


def test_isolation_report(make_env):
    env = make_env()
    assert env.isolation is None  # nothing started yet
    env.python("1")
    report = env.isolation
    namespaces = "bwrap" in env.mechanisms
    assert report["policy"] == env.isolation_policy
    assert report["pid_namespace"] is namespaces
    assert report["network"] == ("namespace" if namespaces else "socket")
    assert report["filesystem"] == ("private" if namespaces else "host")
    assert report["limits"] == ["cpu", "memory", "pids"] and report["process_limit"] == "cgroup"


def test_network_can_be_allowed():
    # The positive control for the network attacks in test_sandbox_adversarial.py.
    import socket

    env = PythonSandboxEnv(allow_network=True)
    try:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            listener.settimeout(30)
            port = listener.getsockname()[1]
            code = (
                f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=30)\nprint('connected')"
            )
            assert env.python(code) == "connected"
            connection, _ = listener.accept()
            connection.close()
        assert env.isolation["network"] == "allowed"
    finally:
        env._close()


def test_constructor_validates_limits():
    with pytest.raises(ValueError, match="timeout"):
        PythonSandboxEnv(timeout=0)
    with pytest.raises(ValueError, match="memory_limit_mb"):
        PythonSandboxEnv(memory_limit_mb=10)
    with pytest.raises(ValueError, match="max_disk_mb"):
        PythonSandboxEnv(max_file_mb=64, max_disk_mb=32)
    with pytest.raises(ValueError, match="replay_timeout_factor"):
        PythonSandboxEnv(replay_timeout_factor=0.5)
    with pytest.raises(ValueError, match="isolation"):
        PythonSandboxEnv(isolation="sometimes")
    with pytest.raises(ValueError, match="unknown isolation mechanisms"):
        PythonSandboxEnv(without=("seccomp",))


@pytest.mark.parametrize(
    "field,value",
    [
        ("timeout", float("nan")),  # every call a SandboxTimeout (a model error)
        ("timeout", float("inf")),  # OverflowError at the first call
        ("timeout", 1e300),
        ("timeout", True),
        ("max_cpus", float("nan")),
        ("replay_timeout_factor", float("inf")),
        ("memory_limit_mb", float("nan")),  # these: SandboxUnavailable at every start, every rollout dropped
        ("memory_limit_mb", 300.5),
        ("max_processes", 8.5),
        ("max_file_mb", 1.5),
        ("max_output_chars", 1000.5),  # SandboxCrashed at every call
        ("max_disk_mb", True),
    ],
)
def test_limits_that_only_fail_at_run_time_are_refused_when_built(field, value):
    """Each of these passed the constructor's comparisons (`nan` passes any) and broke every call at run time."""
    with pytest.raises(ValueError, match=f"`{field}`"):
        PythonSandboxEnv(**{field: value})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, True])
def test_the_sandbox_timeout_task_argument_is_checked_before_any_model_loads(value):
    from trl_agentic.tasks import TaskArguments

    with pytest.raises(ValueError, match="sandbox_timeout"):
        TaskArguments(task="python", sandbox_timeout=value)


# ---------------------------------------------------------------------------------------------- the isolation policy


def test_this_machine_provides_every_mechanism():
    # CI installs bubblewrap (`make install-sandbox`); the policy tests below simulate what other machines lack.
    assert sandbox_isolation.probe_mechanisms() == dict.fromkeys(sandbox_isolation.MECHANISMS)


@pytest.mark.parametrize("missing", sandbox_isolation.MECHANISMS)
def test_required_policy_refuses_at_start_up_naming_what_is_missing(missing):
    with pytest.raises(SandboxUnavailable) as info:
        PythonSandboxEnv(without=(missing,))
    message = str(info.value)
    assert isinstance(info.value, InfrastructureError)  # not the model's fault
    assert sandbox_isolation.PROTECTS[missing] in message and "disabled by the caller" in message
    assert message.count("\n- ") == 1  # only what is missing is listed
    assert "isolation='best_effort'" in message and "--sandbox_isolation best_effort" in message


def test_best_effort_policy_warns_once_naming_the_absent_protection(caplog, monkeypatch):
    monkeypatch.setattr(sandbox_isolation, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="trl_agentic.envs.sandbox_isolation"):
        env = PythonSandboxEnv(isolation="best_effort", without=("bwrap", "cpu_cgroup"))
        PythonSandboxEnv(isolation="best_effort", without=("bwrap", "cpu_cgroup"))
    assert env.mechanisms == frozenset({"memory_cgroup", "pids_cgroup"})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert (
        sandbox_isolation.PROTECTS["bwrap"] in warnings[0] and sandbox_isolation.PROTECTS["cpu_cgroup"] in warnings[0]
    )
    assert sandbox_isolation.PROTECTS["memory_cgroup"] not in warnings[0]


def test_a_sandbox_that_cannot_start_is_an_infrastructure_error(monkeypatch):
    env = PythonSandboxEnv()
    # bubblewrap vanished after the start-up check (or the kernel refuses it now): the launcher's exec fails.
    monkeypatch.setattr(sandbox_process.shutil, "which", lambda name: "/nonexistent/bwrap")  # (shutil's own)
    with pytest.raises(SandboxUnavailable, match="did not start"):
        env.python("1")
    assert env.last_error_type == "SandboxUnavailable"
    monkeypatch.undo()
    assert env.python("1 + 1") == "2"  # retried later, it works
    env._close()


def test_a_sandbox_that_cannot_join_its_cgroup_is_an_infrastructure_error(monkeypatch):
    """The launcher says so on its stderr and exits with its own code: the sandbox is unavailable (not the model's).
    The code alone is not enough: a sandbox's processes could exit with it."""
    assert PythonSandboxEnv().mechanisms & {"memory_cgroup", "pids_cgroup"}  # the suite's sandboxes need cgroups
    monkeypatch.setattr(
        sandbox_process.CellCgroup, "procs_files", property(lambda self: ["/nonexistent/cgroup.procs"])
    )
    env = PythonSandboxEnv()
    with pytest.raises(SandboxUnavailable, match="could not join its cgroup: cannot join the sandbox cgroup"):
        env.python("1")
    monkeypatch.undo()
    assert env.python("1 + 1") == "2"
    env._close()


def test_the_python_task_passes_the_policy_through(monkeypatch):
    from trl_agentic.tasks import TaskArguments, build_task

    with pytest.raises(ValueError, match="sandbox_isolation"):
        TaskArguments(task="python", sandbox_isolation="sometimes")
    task = build_task(TaskArguments(task="python", sandbox_isolation="best_effort", num_train_tasks=2))
    assert task.environment_factory().isolation_policy == "best_effort"
    assert build_task(TaskArguments(task="python", num_train_tasks=2)).environment_factory().isolation_policy == (
        "required"
    )
    # A machine that the default policy refuses fails when the task is built, before any model is loaded.
    monkeypatch.setitem(sandbox_isolation._probed, "pids_cgroup", "no writable `pids` cgroup controller")
    with pytest.raises(SandboxUnavailable, match="pids cgroup"):
        build_task(TaskArguments(task="python", num_train_tasks=2))
    build_task(TaskArguments(task="python", sandbox_isolation="best_effort", num_train_tasks=2))


def test_a_venv_under_the_sandbox_directory_runs_from_its_own_mount(tmp_path):
    """A checkout cloned under `/tmp` has its venv there, where the sandbox mounts its own tmpfs. At its own path the
    venv was hidden by that tmpfs (`bwrap: execvp /tmp/c/.venv/bin/python: No such file or directory`), and bound on
    top of it would show up in the sandbox's directory: it is mounted at `RELOCATED_PYTHON` instead."""
    import subprocess
    import sys

    assert os.path.realpath(tmp_path).startswith(sandbox_isolation.SANDBOX_DIR + os.sep)  # the case under test
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [site] = venv.glob("lib/python*/site-packages")
    # The new venv imports trl_agentic and its dependencies from this session's paths.
    (site / "host.pth").write_text("\n".join(p for p in sys.path if p and os.path.isdir(p)) + "\n")
    (site / "marker_of_this_venv.py").write_text("")
    probe = (
        "import sys, os, shutil, marker_of_this_venv; "
        f"print(sys.prefix, sorted(os.listdir('/tmp')), os.path.exists({str(venv)!r}), shutil.which('python'))"
    )
    code = (
        "from trl_agentic.envs.python_sandbox import PythonSandboxEnv\n"
        "env = PythonSandboxEnv()\n"
        "env.reset()\n"
        f"print(env.python({probe!r}))\n"
        "print(env.isolation['filesystem'])\n"
        "env._close()\n"
    )
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    inside = sandbox_isolation.RELOCATED_PYTHON + "/0"
    # The venv's interpreter with the venv's packages, in bubblewrap's namespaces; nothing of the host's /tmp inside.
    assert result.stdout.splitlines() == [f"{inside} [] False {inside}/bin/python", "private"]


# -- what counts as a failed call (issue 35, item 2) -------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["best_effort"])
def test_printed_error_dict_is_a_result_not_a_failure(tiny_tokenizer, policy):
    """Model code printing `{'error': 'just a dict'}` ran fine: a result, whatever it looks like. 009b255 read the text
    as TRL's error rendering: a failed call, and with `ToolError` in `rollback_on_errors` a rollback and a negative row.
    A call that raises is a failure, recorded on its message (`tool_call_failed`), not in its text."""
    from rollout_helpers import ScriptBackend, call, run_tools_loop

    from trl_agentic.rollout.loop import LoopConfig

    env = EnvFactory(**POLICIES[policy])(timeout=30.0)
    try:
        env.reset()
        printing = call("python", code="print({'error': 'just a dict'})")
        raising = call("python", code="undefined_name")
        backend = ScriptBackend(tiny_tokenizer, [[raising], ["done<|im_end|>"]])
        config = LoopConfig(
            enable_tool_rollback=True,
            save_negative_samples=True,
            rollback_on_errors=["ToolError", "NameError"],
            infra_error_types=["InfrastructureError"],
        )
        _, _, (_, completions, _, _, n_calls, n_failures, _), result = run_tools_loop(
            backend, [printing], [{"python": env.python}], config, envs=[env]
        )
    finally:
        env._close()
    # The printing call stays in the trajectory as a result; the raising one was rolled back into a negative row.
    tools = [m for m in completions[0] if m["role"] == "tool"]
    assert [m["content"] for m in tools] == ["{'error': 'just a dict'}"]
    assert (n_calls, n_failures) == (2, 1)
    assert result.stats.rollback_attempts == 1
    from trl_agentic.errors import tool_call_failed

    assert not tool_call_failed(tools[0]) and result.tool_failed == [[False]]
    (negative,) = result.extra_rows
    assert negative.error_types[0] == "NameError"
    (failed,) = [m for m in negative.messages if m["role"] == "tool"]
    assert tool_call_failed(failed)
    assert failed == {
        "role": "tool",
        "name": "python",
        "content": str({"error": "NameError: name 'undefined_name' is not defined"}),
    }
