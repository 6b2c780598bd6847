"""Helpers for the Python sandbox tests: an env factory that always cleans up, and a host-side process census."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

from trl_agentic.envs.python_sandbox import PythonSandboxEnv

# The isolation configurations the sandbox tests run against. "best_effort" simulates a machine without bubblewrap
# (e.g. a default Docker container, where user namespaces are blocked) that still has cgroups.
POLICIES = {
    "required": {},
    "best_effort": {"isolation": "best_effort", "without": ("bwrap",)},
}


class EnvFactory:
    """Builds sandbox envs for one test and closes them afterwards, even when the test fails."""

    def __init__(self, **defaults):
        self.defaults = defaults
        self.envs: list[PythonSandboxEnv] = []

    def __call__(self, **kwargs) -> PythonSandboxEnv:
        env = PythonSandboxEnv(**{**self.defaults, **kwargs})
        self.envs.append(env)
        return env

    def close(self):
        for env in self.envs:
            env._close()


@contextmanager
def time_limit(env: PythonSandboxEnv, seconds: float):
    """Runs the cells of the block under a `seconds` limit, then restores the env's own (generous) one.

    A short limit is only ever given to a cell that never ends by itself (an endless loop, a fork bomb), so whether
    it is stopped does not depend on how loaded the machine is; every other cell, the replay of the episode after a
    restart included, runs under the generous default.
    """
    generous, env.timeout = env.timeout, seconds
    try:
        yield
    finally:
        env.timeout = generous


class SandboxProcesses:
    """Every process (zombies included) of one sandbox, found from the host however it got there.

    A process belongs to the sandbox if it is in its cgroup, in its session, in its pid namespace, or runs in the
    sandbox's host working directory (fallback without bubblewrap).
    """

    def __init__(self, env: PythonSandboxEnv):
        process = env._process
        assert process is not None, "start the interpreter first"
        self.session = process.pid
        self.workdir = process.workdir
        self.cgroup = process.cgroup
        self.own = 3 if process.namespaces else 2  # bubblewrap's monitor, supervisor, interpreter
        ours = os.readlink("/proc/self/ns/pid")
        self.pid_namespace = None
        for pid in self.cgroup.pids() if self.cgroup is not None else []:
            namespace = os.readlink(f"/proc/{pid}/ns/pid")
            if namespace != ours:
                self.pid_namespace = namespace

    def _belongs(self, pid: str) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                session = int(f.read().rsplit(")", 1)[1].split()[3])
            if session == self.session:
                return True
            if self.pid_namespace is not None and os.readlink(f"/proc/{pid}/ns/pid") == self.pid_namespace:
                return True
            if self.workdir is not None:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if self.workdir.encode() in f.read():
                        return True
                return os.readlink(f"/proc/{pid}/cwd").startswith(self.workdir)
            return False
        except (OSError, IndexError):
            return False  # exited while we looked

    def live(self) -> set[int]:
        found = {int(pid) for pid in os.listdir("/proc") if pid.isdigit() and self._belongs(pid)}
        if self.cgroup is not None:
            found |= set(self.cgroup.pids())
        return found

    def settle(self, expected: int, timeout: float = 30.0) -> set[int]:
        """Polls until exactly `expected` processes remain (zombies take a moment to be reaped); a hang, not a
        speed, is what the generous `timeout` catches."""
        deadline = time.monotonic() + timeout
        while True:
            live = self.live()
            if len(live) == expected or time.monotonic() > deadline:
                return live
            time.sleep(0.02)
