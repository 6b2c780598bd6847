"""One cgroup per sandbox: limits that hold for all processes of a cell together (memory, processes, CPU cores).

Per-process rlimits do not add up: 32 processes of 512 MiB each are 16 GiB, and `RLIMIT_NPROC` is not enforced for
root (nor, as measured, inside a user namespace whose owner is root). The kernel's cgroup controllers count every
process the sandbox starts, however it was started:

- `memory`: one limit for the cell's anonymous memory, page cache and the files it writes in its tmpfs; over it, the
  kernel's OOM killer ends a process of the cell (counted in `oom_kill`, which `oom_kills` reads);
- `pids`: one limit for its processes and threads (`fork` fails with `EAGAIN` past it);
- `cpu`: a CFS quota, so the cell uses at most `max_cpus` cores (its CPU time is at most `max_cpus` x wall time).

Works with cgroup v1 hierarchies (one per controller) and with a delegated cgroup v2 subtree (controllers enabled in
our cgroup's `cgroup.subtree_control`). A controller that is not writable is reported missing, never faked.
"""

from __future__ import annotations

import errno
import os
import time
import uuid

CONTROLLERS = ("memory", "pids", "cpu")
_PREFIX = "trl_agentic_sandbox_"
_V2 = "<v2>"
# The file that a child cgroup gets when the controller is enabled for it, and the one we write the limit to.
_LIMIT_FILES = {
    ("memory", 1): "memory.limit_in_bytes",
    ("pids", 1): "pids.max",
    ("cpu", 1): "cpu.cfs_quota_us",
    ("memory", 2): "memory.max",
    ("pids", 2): "pids.max",
    ("cpu", 2): "cpu.max",
}
_UNSET = object()
_bases = _UNSET  # controller -> (base directory, cgroup version), computed once per process


def _own_cgroup_paths() -> dict[str, str]:
    # /proc/self/cgroup lines are "id:controllers:path"; the cgroup v2 line has id 0 and no controllers.
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [_V2]:
                paths[controller] = path
    return paths


def _candidates() -> dict[str, tuple[str, int]]:
    own = _own_cgroup_paths()
    found: dict[str, tuple[str, int]] = {}
    with open("/proc/self/mounts") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:  # v1 hierarchies first: on hybrid machines the controllers live there
        if len(fields) >= 4 and fields[2] == "cgroup":
            options = fields[3].split(",")
            for controller in CONTROLLERS:
                if controller in options and controller in own:
                    found.setdefault(controller, (os.path.join(fields[1], own[controller].lstrip("/")), 1))
    for fields in mounts:
        if len(fields) >= 4 and fields[2] == "cgroup2" and _V2 in own:
            base = os.path.join(fields[1], own[_V2].lstrip("/"))
            try:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
            except OSError:
                continue
            for controller in CONTROLLERS:
                if controller in enabled:
                    found.setdefault(controller, (base, 2))
    return found


