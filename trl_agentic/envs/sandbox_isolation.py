"""What isolation the Python sandbox can get on this machine, the isolation policy, and the bubblewrap command line.

Mechanisms (each probed once per process):

- `"bwrap"`: [bubblewrap](https://github.com/containers/bubblewrap) (Debian/Ubuntu/Fedora package `bubblewrap`)
  runs the sandbox in fresh user, pid, network, mount, IPC and UTS namespaces with a new root that holds only the
  system and Python directories (read-only), a size-limited tmpfs as working directory, its own `/proc` and a minimal
  `/dev`. It needs unprivileged user namespaces (or root); in a default Docker/Kubernetes container they are usually
  blocked by seccomp, and the probe then records bubblewrap's own error.
- `"memory_cgroup"`, `"pids_cgroup"`, `"cpu_cgroup"`: whole-cell limits (see `sandbox_cgroup.py`).

Policy: `"required"` refuses to run without all of them (`SandboxUnavailable`, naming what is missing and the opt-in);
`"best_effort"` uses what is there and logs once, as a warning, which protections are absent.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

from .errors import SandboxUnavailable
from .sandbox_cgroup import available_controllers

logger = logging.getLogger(__name__)

POLICIES = ("required", "best_effort")
MECHANISMS = ("bwrap", "memory_cgroup", "pids_cgroup", "cpu_cgroup")
# What each mechanism protects: the text of the refusal / warning when it is missing.
PROTECTS = {
    "bwrap": (
        "bubblewrap namespaces (without them: the network is blocked only at the Python `socket` level, the host "
        "filesystem is readable and writable with the trainer's uid, the code can signal the trainer's processes, and "
        "it can move itself out of its memory, pids and cpu cgroups, which the trainer's uid owns, so those limits "
        "hold only for code that does not try)"
    ),
    "memory_cgroup": "a memory cgroup (without it: the memory limit is per process, not for the whole cell)",
    "pids_cgroup": "a pids cgroup (without it: no process limit for root, and a per-user one otherwise)",
    "cpu_cgroup": "a cpu cgroup (without it: a cell may use every core until its wall-clock limit)",
}
CHILD_PATH = "/.trl_agentic_sandbox_child.py"  # where the child script is mounted inside the sandbox
SANDBOX_DIR = "/tmp"  # the sandbox's working directory, HOME and TMPDIR: a tmpfs of its own
# Where a Python directory that lives under SANDBOX_DIR on the host (a checkout cloned into /tmp and its venv) is
# mounted inside instead: at its own path it would either be hidden by the tmpfs or show up in the sandbox's directory.
RELOCATED_PYTHON = "/.trl_agentic_python"
SANDBOX_UID = 1000  # the sandbox runs as a non-root user of its user namespace: no capabilities after exec
_ETC = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/localtime",
    "/etc/mime.types",
    "/etc/nsswitch.conf",
)
_probed: dict[str, str | None] = {}
_warned: set[tuple[str, ...]] = set()


def python_paths() -> list[str]:
    """The directories the sandboxed interpreter needs: the venv and the base installation (read-only inside)."""
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    paths = sorted(os.path.realpath(p) for p in paths if p and os.path.isdir(p))
    # Outer directories first; a directory inside one already bound is skipped.
    kept: list[str] = []
    for path in paths:
        if not any(path == k or path.startswith(k + os.sep) for k in kept):
            kept.append(path)
    return kept


def python_mounts() -> list[tuple[str, str]]:
    """`(host path, path inside the sandbox)` of each of [`python_paths`]: the same path, except under SANDBOX_DIR."""
    mounts, relocated = [], 0
    for path in python_paths():
        if path == SANDBOX_DIR or path.startswith(SANDBOX_DIR + os.sep):
            mounts.append((path, f"{RELOCATED_PYTHON}/{relocated}"))
            relocated += 1
        else:
            mounts.append((path, path))
    return mounts


def sandbox_executable() -> str:
    """`sys.executable` as the sandbox sees it. A venv's interpreter keeps its venv path (not the base interpreter's it
    links to), so that it finds its `pyvenv.cfg` and the venv's packages."""
    directory, name = os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable)
    for host, inside in python_mounts():
        if directory == host or directory.startswith(host + os.sep):
            return os.path.join(inside + directory[len(host) :], name)
    return sys.executable


