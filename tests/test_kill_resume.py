"""Kill-and-resume: a LoRA run with rollback, negatives, snapshots and TracIn is SIGKILLed after a checkpoint; resuming
continues at the next step and reproduces the uninterrupted run's losses, TracIn validation gradients and selections
step for step."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "resumable_run.py"


def _env():
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""
    )
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def _records(out: Path, pid: int) -> dict[int, dict]:
    path = out / f"losses-{pid}.jsonl"
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def _tracin_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "tracin_state.pt", weights_only=True)


def _assert_same_tracin_state(left: dict, right: dict) -> None:
    assert {k: v for k, v in left.items() if k != "direction"} == {k: v for k, v in right.items() if k != "direction"}
    assert left["direction"].keys() == right["direction"].keys()
    for name, grad in left["direction"].items():
        assert torch.equal(grad["A"], right["direction"][name]["A"]), name
        assert torch.equal(grad["B"], right["direction"][name]["B"]), name


@pytest.mark.slow
@pytest.mark.timeout(3600)  # three short training runs; generous for a loaded 2-core machine
def test_sigkill_then_resume_matches_uninterrupted(tiny_model_dir, tmp_path):
    steps = 6
    ref_out, run_out = tmp_path / "ref", tmp_path / "run"
    ref = subprocess.run(
        [sys.executable, str(SCRIPT), tiny_model_dir, str(ref_out), str(steps)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _records(ref_out, _pid_of(ref_out))
    # TracIn ran and filtered: every step logged its selection, and some step dropped rows.
    assert all("tracin/selected_ratio" in reference[step]["tracin"] for step in reference)
    assert min(reference[step]["tracin"]["tracin/selected_ratio"] for step in reference) < 1.0
    # V is refreshed at steps 1 and 4 only (tracin_val_refresh_steps=3), so the resumed run's first step (3) can only
    # match with the V restored from checkpoint-2, not with one recomputed at the resumed weights.
    assert [step for step in reference if "tracin/val_grad_norm" in reference[step]["tracin"]] == [1, 4]
    assert reference[3]["tracin_v"] == reference[1]["tracin_v"] != reference[4]["tracin_v"]

    # The child's stderr goes to a file, not a pipe: a pipe nobody reads fills up and blocks the child mid-run.
    stderr_path = tmp_path / "victim.stderr"
    with open(stderr_path, "w") as stderr:
        victim = subprocess.Popen(
            [sys.executable, str(SCRIPT), tiny_model_dir, str(run_out), str(steps)],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    marker = run_out / "saved-2"  # written atomically by the script once checkpoint-2 is complete
    deadline = time.monotonic() + 1200  # a hang, not a speed: the test's own timeout is longer
    try:
        while not marker.exists():
            assert victim.poll() is None, stderr_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    assert marker.read_text() == str(run_out / "checkpoint-2")
    for later in run_out.glob("checkpoint-*"):  # a checkpoint written between the marker and the kill
        if later.name != "checkpoint-2":
            import shutil

            shutil.rmtree(later)

    resumed = subprocess.run(
        [sys.executable, str(SCRIPT), tiny_model_dir, str(run_out), str(steps), str(run_out / "checkpoint-2")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _records(run_out, _pid_of(run_out, exclude=victim.pid))
    assert sorted(after) == list(range(3, steps + 1))  # continued at the next step
    for step in range(3, steps + 1):
        got, want = after[step], reference[step]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-9), (step, after, reference)
        # The same V bit for bit (restored at step 3, then refreshed on the same schedule) and the same selection.
        assert (got["tracin_v"], got["tracin_refreshes"]) == (want["tracin_v"], want["tracin_refreshes"]), step
        assert got["tracin"] == pytest.approx(want["tracin"], rel=1e-6, abs=1e-9, nan_ok=True), (step, got, want)
    # The TracIn state in the checkpoints equals the uninterrupted run's: the one resumed from, and the ones after.
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        _assert_same_tracin_state(_tracin_state(run_out / name), _tracin_state(ref_out / name))
    # The run did something: losses differ between steps (not a constant curve).
    assert len({round(r["loss"], 9) for r in reference.values()}) > 1


def _pid_of(out: Path, exclude: int | None = None) -> int:
    pids = [int(p.stem.split("-")[1]) for p in out.glob("losses-*.jsonl")]
    pids = [p for p in pids if p != exclude]
    assert len(pids) == 1, pids
    return pids[0]
