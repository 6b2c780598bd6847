"""Fixtures of the vLLM tier (`make test-vllm`): the tiny calculator policy, and a vLLM OpenAI server for server mode."""

import os

import pytest

# vLLM on CPU: a fixed 1 GiB KV cache instead of a fraction of the machine's RAM. Set before vLLM is imported.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session", autouse=True)
def one_core_and_port_per_worker():
    """`make test` runs this tier on 2 pytest-xdist workers (about 6 min instead of 9-11 in one process: much of the
    tier waits on server start-ups and subprocesses).

    vLLM binds its engine's OpenMP threads to the cores its process may use (VLLM_CPU_OMP_THREADS_BIND=auto), so two
    unpinned workers would bind both engines to the same core: each worker is pinned to a core of its own, which its
    servers, trainers and subprocesses inherit. A colocated engine's torch.distributed group listens on MASTER_PORT,
    which TRL picks as "29500 if free": two workers checking at once both take it, so each worker gets a port of its
    own. A fixture, not module code: this conftest is imported by every tier's collection, and the other tiers'
    workers must keep both cores. (`--dist loadgroup`, which would keep the tests of one module-scoped server on one
    worker, does nothing with pytest 9.2 and xdist 3.8: xdist renames `item._nodeid`, which pytest no longer reads;
    such a server may so run on both workers.)
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        import socket

        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    yield


@pytest.fixture(scope="session")
def calculator_policy_dir(tmp_path_factory):
    from vllm_helpers import build_calculator_policy

    return build_calculator_policy(tmp_path_factory.mktemp("vllm") / "calculator-policy")


@pytest.fixture(scope="module")
def vllm_server(calculator_policy_dir, tmp_path_factory):
    """A vLLM OpenAI server (CPU) for the calculator policy, with LoRA support; yields its base URL."""
    import signal
    import socket
    import subprocess
    import time

    import requests
    from vllm_helpers import clean_env

    from trl_agentic.vllm_lora import lora_server_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv, env = lora_server_command(
        calculator_policy_dir,
        max_lora_rank=8,
        port=port,
        host="127.0.0.1",
        # The NCCL weight-transfer engine too (what `trl vllm-serve` adds), so TRL's own full sync can be tried.
        extra_args=["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048"]
        + ["--weight-transfer-config", '{"backend": "nccl"}'],
    )
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    with open(log_path, "w") as log:
        # Own process group: stopping it stops the engine-core and worker processes the server spawns.
        server = subprocess.Popen(
            argv, env=clean_env(**env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                pytest.fail(f"vLLM server exited ({server.returncode}):\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not up after 600 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
