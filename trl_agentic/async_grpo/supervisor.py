"""Run a command so that it stops, within a grace period, when the process that started it dies (Linux).

Run as a script by path (`server.die_with_parent` builds the command line): it must start without importing
trl-agentic, TRL or torch, so it stays standard-library only (the package imports its helpers, `group_members` and
`set_parent_death_signal`, from it). Its arguments are the starter's pid, the grace in seconds, then the command.

The kernel sends this supervisor SIGTERM when its starter dies, however it dies (PR_SET_PDEATHSIG). It passes SIGTERM
on to the command, waits up to the grace for it to exit, and then SIGKILLs it. A SIGTERM alone was not enough for
vLLM's server: its graceful shutdown waits, with no time limit, for its open connections, and one that never closed
left the server running after its trainer was gone (CI, 2026-12-04). When the supervisor leads its own process group
(`VLLMServer` starts it with `start_new_session=True`), whatever is left of the group once the command has exited
(vLLM's engine processes, which vLLM's own shutdown stops) is SIGKILLed when the same grace, counted from the
SIGTERM (or from the command's own exit), is over. The supervisor exits with the command's status (128 + the signal's
number for a command a signal ended).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def group_members(pgrp: int) -> list[int]:
    """Live processes (not zombies) of process group `pgrp`, this one left out."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgrp:
            pids.append(int(entry))
    return pids


def set_parent_death_signal(sig: int, what: str, parent: str = "its starter") -> None:
    """Have the kernel send this process `sig` when the thread that started it dies (PR_SET_PDEATHSIG). A refused
    prctl (a seccomp sandbox) is said on stderr, naming `what` would then outlive `parent`, and the process runs on."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        print(
            f"trl-agentic: PR_SET_PDEATHSIG failed (errno {ctypes.get_errno()}): {what} will not stop if {parent} "
            "dies without stopping it",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str]) -> int:
    starter, grace, command = int(argv[0]), float(argv[1]), argv[2:]
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):  # each stops the command, not just us
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    set_parent_death_signal(signal.SIGTERM, "this server")
    if os.getppid() != starter:  # the starter died before the signal was armed
        return 143
    leader = os.getpgrp() == os.getpid()
    me = os.getpid()

    def arm_child():  # this interpreter has one thread, so a `preexec_fn` is safe here
        # The command also stops if this supervisor is SIGKILLed on its own.
        set_parent_death_signal(signal.SIGTERM, "the command")
        if os.getppid() != me:
            os._exit(143)

    child = subprocess.Popen(command, preexec_fn=arm_child)
    try:
        while not stopping:
            try:
                child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + grace
        if stopping and child.poll() is None:
            child.send_signal(signal.SIGTERM)  # again if it came to the whole group: vLLM ignores a second one
            try:
                child.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                print(f"trl-agentic: still running {grace:g} s after SIGTERM: SIGKILL", file=sys.stderr, flush=True)
    finally:  # also on an error in here: the command never outlives its supervisor
        if child.poll() is None:
            child.kill()
            child.wait()
    if leader:
        while group_members(os.getpgrp()) and time.monotonic() < deadline:
            time.sleep(0.2)
        killed = set()
        for _ in range(50):  # again until none is left: one may have forked while the others were being killed
            left = group_members(os.getpgrp())
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if killed:
            print(f"trl-agentic: SIGKILLed {len(killed)} process(es) left in the server's group", file=sys.stderr)
    rc = child.returncode
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
