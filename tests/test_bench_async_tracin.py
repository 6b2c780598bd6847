"""`trl_agentic.bench.async_tracin_refresh`: the report says what was measured (the run itself needs vLLM)."""

from __future__ import annotations

from trl_agentic.bench.async_tracin_refresh import render, speedup


def _data():
    one = [30.0, 34.0, 31.0]
    all_ = [9.0, 10.0, 11.0]
    measurements = []
    for a, b in zip(one, all_):
        measurements.append({"mode": "one at a time", "seconds": a, "rows": 8, "tokens": 700, "mean_reward": 0.1})
        measurements.append({"mode": "all at once", "seconds": b, "rows": 8, "tokens": 702, "mean_reward": 0.1})
    return {"policy": "tiny", "repeats": 3, "measurements": measurements, "cpus": 2, "load": [1.0, 1.0, 1.0]}


def test_the_speedup_is_the_ratio_of_the_medians():
    assert speedup(_data()) == 31.0 / 10.0


def test_the_section_lists_every_measurement_and_the_ratio():
    text = render(_data(), "cmd")
    assert "| one at a time | 31.0 | 30.0, 34.0, 31.0 | 700, 700, 700 |" in text
    assert "| all at once | 10.0 | 9.0, 10.0, 11.0 | 702, 702, 702 |" in text
    assert "**3.10x**" in text and "`cmd`" in text


def test_the_recorded_refresh_bench_is_what_docs_async_says():
    """docs/async.md quotes the recorded run of the bench (docs/bench-data); the numbers must be its measurements."""
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    data = json.loads((repo / "docs" / "bench-data" / "async-tracin-refresh-2026-12-01.json").read_text())
    doc = " ".join((repo / "docs" / "async.md").read_text().split())
    smollm2, tiny = data["runs"]["smollm2"], data["runs"]["tiny"]
    seconds = {
        (policy, mode): sorted(m["seconds"] for m in run["measurements"] if m["mode"] == mode)
        for policy, run in data["runs"].items()
        for mode in ("one at a time", "all at once")
    }
    one, together = seconds["smollm2", "one at a time"], seconds["smollm2", "all at once"]
    quoted = (
        f"**{one[1]:.1f} s against {together[1]:.1f} s (medians; {one[0]:.1f}–{one[2]:.1f} and "
        f"{together[0]:.1f}–{together[2]:.1f}), {speedup(smollm2):.2f}×**"
    )
    assert quoted in doc, quoted
    assert {m["tokens"] for m in smollm2["measurements"]} == {640} and "the same 640 model tokens" in doc
    assert {m["rows"] for m in tiny["measurements"]} == {12} and {m["tokens"] for m in tiny["measurements"]} == {35}
    tiny_one, tiny_together = seconds["tiny", "one at a time"][1], seconds["tiny", "all at once"][1]
    assert f"{tiny_one:.2f} s against {tiny_together:.2f} s, {speedup(tiny):.2f}×" in doc
