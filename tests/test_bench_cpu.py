"""The CPU-settings benchmark at its smallest size: each setting runs in its own process with the allocator it names
(tcmalloc is mapped exactly when asked for), and bfloat16 autocast computes the same loss as float32 up to bf16
rounding; settings the machine cannot run are reported with their reason, not dropped."""

import math

from trl_agentic.bench.cpu_settings import bf16_native, render, run, tcmalloc_path


def test_each_setting_runs_with_the_allocator_and_precision_it_names(tiny_model_dir):
    data = run(tiny_model_dir, batch=1, length=16, repeats=1, settings=(("float32", False), ("bf16", True)))
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
    alone = run(tiny_model_dir, batch=1, length=16, repeats=1, settings=setting)["results"][0]["peak_mb"]
    ballast = bytearray(2 * 2**30)
    for i in range(0, len(ballast), 4096):  # resident, not just reserved
        ballast[i] = 1
    beside = run(tiny_model_dir, batch=1, length=16, repeats=1, settings=setting)["results"][0]["peak_mb"]
    del ballast
    # The tiny model's pass needs far less than the 2048 MB the parent held; the two runs do the same work.
    assert beside < 2048 and abs(beside - alone) < 256, (alone, beside)
