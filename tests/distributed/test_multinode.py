"""Two machines simulated on one host: the shipped multi-node accelerate configs and a two-"machine" CLI run.

`test_two_machines_match_one_machine` starts `accelerate launch` twice, as two nodes would: a CPU copy of
`configs/accelerate/zero3_multinode.yaml` with `num_machines: 2`, `num_processes: 2` (one process per machine),
`main_process_ip: 127.0.0.1`, `--machine_rank 0` and `--machine_rank 1`, each in its own working directory with its
own `output_dir` (node-local disks: nothing is shared but the host). Both run `python -m trl_agentic train` on the
calculator task with rollback and negative samples, DeepSpeed ZeRO-3 over gloo, 2 steps, and are compared with one
machine running 2 processes (`zero3.yaml`) on the same global batch.

The policy is the vLLM tier's tiny calculator policy (`tests/vllm_tier/vllm_helpers.py`, no vLLM needed): its
whole-turn tokens make it call the calculator with `1/0` (ZeroDivisionError, rolled back into a negative row) or
`6*7`, so rollbacks and negative rows happen.

Both layouts have the same global ranks, seeds and batch, and gloo carries every collective in both; with two
processes each reduction adds two operands, which is exact in either order. So the adapters (and rank 1's optimizer
shard) are compared bit for bit, not to a tolerance.

Every launch runs in its own process group under a timeout; when one machine fails, the other (which can wait in its
next collective until the process group's 30-minute timeout) is killed 10 s later.

Run: `python -m pytest tests/distributed/test_multinode.py -q -m distributed` (about 3 minutes on 2 CPU cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "accelerate"
VLLM_HELPERS = REPO / "tests" / "vllm_tier" / "vllm_helpers.py"
TIMEOUT = 600  # seconds per run: about 1 min normally, several on a loaded shared machine
GRPO_STAGE = "=== GRPO with the tool: 2 steps x 4 rollouts"  # cli.py's stage line: 4 = 2 per process x 2 processes
# Set by torchrun for each worker; inherited values would leak one launch's layout into the other.
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR")
DIST_VARS += ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_config(name: str, path: Path, **values) -> Path:
    """A CPU copy of a shipped accelerate config (the shipped files are GPU-ready), with `values` changed."""
    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    config.update(use_cpu=True, num_processes=2, mixed_precision="no", **values)
    path.write_text(yaml.safe_dump(config))
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("ACCELERATE_")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TRL_EXPERIMENTAL_SILENCE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    return env


def run_machines(machines: list[dict], task_config: Path, timeout: float = TIMEOUT) -> None:
    """Start one `accelerate launch -m trl_agentic train` per machine (`config`, `cwd`, `output_dir`, `log`), all on
    the same free port, and wait for all of them. Fails the test on a non-zero exit or a timeout; retries once when
    the port was taken meanwhile."""
    for attempt in range(2):
        returncodes = _run_once(machines, task_config, _free_port(), timeout)
        logs = [m["log"].read_text(errors="replace") for m in machines]
        port_taken = any("address already in use" in t.lower() or "utilizing it" in t for t in logs)
        if all(rc == 0 for rc in returncodes) or attempt or not port_taken:
            break
    if any(rc != 0 for rc in returncodes):
        tails = "\n".join(
            f"--- machine {i} (exit {rc}):\n{t[-5000:]}" for i, (rc, t) in enumerate(zip(returncodes, logs))
        )
        pytest.fail(f"accelerate launch failed:\n{tails}")


def _run_once(machines: list[dict], task_config: Path, port: int, timeout: float) -> list[int | None]:
    procs = []
    try:
        for m in machines:
            m["cwd"].mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(m["config"])]
            cmd += ["--main_process_port", str(port), *m.get("launch_args", [])]
            cmd += ["-m", "trl_agentic", "train", "--config", str(task_config), "--output_dir", str(m["output_dir"])]
            log = open(m["log"], "w")  # closed in `finally`
            # Own process group: on failure or timeout the launcher *and* its workers are killed.
            proc = subprocess.Popen(
                cmd, cwd=m["cwd"], env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            procs.append((proc, log))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p, _ in procs]
            if all(c is not None for c in codes):
                return codes
            if any(c not in (None, 0) for c in codes):
                time.sleep(10)  # let the others print their side of the failure, then stop them
                return [p.poll() if p.poll() is not None else -signal.SIGKILL for p, _ in procs]
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- machine {i}:\n{m['log'].read_text(errors='replace')[-3000:]}" for i, m in enumerate(machines)
                )
                pytest.fail(f"accelerate launch timed out after {timeout}s (hang?):\n{tails}")
            time.sleep(1)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


def _calculator_policy(path: Path) -> str:
    spec = importlib.util.spec_from_file_location("vllm_helpers", VLLM_HELPERS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_calculator_policy(path)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) checkpoint object, keyed by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def _step_logs(output_dir: Path) -> list[dict]:
    """The logged metrics of each step (trainer_state.json of the checkpoint), without the wall-clock ones."""
    state = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
    return [{k: v for k, v in h.items() if "time" not in k} for h in state["log_history"]]


# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, stage", [("zero2_multinode", 2), ("zero3_multinode", 3)])
def test_shipped_multinode_configs(name, stage):
    """GPU-ready (like the single-machine configs), two machines of 8 processes, torchrun per node, every field a
    user must change marked as such, and the same settings as the single-machine config otherwise."""
    text = (CONFIGS / f"{name}.yaml").read_text()
    config = yaml.safe_load(text)
    assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == stage
    assert config["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    assert config["use_cpu"] is False and config["mixed_precision"] == "bf16"
    assert config["num_machines"] == 2 and config["num_processes"] == 16 and config["machine_rank"] == 0
    assert config["main_process_ip"] and isinstance(config["main_process_port"], int)
    assert config["rdzv_backend"] == "static" and config["same_network"] is True
    marked = {line.split(":")[0] for line in text.splitlines() if "# CHANGE" in line and not line.startswith("#")}
    assert marked == {"machine_rank", "main_process_ip", "main_process_port", "num_machines", "num_processes"}
    for field in marked:  # and explained in the header
        assert f"#   {field}" in text, field
    assert "CPU" in text and "SLURM" in text
    single = yaml.safe_load((CONFIGS / f"zero{stage}.yaml").read_text())
    multi_only = {"main_process_ip", "main_process_port", "num_machines", "num_processes"}
    assert {k: v for k, v in config.items() if k not in multi_only} == {
        k: v for k, v in single.items() if k not in multi_only
    }


@pytest.mark.timeout(2 * TIMEOUT + 120)  # two runs (two machines, then one), each under its own TIMEOUT
def test_two_machines_match_one_machine(tmp_path):
    """Two "machines" (one process each, ZeRO-3, gloo) finish, and train exactly what one machine with two processes
    trains: the same adapter and rank-1 optimizer shard bit for bit, the same logged metrics (rollbacks and negative
    rows). Each machine writes what it should into its own output_dir: machine 0 the adapter and the
    checkpoint, machine 1 only its own DeepSpeed shard and RNG state."""
    policy = _calculator_policy(tmp_path / "policy")
    task = {
        "task": "calculator",
        "task_difficulty": "easy",
        "num_train_tasks": 8,
        "num_eval_tasks": 2,
        "model_name_or_path": policy,
        "use_peft": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_modules": "all-linear",
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "disable_tqdm": True,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 2,
        "seed": 0,
        "max_steps": 2,
        "learning_rate": 0.05,
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_completion_length": 64,
        "enable_tool_rollback": True,
        "rollback_on_errors": ["ZeroDivisionError"],
        "max_tool_retries": 2,
        "save_negative_samples": True,
    }
    task_config = tmp_path / "task.yaml"
    task_config.write_text(yaml.safe_dump(task))

    machines = [
        {
            "config": cpu_config("zero3_multinode", tmp_path / f"machine{r}.yaml", main_process_ip="127.0.0.1"),
            "launch_args": ["--machine_rank", str(r)],
            "cwd": tmp_path / f"machine{r}",
            "output_dir": tmp_path / f"machine{r}_out",
            "log": tmp_path / f"machine{r}.log",
        }
        for r in range(2)
    ]
    run_machines(machines, task_config)
    single = {
        "config": cpu_config("zero3", tmp_path / "single.yaml"),
        "cwd": tmp_path / "single",
        "output_dir": tmp_path / "single_out",
        "log": tmp_path / "single.log",
    }
    run_machines([single], task_config)

    # One process per machine, in a world of 2 (the stage line counts the rollouts of all processes); one machine ran
    # both processes. Machine 1's process printed the step logs: it is local process 0 of its node.
    logs = [m["log"].read_text(errors="replace") for m in machines]
    assert [log.count(GRPO_STAGE) for log in logs] == [1, 1]
    assert single["log"].read_text(errors="replace").count(GRPO_STAGE) == 2
    assert all(log.count("{'loss': ") == 2 for log in logs)

    # What each machine wrote. Machine 1 (global rank 1): its ZeRO-3 shard and its RNG state, nothing else; machine
    # 0: the adapter and the rest of the checkpoint. Nothing in either working directory.
    out0, out1, out_single = (m["output_dir"] for m in (*machines, single))
    shard = "checkpoint-2/global_step2/zero_pp_rank_{}_mp_rank_00_{}_states.pt"
    rank_files = [
        {
            shard.format(r, "model"),
            shard.format(r, "optim"),
            f"checkpoint-2/rng_state_{r}.pth",
            f"checkpoint-2/trl_agentic_state_{r}.json",  # trl-agentic's own RNG, one per process
        }
        for r in (0, 1)
    ]
    assert _files(out1) == rank_files[1]
    files0 = _files(out0)
    assert rank_files[0] <= files0 and not rank_files[1] & files0
    assert {"adapter_model.safetensors", "checkpoint-2/adapter_model.safetensors", "checkpoint-2/latest"} <= files0
    assert "checkpoint-2/trainer_state.json" in files0
    assert _files(out_single) == files0 | rank_files[1]  # a shared output_dir gets the union
    assert [list(m["cwd"].iterdir()) for m in machines] == [[], []]

    # The same training: logged metrics (global reductions), adapter and rank 1's optimizer shard, bit for bit.
    steps = _step_logs(out0)
    assert steps == _step_logs(out_single)
    assert len(steps) == 2, steps
    # Rollbacks and negative rows happened (how many per step depends on what the random policy samples).
    assert sum(s["rollback/attempts"] for s in steps) > 0 and sum(s["negatives/rows"] for s in steps) > 0, steps
    from safetensors.torch import load_file

    adapter, reference = (load_file(d / "adapter_model.safetensors") for d in (out0, out_single))
    assert adapter.keys() == reference.keys() and adapter
    assert all(torch.equal(adapter[k], reference[k]) for k in reference)
    # lora_B starts at zero: a non-zero one shows the two steps trained.
    assert max(v.abs().max().item() for k, v in reference.items() if "lora_B" in k) > 0
    optim = shard.format(1, "optim")
    ours, ref = (_tensors(torch.load(d / optim, weights_only=False)) for d in (out1, out_single))
    assert ours.keys() == ref.keys() and any("exp_avg" in k for k in ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
