"""`python -m trl_agentic.bench.multiturn` without running a step: a resumed run reuses only cells (and warm-start
adapters) measured with the same commit, cap, thread count and configuration; every child runs on one thread; the
table shows each cell's thread count, date and commit; the goals-table rows of docs/benchmarks.md are generated from
the recorded cells (docs/bench-data/multiturn-2026-11-27.json), not written by hand."""

from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path

import pytest

from trl_agentic.bench import multiturn as M

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "bench-data" / "multiturn-2026-11-27.json"


def _goals_rows() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text.split("## Goals side by side", 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_goals_rows_are_generated_from_the_recorded_cells():
    data = json.loads(RECORDED.read_text())
    doc = _goals_rows()
    generated = M.summary_rows(data)
    assert [label.split(",")[0] for label, *_ in generated] == [
        "BFCL GRPO step of 8 conversations",
        "Log-search GRPO step",
        "Text-world (RLVCR) GRPO step",
    ]
    for label, value, goal, met in generated:
        assert label in doc, label
        assert doc[label][:3] == [value, goal, "–" if met is None else ("yes" if met else "no")], label
    bfcl = generated[0]
    # Judged on CPU time (one thread), as the doc does; wall beside it.
    assert bfcl[1].startswith("33.3 min of CPU time on 1 thread (54.8 min wall")
    assert bfcl[3] is False


@pytest.fixture
def fake_children(monkeypatch, tmp_path):
    calls = []

    def run_child(argv, log, python=None):
        calls.append(argv)
        task = argv[argv.index("--task") + 1]
        if argv[1] == "warmstart":
            os.makedirs(tmp_path / "work" / task / "adapter", exist_ok=True)
            return {"adapter": "a", "seconds": 1.0, "losses": [1.0, 0.5]}
        return {"step_s": 1.0, "step_cpu_s": 1.0, "threads": 1, "generation": {}, "loop": {}, "cache": []}

    monkeypatch.setattr(M, "_run_child", run_child)
    monkeypatch.setattr(M, "_commit", lambda: "abc")
    return calls


def _steps(calls):
    return [(a[a.index("--task") + 1], a[a.index("--variant") + 1]) for a in calls if a[1] == "step"]


def test_resume_reuses_only_matching_cells(fake_children, tmp_path):
    work, path = str(tmp_path / "work"), str(tmp_path / "cells.json")
    variants = ("reuse_cap", "reuse", "off")
    data = M.run(["logsearch"], variants, 256, work, path, log=lambda m: None)
    assert _steps(fake_children) == [("logsearch", v) for v in variants]
    assert data["cells"]["logsearch"]["reuse"]["provenance"] == {
        "commit": "abc",
        "cap": None,
        "threads": 1,
        "config_hash": M.config_hash("logsearch", "reuse", 256),
    }
    assert data["cells"]["logsearch"]["reuse_cap"]["provenance"]["cap"] == 256
    # Same commit, cap, threads, config: nothing runs again.
    fake_children.clear()
    M.run(["logsearch"], variants, 256, work, path, log=lambda m: None)
    assert fake_children == []
    # Another cap: only the capped variant is measured again, and the file's cap is the new one.
    data = M.run(["logsearch"], variants, 128, work, path, log=lambda m: None)
    assert _steps(fake_children) == [("logsearch", "reuse_cap")]
    assert data["cap"] == 128 and data["cells"]["logsearch"]["reuse_cap"]["provenance"]["cap"] == 128
    # Another commit: the warm start and every cell are measured again.
    fake_children.clear()
    M._commit = lambda: "def"  # restored by monkeypatch at teardown
    M.run(["logsearch"], variants, 128, work, path, log=lambda m: None)
    assert [a[1] for a in fake_children] == ["warmstart", "step", "step", "step"]


def test_cells_recorded_without_provenance_are_not_reused(fake_children, tmp_path):
    """The 2026-11-27 file (no commit, cap or config per cell) and an adapter left in the work folder: both were
    reused silently before."""
    work, path = tmp_path / "work", tmp_path / "cells.json"
    recorded = json.loads(RECORDED.read_text())
    recorded["cells"] = {"logsearch": recorded["cells"]["logsearch"]}
    path.write_text(json.dumps(recorded))
    (work / "logsearch" / "adapter").mkdir(parents=True)
    (work / "logsearch" / "adapter" / "adapter_config.json").write_text("{}")
    M.run(["logsearch"], ("reuse", "off"), 256, str(work), str(path), log=lambda m: None)
    assert [a[1] for a in fake_children] == ["warmstart", "step", "step"]


def test_children_run_on_one_thread(monkeypatch):
    seen = {}

    def fake_run(command, env, **kwargs):
        seen.update(env)
        return types.SimpleNamespace(returncode=0, stdout='{"ok": 1}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert M._run_child(["--child", "step"], log=lambda m: None) == {"ok": 1}
    assert seen["OMP_NUM_THREADS"] == "1" and M.THREADS == 1


def test_table_shows_threads_dates_and_unrecorded_commits():
    text = M.render(json.loads(RECORDED.read_text()), "cmd")
    row = next(line for line in text.splitlines() if line.startswith("| bfcl |"))
    assert row.endswith("| 1 | 2026-11-27 09:10 | not recorded |")
    assert "nothing checked that they were measured with the same code" in text