def _probe(candidates: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    # A controller is usable if we can create a child cgroup that has its limit file, and write to it.
    usable = {}
    for controller, (base, version) in candidates.items():
        probe = os.path.join(base, f"{_PREFIX}probe_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(probe)
        except OSError:
            continue
        try:
            limit_file = os.path.join(probe, _LIMIT_FILES[controller, version])
            if os.access(limit_file, os.W_OK) and os.access(os.path.join(probe, "cgroup.procs"), os.W_OK):
                usable[controller] = (base, version)
        finally:
            _rmdir_quietly(probe)
    return usable


def _rmdir_quietly(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _sweep_stale(base: str) -> None:
    # Cgroups left behind by trainers that were SIGKILLed; rmdir only succeeds once they are empty.
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if name.startswith(_PREFIX):
            owner = name[len(_PREFIX) :].split("_")[-2]
            if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                _rmdir_quietly(os.path.join(base, name))


def available_controllers() -> dict[str, tuple[str, int]]:
    """
    The cgroup controllers this process can give a sandbox, computed once per process.

    Returns:
        `dict[str, tuple[str, int]]`: For each usable controller among `"memory"`, `"pids"` and `"cpu"`, the
        directory under which sandbox cgroups are created and the cgroup version (1 or 2).
    """
    global _bases
    if _bases is _UNSET:
        try:
            _bases = _probe(_candidates())
        except OSError:
            _bases = {}
        for base in {base for base, _ in _bases.values()}:
            _sweep_stale(base)
    return dict(_bases)


class CellCgroup:
    """
    The cgroup(s) of one sandbox, with whole-cell limits. A process joins by writing its pid to every file of
    `procs_files`; its descendants stay in.

    Args:
        memory_bytes (`int`):
            Memory limit of all processes together (swap disabled where the kernel allows).
        max_pids (`int`):
            Process and thread limit.
        max_cpus (`float`):
            How many cores the processes may use together.
        controllers (`Iterable[str]`):
            Which controllers to use (a subset of `available_controllers()`).
    """

    def __init__(self, memory_bytes: int, max_pids: int, max_cpus: float, controllers):
        bases = available_controllers()
        self.dirs: dict[str, tuple[str, int]] = {}  # controller -> (cgroup directory, version)
        by_base: dict[tuple[str, int], str] = {}
        name = f"{_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"
        try:
            for controller in controllers:
                if controller not in bases:
                    continue
                if bases[controller] not in by_base:
                    path = os.path.join(bases[controller][0], name)
                    os.mkdir(path)
                    by_base[bases[controller]] = path
                self.dirs[controller] = (by_base[bases[controller]], bases[controller][1])
            for controller, (path, version) in self.dirs.items():
                self._set_limit(controller, path, version, memory_bytes, max_pids, max_cpus)
        except OSError:
            self.remove()
            raise

    @staticmethod
    def _set_limit(controller: str, path: str, version: int, memory_bytes: int, max_pids: int, max_cpus: float):
        def write(file: str, value, optional: bool = False):
            try:
                with open(os.path.join(path, file), "w") as f:
                    f.write(str(value))
            except OSError:
                if not optional:
                    raise

        if controller == "pids":
            write("pids.max", max_pids)
        elif controller == "memory" and version == 1:
            write("memory.limit_in_bytes", memory_bytes)
            write("memory.memsw.limit_in_bytes", memory_bytes, optional=True)  # absent without swap accounting
        elif controller == "memory":
            write("memory.max", memory_bytes)
            write("memory.swap.max", 0, optional=True)
        elif controller == "cpu" and version == 1:
            write("cpu.cfs_period_us", 100_000)
            write("cpu.cfs_quota_us", max(1000, int(max_cpus * 100_000)))
        else:
            write("cpu.max", f"{max(1000, int(max_cpus * 100_000))} 100000")

    @property
    def procs_files(self) -> list[str]:
        """`list[str]`: The `cgroup.procs` files a process writes its pid to, to join (one per distinct cgroup)."""
        return sorted({os.path.join(path, "cgroup.procs") for path, _ in self.dirs.values()})

    def pids(self) -> list[int]:
        """The processes currently in the cgroup (empty once it is removed)."""
        found: set[int] = set()
        for file in self.procs_files:
            try:
                with open(file) as f:
                    found |= {int(line) for line in f if line.strip()}
            except OSError:
                pass
        return sorted(found)

    def oom_kills(self) -> int:
        """How many processes the kernel killed because the cell went over its memory limit (0 without `memory`)."""
        if "memory" not in self.dirs:
            return 0
        path, version = self.dirs["memory"]
        try:
            with open(os.path.join(path, "memory.oom_control" if version == 1 else "memory.events")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, timeout: float = 2.0) -> bool:
        """
        Removes the cgroup(s), waiting up to `timeout` seconds for their last (zombie) tasks to be reaped.

        Returns:
            `bool`: Whether everything is gone.
        """
        deadline = time.monotonic() + timeout
        pending = sorted({path for path, _ in self.dirs.values()})
        while pending:
            for path in list(pending):
                try:
                    os.rmdir(path)
                    pending.remove(path)
                except FileNotFoundError:
                    pending.remove(path)
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        return False
            if pending:
                time.sleep(0.01)
        return True
