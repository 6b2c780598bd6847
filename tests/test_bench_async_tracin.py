"""`trl_agentic.bench.async_tracin_refresh`: the report says what was measured (the run itself needs vLLM)."""

from __future__ import annotations

from trl_agentic.bench.async_tracin_refresh import render, speedup


def _data():
    one = [30.0, 34.0, 31.0]
    all_ = [9.0, 10.0, 11.0]
    measurements = []
    for a, b in zip(one, all_):
        measurements.append(
            {"mode": "one at a time", "seconds": a, "trajectories": 8, "tokens": 700, "mean_reward": 0.1}
        )
        measurements.append(
            {"mode": "all at once", "seconds": b, "trajectories": 8, "tokens": 702, "mean_reward": 0.1}
        )
    return {"policy": "tiny", "repeats": 3, "measurements": measurements, "cpus": 2, "load": [1.0, 1.0, 1.0]}


def test_the_speedup_is_the_ratio_of_the_medians():
    assert speedup(_data()) == 31.0 / 10.0


def test_the_section_lists_every_measurement_and_the_ratio():
    text = render(_data(), "cmd")
    assert "| one at a time | 31.0 | 30.0, 34.0, 31.0 | 700, 700, 700 |" in text
    assert "| all at once | 10.0 | 9.0, 10.0, 11.0 | 702, 702, 702 |" in text
    assert "**3.10x**" in text and "`cmd`" in text
