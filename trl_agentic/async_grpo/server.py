"""A local vLLM OpenAI server for the asynchronous trainer (tests, the example, the benchmark, `vllm_server_start`).

`VLLMServer` starts `python -m vllm.entrypoints.openai.api_server` with what TRL's `AsyncGRPOTrainer` needs for the
adapter-only sync (`trl_agentic.vllm_lora.lora_server_command`: `--enable-lora`, runtime adapter loading, dev mode
for `/server_info` and `/pause`) plus `--max-loras` (TRL requires `max_staleness + 2` adapter slots), on a free
loopback port, in its own process group so that stopping it stops the engine processes too, and (on Linux) with a
parent-death signal: if the process that started it dies without stopping it (SIGTERM from a scheduler, SIGKILL, a
crash), a supervisor process (`supervisor.py`), which the kernel signals, sends the server SIGTERM, so that it shuts
its engine down instead of holding its memory and cores, and SIGKILL, with its engine processes, if it has not exited
`shutdown_grace` seconds later (vLLM's graceful shutdown can wait for a connection forever). On CPU it adds `--enforce-eager` and `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache, 1
unless set).

No prompt may be prefilled in chunks: TRL's worker sends every request with its own `seed`, and vLLM-CPU 0.31 crashes
the engine when it discards the token sampled after a non-final prefill chunk of a seeded request
(`vllm/v1/worker/gpu_model_runner.py` line 3701, `gen.set_offset(...)`: `RuntimeError: CPU Generator does not use
offset`; the server then closes every connection). So the server gets `--max-num-seqs` and `--max-num-batched-tokens
= max_num_seqs * max_model_len`: every scheduled prompt fits in one step and is never chunked.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from .supervisor import group_members

__all__ = ["VLLMServer", "die_with_parent", "free_port"]

_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# Started by path, not imported: the supervisor needs nothing but the standard library.
_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")

SHUTDOWN_GRACE_S = 30.0


def die_with_parent(argv: list[str], grace: float = SHUTDOWN_GRACE_S) -> list[str]:
    """`argv` run under a supervisor (`supervisor.py`) that stops it when the process that starts it dies, however it
    dies (Linux; elsewhere `argv` unchanged): SIGTERM, and SIGKILL if it is still running `grace` seconds later; when
    the supervisor leads its process group (started with `start_new_session=True`), what is left of the group then is
    SIGKILLed too. The kernel ties the parent-death signal to the starting *thread*: start it from the main thread (or
    a thread that lives as long as the command should)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    # -I: the supervisor's folder, PYTHONPATH and user site-packages stay off its import path.
    return [sys.executable, "-I", _SUPERVISOR, str(os.getpid()), f"{grace:g}", *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """Start (and stop) a local vLLM server; use as a context manager. `url` is its base URL once started.

    Args:
        model (`str`): Model folder (or name) to serve: the policy's base model.
        max_lora_rank (`int`, *optional*, defaults to `8`): The adapter rank the server must accept.
        max_loras (`int`, *optional*, defaults to `6`): Adapter slots (TRL needs `max_staleness + 2`).
        max_model_len (`int`, *optional*, defaults to `2048`): Prompt + completion cap.
        log_path (`str`, *optional*): Where the server's output goes (a temporary file otherwise).
        python (`str`, *optional*): Interpreter with vLLM; this one by default.
        timeout (`float`, *optional*, defaults to `600`): Seconds to wait for `/health`.
        extra_args (`list[str]`, *optional*): More server arguments.
        dtype (`str`, *optional*, defaults to `"float32"`): Weights' dtype (TRL's async trainer default is float32).
        max_num_seqs (`int`, *optional*, defaults to `16`): Concurrent sequences (see the module docstring).
        shutdown_grace (`float`, *optional*, defaults to `30`): Seconds the server has to exit after SIGTERM (its
            starter's death, or `stop()`) before it and its engine processes are SIGKILLed (by its supervisor; by
            `stop()` where there is none, off Linux, or it died).
    """

    def __init__(
        self,
        model: str,
        *,
        max_lora_rank: int = 8,
        max_loras: int = 6,
        max_model_len: int = 2048,
        log_path: str | None = None,
        python: str | None = None,
        timeout: float = 600.0,
        extra_args: list[str] | None = None,
        dtype: str = "float32",
        max_num_seqs: int = 16,
        shutdown_grace: float = SHUTDOWN_GRACE_S,
    ):
        self.model = str(model)
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.max_model_len = max_model_len
        self.log_path = log_path
        self.python = python or sys.executable
        self.timeout = timeout
        self.extra_args = list(extra_args or [])
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.shutdown_grace = shutdown_grace
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VLLMServer:
        import tempfile

        import requests

        from ..vllm_lora import lora_server_command

        self.port = free_port()
        argv, env = lora_server_command(
            self.model,
            max_lora_rank=self.max_lora_rank,
            port=self.port,
            host="127.0.0.1",
            python=self.python,
            extra_args=[
                "--enforce-eager",
                "--dtype",
                self.dtype,
                "--max-model-len",
                str(self.max_model_len),
                "--max-loras",
                str(self.max_loras),
                "--max-num-seqs",
                str(self.max_num_seqs),
                "--max-num-batched-tokens",
                str(self.max_num_seqs * self.max_model_len),
                *self.extra_args,
            ],
        )
        if self.log_path is None:
            self.log_path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1]
        full_env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
        full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        full_env.update(env)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                die_with_parent(argv, self.shutdown_grace),
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.timeout
        while True:
            if self.process.poll() is not None:
                self.kill()  # what is left of its group
                raise RuntimeError(f"The vLLM server exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"The vLLM server was not up after {self.timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(1)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    # The group, not `process`: `process` is the supervisor, which may have died on its own and left the server.
    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.process.pid, sig)
            return True
        except ProcessLookupError:  # nothing left in the group
            return False

    def _group_left(self) -> bool:
        if sys.platform.startswith("linux"):  # zombies left out: a container's pid 1 may never reap an orphan
            return bool(group_members(self.process.pid))
        return self._signal_group(0)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL to its process group), as a crash would."""
        if self.process is not None:
            self._signal_group(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """SIGTERM to the server's process group; SIGKILL to what is left of it `shutdown_grace` + 30 seconds later
        (the supervisor SIGKILLs the server at the grace), or at the grace when the supervisor is gone (killed on its
        own, as by the OOM killer) or there is none (off Linux): then nothing else enforces it."""
        if self.process is None:
            return
        supervised = sys.platform.startswith("linux") and self.process.poll() is None
        if not self._signal_group(signal.SIGTERM):
            return
        deadline = time.monotonic() + self.shutdown_grace + (30 if supervised else 0)
        while (self.process.poll() is None or self._group_left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
