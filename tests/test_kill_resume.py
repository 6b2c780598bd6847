"""Kill-and-resume: a run with rollback, negatives and snapshots is SIGKILLed after a checkpoint; resuming continues
at the next step and reproduces the uninterrupted run's losses step for step."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "resumable_run.py"


def _env():
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""
    )
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def _losses(out: Path, pid: int) -> dict[int, float]:
    path = out / f"losses-{pid}.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tiny_model_dir, tmp_path):
    steps = 6
    ref_out, run_out = tmp_path / "ref", tmp_path / "run"
    ref = subprocess.run(
        [sys.executable, str(SCRIPT), tiny_model_dir, str(ref_out), str(steps)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _losses(ref_out, ref.args and _pid_of(ref_out))

    victim = subprocess.Popen(
        [sys.executable, str(SCRIPT), tiny_model_dir, str(run_out), str(steps)],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    marker = run_out / "checkpoint-2" / "trl_agentic_state.json"
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert victim.poll() is None, victim.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    for later in run_out.glob("checkpoint-*"):  # a checkpoint written between the marker and the kill
        if later.name != "checkpoint-2":
            import shutil

            shutil.rmtree(later)

    resumed = subprocess.run(
        [sys.executable, str(SCRIPT), tiny_model_dir, str(run_out), str(steps), str(run_out / "checkpoint-2")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _losses(run_out, _pid_of(run_out, exclude=victim.pid))
    assert sorted(after) == list(range(3, steps + 1))  # continued at the next step
    for step in range(3, steps + 1):
        assert after[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-9), (step, after, reference)
    # The run did something: losses differ between steps (not a constant curve).
    assert len({round(v, 9) for v in reference.values()}) > 1


def _pid_of(out: Path, exclude: int | None = None) -> int:
    pids = [int(p.stem.split("-")[1]) for p in out.glob("losses-*.jsonl")]
    pids = [p for p in pids if p != exclude]
    assert len(pids) == 1, pids
    return pids[0]
