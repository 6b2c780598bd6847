"""Numbers the docs quote from recorded benchmark output are the recorded ones: docs/tracin.md against the tables of
docs/benchmarks.md (the recorded `make bench` run), and docs/benchmarks.md against the recorded GPU JSON."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _rows(section_start: str) -> dict[str, list[str]]:
    """The table rows (cells by first cell) of the first markdown table after `section_start` in benchmarks.md."""
    text = (DOCS / "benchmarks.md").read_text()
    rows = {}
    for line in text[text.index(section_start) :].split("\n\n|", 1)[1].split("\n\n", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_tracin_memory_quotes_are_the_recorded_table():
    tracin = _flat((DOCS / "tracin.md").read_text())
    glibc = _rows("`python -m trl_agentic.bench.tracin_memory --allocator glibc`")
    tcmalloc = _rows("`python -m trl_agentic.bench.tracin_memory --allocator tcmalloc`")
    plain = glibc["plain"][0]
    fused, kept, two_pass = (
        glibc["TracIn fused (default)"],
        glibc["TracIn fused, inputs kept"],
        glibc["TracIn two-pass"],
    )
    refresh, ready = (
        glibc["V refresh alone (no training step)"],
        glibc["TracIn fused, V built before the window (the step alone)"],
    )
    assert f"{fused[1]}× of what the step adds on top of the loaded model ({fused[0]} vs {plain} MB)" in tracin
    assert f"costs {kept[1]}× ({kept[0]} MB)" in tracin
    assert f"is no better ({two_pass[1]}×, {two_pass[0]} MB)" in tracin
    assert f"adds {refresh[1]}× what a plain step adds ({refresh[0]} vs {plain} MB)" in tracin
    assert f"adds {ready[1]}× ({ready[0]} MB," in tracin
    t_fused = tcmalloc["TracIn fused (default)"]
    assert f"a plain step adds {tcmalloc['plain'][0]} MB" in tracin
    assert f"refresh included, {t_fused[0]} MB: **{t_fused[1]}×" in tracin and f"({t_fused[3]}× of the whole" in tracin
    assert f"against {fused[1]}× with glibc's malloc" in tracin


def test_tracin_end_to_end_quotes_are_the_recorded_table():
    tracin = _flat((DOCS / "tracin.md").read_text())
    rows = _rows("## TracIn end-to-end step at the defaults")
    plain, defaults = rows["TRL `GRPOTrainer`"], rows["TracIn, defaults"]
    steps, wall = int(defaults[0]), float(defaults[1])
    rollouts, v = (float(c.split()[0]) for c in defaults[5:7])
    assert f"{wall:.2f} − {v:.2f} − {rollouts:.2f} = {wall - v - rollouts:.2f} s vs {plain[1]} s" in tracin
    # V twice and the validation rollouts once in the 8-step cycle.
    assert (
        f"2 × {v * steps / 2:.1f} s wall" in tracin and f"{v * steps / 2 / float(plain[1]):.2f} of a plain" in tracin
    )
    assert f"({rollouts * steps:.1f} s wall, {rollouts * steps / float(plain[1]):.2f} of a plain step)" in tracin
    assert "21.0 s CPU" not in tracin  # from an unrecorded run


def test_gpu_completion_token_medians_are_the_recorded_json():
    text = (DOCS / "benchmarks.md").read_text()
    tokens = json.loads((DOCS / "bench-gpu" / "2026-11-27-h200-run3.json").read_text())
    tokens = tokens["results"]["features_off"]["tokens"]
    medians = {k: statistics.median(t["completion_tokens"] for t in tokens[k]) for k in ("trl", "ours")}
    quoted = re.search(r"TRL 711–962 \(median ([\d.]+)\), ours 847–1024 \(median ([\d.]+)\)", text)
    assert quoted and (float(quoted.group(1)), float(quoted.group(2))) == (medians["trl"], medians["ours"])


def test_vllm_sync_prose_divides_no_times_across_processes():
    for name in ("benchmarks.md", "vllm.md"):
        text = (DOCS / name).read_text()
        assert "less time than the trainer side alone" not in text, name  # part 1 over part 2: two processes
        assert "different processes, not side by side, so not divided into a ratio" in text, name
    assert "≈ 203.3 s" not in (DOCS / "vllm.md").read_text()  # the full sync's step is measured (98.0 s row)


def test_benchmarks_header_does_not_equate_the_cpu_section_with_quickstart():
    text = _flat((DOCS / "benchmarks.md").read_text().split("## Goals side by side")[0])
    assert "9.6 s vs 19.5 s" in text and "2 × 1400 tokens" in text and "2 × 1024 tokens" in text