def bwrap_command(
    bwrap: str,
    *,
    allow_network: bool,
    disk_bytes: int,
    shm_bytes: int,
    child_script: str,
    argv: list[str],
    env: dict[str, str] | None = None,
) -> list[str]:
    """
    The bubblewrap command line that runs `argv` inside the sandbox.

    Args:
        bwrap (`str`): Path of the `bwrap` executable.
        allow_network (`bool`): Keep the host's network namespace.
        disk_bytes (`int`): Size of the working directory's tmpfs.
        shm_bytes (`int`): Size of the private `/dev/shm` tmpfs.
        child_script (`str`): Host path of `_sandbox_child.py`, mounted read-only at `CHILD_PATH`.
        argv (`list[str]`): The command to run inside.
        env (`dict[str, str]`, *optional*): Its whole environment (nothing else is inherited).

    Returns:
        `list[str]`: The full command.
    """
    command = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns"]
    if allow_network:
        command.append("--share-net")
    command += [
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
        "--die-with-parent",  # the trainer dies: every process of the sandbox dies
        "--new-session",  # no TIOCSTI into the trainer's terminal
        "--as-pid-1",  # our supervisor is pid 1: when it exits the kernel kills everything else
        "--clearenv",
    ]  # fmt: skip
    for name, value in (env or {}).items():
        command += ["--setenv", name, value]
    command += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            command += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            command += ["--ro-bind", top, top]
    for path in _ETC:
        command += ["--ro-bind-try", path, path]
    command += [
        "--ro-bind", child_script, CHILD_PATH,
        "--proc", "/proc",
        "--dev", "/dev",
        "--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/dev/shm",
        "--perms", "0700", "--size", str(disk_bytes), "--tmpfs", SANDBOX_DIR,
    ]  # fmt: skip
    for host, inside in python_mounts():
        command += ["--ro-bind", host, inside]
    command += [
        "--remount-ro", "/dev",
        "--remount-ro", "/",
        "--chdir", SANDBOX_DIR,
        "--",
        *argv,
    ]  # fmt: skip
    return command


def _probe_bwrap() -> str | None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "`bwrap` is not installed (Debian/Ubuntu: `apt-get install bubblewrap`)"
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
    command = bwrap_command(
        bwrap,
        allow_network=False,
        disk_bytes=1 << 20,
        shm_bytes=1 << 20,
        child_script=child,
        argv=[sandbox_executable(), "-I", "-S", "-c", "import os; os.listdir('/tmp')"],
    )
    try:
        result = subprocess.run(command, capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`bwrap` failed to run: {exc}"
    if result.returncode != 0:
        detail = result.stderr.decode("utf-8", "replace").strip()[-300:]
        return f"`bwrap` cannot create the namespaces here ({detail or f'exit code {result.returncode}'})"
    return None


def probe_mechanisms() -> dict[str, str | None]:
    """
    Which isolation mechanisms this machine gives the sandbox, computed once per process.

    Returns:
        `dict[str, str | None]`: For each of `MECHANISMS`, None when available, else why not.
    """
    if not _probed:
        controllers = available_controllers()
        _probed["bwrap"] = _probe_bwrap()
        for controller in ("memory", "pids", "cpu"):
            _probed[f"{controller}_cgroup"] = (
                None
                if controller in controllers
                else f"no writable `{controller}` cgroup controller (cgroup v1, or a delegated cgroup v2 subtree)"
            )
    return dict(_probed)


def resolve_isolation(policy: str, without=()) -> frozenset[str]:
    """
    Applies the isolation policy: the mechanisms to use, or `SandboxUnavailable` when a required one is missing.

    Args:
        policy (`str`): `"required"` or `"best_effort"`.
        without (`Iterable[str]`): Mechanisms to treat as missing (to test the refusal and fallback paths, or to
            leave one out on purpose).

    Returns:
        `frozenset[str]`: The mechanisms to use.
    """
    if policy not in POLICIES:
        raise ValueError(f"`isolation` must be one of {POLICIES}, got {policy!r}.")
    unknown = set(without) - set(MECHANISMS)
    if unknown:
        raise ValueError(f"unknown isolation mechanisms {sorted(unknown)}; known: {MECHANISMS}.")
    probed = probe_mechanisms()
    missing = {name: ("disabled by the caller" if name in without else reason) for name, reason in probed.items()}
    missing = {name: reason for name, reason in missing.items() if reason is not None}
    if missing and policy == "required":
        lines = "\n".join(f"- {PROTECTS[name]}: {reason}" for name, reason in missing.items())
        raise SandboxUnavailable(
            "The Python sandbox cannot isolate model-written code on this machine; missing:\n"
            f"{lines}\n"
            "Install bubblewrap / run where user namespaces and cgroups are available, or accept weaker isolation "
            "with `PythonSandboxEnv(isolation='best_effort')` (CLI: `--sandbox_isolation best_effort`)."
        )
    if missing and tuple(sorted(missing)) not in _warned:
        _warned.add(tuple(sorted(missing)))
        logger.warning(
            "PythonSandboxEnv(isolation='best_effort'): running model-written code WITHOUT %s.",
            "; ".join(f"{PROTECTS[name]} [{reason}]" for name, reason in missing.items()),
        )
    return frozenset(name for name in MECHANISMS if name not in missing)
