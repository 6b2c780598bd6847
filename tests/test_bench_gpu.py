"""`make bench-gpu` (trl_agentic/bench/gpu.py) as the GPU machine runs it: TRL from the wheel in third_party/, the
import stand-ins for datasets/pandas/pyarrow (forced here with BENCH_GPU_LIKE_DEVICE=1, although this venv has the
real packages), every section, on the tiny CPU shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_runs_every_section_with_only_the_carried_files(tmp_path):
    env = {**os.environ, "BENCH_GPU_LIKE_DEVICE": "1", "PYTHONPATH": ""}
    run = subprocess.run(
        # Budgets scaled up: a busy CI machine must not turn this into a test of the time limits.
        [
            sys.executable,
            "trl_agentic/bench/gpu.py",
            "--tiny",
            "--out",
            str(tmp_path),
            "--budget-scale",
            "10",
            "--total-budget",
            "6000",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "bench_gpu.json").read_text())
    notes = report["environment"]["notes"]
    assert "third_party/wheels/trl-1.16.0" in notes and "stand-ins for datasets, pandas, pyarrow" in notes
    results = report["results"]
    assert set(results) == {"features_off", "tracin_memory", "prefix_reuse", "tracin_step"}
    assert not [name for name, r in results.items() if "error" in r], results
    assert results["features_off"]["ratio"] > 0 and results["tracin_step"]["ratio"] > 0
    assert results["tracin_memory"]["step_ratio"] > 0
    reuse = results["prefix_reuse"]
    assert reuse["reused_tokens"] > 0 and reuse["same_turns"] == reuse["compared_turns"]  # float32: exact tokens
    assert "### Prefix reuse across turns" in (tmp_path / "bench_gpu.md").read_text()
