"""A per-sandbox `pids` cgroup that caps how many processes sandboxed code can create.

`RLIMIT_NPROC` is not enforced for root, so when the trainer runs as root (containers, CI) a fork bomb can only be
stopped by the cgroup `pids` controller. This module creates one child cgroup per sandbox process under our own
`pids` cgroup (cgroup v1 `pids` hierarchy or a delegated cgroup v2 subtree), sets `pids.max`, and removes it once the
sandbox is gone. Every function fails soft (returns `None`/`False`): without a writable `pids` controller the sandbox
falls back to `RLIMIT_NPROC` (effective for non-root users only).
"""

import errno
import os
import time
import uuid

_PREFIX = "trl_agentic_sandbox_"
_UNSET = object()
_base_dir = _UNSET  # cached result of `_find_base_dir`


def _own_cgroup_paths() -> dict[str, str]:
    # /proc/self/cgroup lines are "id:controllers:path"; cgroup v2 has id 0 and empty controllers.
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else ["<v2>"]:
                paths[controller] = path
    return paths


def _candidate_dirs() -> list[str]:
    own = _own_cgroup_paths()
    candidates = []
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 4:
                continue
            mount_point, fs_type, options = fields[1], fields[2], fields[3].split(",")
            if fs_type == "cgroup" and "pids" in options and "pids" in own:
                candidates.append(os.path.join(mount_point, own["pids"].lstrip("/")))
            elif fs_type == "cgroup2" and "<v2>" in own:
                candidates.append(os.path.join(mount_point, own["<v2>"].lstrip("/")))
    return candidates


def _find_base_dir() -> str | None:
    # Probe by creating a child: only a child of a cgroup with the pids controller gets a `pids.max` file.
    for base in _candidate_dirs():
        probe = os.path.join(base, f"{_PREFIX}probe_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        try:
            os.mkdir(probe)
        except OSError:
            continue
        try:
            if os.path.exists(os.path.join(probe, "pids.max")):
                return base
        finally:
            _rmdir_quietly(probe)
    return None


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
        if not name.startswith(_PREFIX):
            continue
        owner = name[len(_PREFIX) :].split("_")[-2]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            _rmdir_quietly(os.path.join(base, name))


def pids_cgroup_base() -> str | None:
    """
    Returns the cgroup directory under which sandbox cgroups are created, or `None` if no `pids` controller is writable.

    The result is computed once per process (the first call also removes cgroups leaked by dead trainers).

    Returns:
        `str` or `None`: The base directory, e.g. `"/sys/fs/cgroup/pids"`.
    """
    global _base_dir
    if _base_dir is _UNSET:
        try:
            _base_dir = _find_base_dir()
        except OSError:
            _base_dir = None
        if _base_dir is not None:
            _sweep_stale(_base_dir)
    return _base_dir


def create_pids_cgroup(max_pids: int) -> str | None:
    """
    Creates a fresh cgroup limited to `max_pids` tasks (processes and threads).

    Args:
        max_pids (`int`):
            Value written to `pids.max`.

    Returns:
        `str` or `None`: The cgroup directory (a process joins it by writing its pid to `cgroup.procs`), or `None` if
        cgroups are unavailable.
    """
    base = pids_cgroup_base()
    if base is None:
        return None
    path = os.path.join(base, f"{_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_pids))
    except OSError:
        _rmdir_quietly(path)
        return None
    return path


def remove_pids_cgroup(path: str, timeout: float = 2.0) -> bool:
    """
    Removes a sandbox cgroup, waiting up to `timeout` seconds for its last (zombie) tasks to be reaped.

    Args:
        path (`str`):
            A directory returned by `create_pids_cgroup`.
        timeout (`float`, *optional*, defaults to `2.0`):
            How long to retry while the kernel reports the cgroup busy.

    Returns:
        `bool`: Whether the cgroup is gone.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(0.01)


def cgroup_pids(path: str) -> list[int]:
    """
    Lists the processes currently in a cgroup.

    Args:
        path (`str`):
            A cgroup directory.

    Returns:
        `list[int]`: Their pids (empty if the cgroup is gone).
    """
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except OSError:
        return []
