"""The CPU-settings benchmark at its smallest size: each setting runs in its own process with the allocator it names
(tcmalloc is mapped exactly when asked for), and bfloat16 autocast computes the same loss as float32 up to bf16
rounding; settings the machine cannot run are reported with their reason, not dropped."""

import json
import math
import subprocess
import types

from trl_agentic.bench import cpu_settings
from trl_agentic.bench.cpu_settings import bf16_native, render, run, tcmalloc_path


def test_each_setting_runs_with_the_allocator_and_precision_it_names(tiny_model_dir):
    data = run(tiny_model_dir, batch=1, length=16, repeats=1, settings=(("float32", False), ("bf16", True)), rounds=2)
    ran = {r["name"]: r for r in data["results"]}
    skipped = dict(data["skipped"])
    assert set(ran) | set(skipped) == {"float32, glibc malloc", "bf16, tcmalloc"}
    assert ran["float32, glibc malloc"]["tcmalloc_mapped"] is False
    if tcmalloc_path() is None or not bf16_native():
        assert "bf16, tcmalloc" in skipped
    else:
        bf16 = ran["bf16, tcmalloc"]
        assert bf16["tcmalloc_mapped"] is True
        assert math.isclose(bf16["loss"], ran["float32, glibc malloc"]["loss"], rel_tol=0.02)
    for r in data["results"]:
        assert r["seconds"] > 0 and r["peak_mb"] > 0
    table = render(data, "cmd")
    assert all(f"| {name} |" in table for name in set(ran) | set(skipped))


def test_peak_rss_is_the_setting_process_own(tiny_model_dir):
    """A setting's peak RSS does not depend on how much memory the process that started it holds (on Linux a forked
    child's `ru_maxrss` carries over the parent's resident memory, even across exec)."""
    setting = (("float32", False),)
    alone = run(tiny_model_dir, batch=1, length=16, repeats=1, settings=setting, rounds=1)["results"][0]["peak_mb"]
    ballast = bytearray(2 * 2**30)
    for i in range(0, len(ballast), 4096):  # resident, not just reserved
        ballast[i] = 1
    beside = run(tiny_model_dir, batch=1, length=16, repeats=1, settings=setting, rounds=1)["results"][0]["peak_mb"]
    del ballast
    # The tiny model's pass needs far less than the 2048 MB the parent held; the two runs do the same work.
    assert beside < 2048 and abs(beside - alone) < 256, (alone, beside)


def test_settings_alternate_over_rounds_and_report_median_and_range(monkeypatch):
    """The settings' processes alternate (A B C D, A B C D, ...) over at least 5 rounds by default, and each setting
    reports the median and range over the rounds; its ratio is the median of the ratios within each round. (The
    recorded runs ran A, B, C, D once each, and two of them disagreed: float32 tcmalloc / glibc 0.97 vs 1.20.)"""
    monkeypatch.setattr(cpu_settings, "tcmalloc_path", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(cpu_settings, "bf16_native", lambda: True)
    order = []
    # Seconds per pass of each setting in each round: the load rises in round 3 for everyone.
    seconds = {"float32": [10, 10, 20, 10, 10], "bf16": [5, 6, 10, 5, 4]}

    def fake_run(argv, env, **kwargs):
        precision, tcmalloc = argv[-1], "LD_PRELOAD" in env
        order.append((precision, tcmalloc))
        k = sum(1 for o in order if o == (precision, tcmalloc)) - 1
        s = seconds[precision][k] * (1.1 if tcmalloc else 1.0)
        out = {"seconds": s, "peak_mb": 100.0 + k, "tcmalloc_mapped": tcmalloc, "loss": 1.0}
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(out), stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    data = cpu_settings.run("m", batch=1, length=8)
    assert data["rounds"] >= 5
    assert order == list(cpu_settings.SETTINGS) * data["rounds"]
    rows = {r["name"]: r for r in data["results"]}
    base, bf16 = rows["float32, glibc malloc"], rows["bf16, glibc malloc"]
    assert base["seconds"] == 10 and base["seconds_range"] == [10, 20]
    assert bf16["seconds"] == 5 and bf16["seconds_range"] == [4, 10]
    ratios = sorted(b / f for b, f in zip(seconds["bf16"], seconds["float32"], strict=True))
    assert bf16["ratio"] == ratios[2] and bf16["ratio_range"] == [ratios[0], ratios[-1]]
    table = render(data, "cmd")
    assert "alternating over 5 rounds" in table
    assert (
        f"| bf16, glibc malloc | 5.00 (4.00–10.00) | {ratios[2]:.2f}× (range {ratios[0]:.2f}–{ratios[-1]:.2f}" in table
    )
