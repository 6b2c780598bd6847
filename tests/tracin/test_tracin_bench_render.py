"""The TracIn benchmark reports: ratios and goal verdicts computed from the raw measurements (no model runs)."""

from trl_agentic.bench.tracin import EndToEndSettings, render_end_to_end, render_staleness
from trl_agentic.bench.tracin_memory import MemorySettings, render


def test_end_to_end_report_uses_means_over_the_cycle():
    result = {
        "times": {
            "plain": {"wall": [10.0, 10.0, 10.0, 10.0], "cpu": [5.0, 5.0, 5.0, 5.0]},
            "tracin": {"wall": [10.0, 14.0, 10.0, 14.0], "cpu": [5.0, 7.0, 5.0, 8.0]},
            "tracin_old": {"wall": [30.0], "cpu": [15.0]},
        },
        "parts": {"tracin": {"_tracin_validation_gradient": 4.0}, "tracin_old": {}},
        "val_rows": {"tracin": 8, "tracin_old": 16},
    }
    text = render_end_to_end(EndToEndSettings(steps=4), result, "cmd")
    assert "| TracIn, defaults | 4 | 12.00 | 1.20 | 6.25 | 1.25 | – | 1.00 s/step |" in text
    assert "| TracIn, former defaults | 1 | 30.00 | 3.00 |" in text
    assert "Goal ≤ 1.3×: met (1.20× wall, 1.25× CPU)" in text


def test_memory_report_compares_what_the_step_adds():
    results = {
        "plain": {"baseline_mb": 1000.0, "peak_mb": 1500.0, "seconds": 1.0, "parameters": 362e6},
        "fused": {"baseline_mb": 1000.0, "peak_mb": 1650.0, "seconds": 1.0, "parameters": 362e6},
    }
    text = render(MemorySettings(modes=("plain", "fused")), results, "cmd")
    assert "| TracIn fused (default) | 650 | 1.30 | 1650 | 1.10 |" in text
    assert "misses the goal" in text and "1.30×" in text


def test_memory_report_splits_the_fused_step_from_the_v_refresh():
    results = {
        "plain": {"baseline_mb": 1000.0, "peak_mb": 1500.0, "seconds": 1.0, "parameters": 362e6},
        "fused": {"baseline_mb": 1000.0, "peak_mb": 1650.0, "seconds": 1.0, "parameters": 362e6},
        "fused_v_ready": {"baseline_mb": 1040.0, "peak_mb": 1590.0, "seconds": 1.0, "parameters": 362e6},
        "v_refresh": {"baseline_mb": 1000.0, "peak_mb": 1600.0, "seconds": 1.0, "parameters": 362e6},
    }
    text = render(MemorySettings(modes=("plain", "fused", "fused_v_ready", "v_refresh")), results, "cmd")
    assert "the fused step alone (V built before the window) adds 1.10×" in text
    assert "the V refresh alone 1.20×" in text


def test_staleness_report_separates_fresh_reused_and_stale_v():
    def record(since_v, since_rollouts, agree):
        return {
            "steps_since_v": since_v,
            "steps_since_rollouts": since_rollouts,
            "agree_used_fresh": agree,
            "agree_used_fresh2": agree,
            "agree_fresh_fresh": 0.5,
            "corr_used_fresh": 0.1,
            "corr_fresh_fresh": 0.2,
        }

    text = render_staleness([record(0, 0, 1.0), record(1, 1, 0.5), record(0, 4, 0.75)], 1e-4, "cmd")
    assert "| all (3) | 0.75 |" in text
    assert "| V and rollouts of this step (1) | 1.00 |" in text
    assert "| V recomputed this step on reused rollouts (1) | 0.75 |" in text
    assert "| V from an earlier step (1) | 0.50 |" in text


def test_memory_report_names_the_allocator_and_an_unknown_one_is_refused(tmp_path):
    import pytest

    from trl_agentic.bench.tracin_memory import measure

    results = {
        "plain": {"baseline_mb": 1000.0, "peak_mb": 1500.0, "seconds": 1.0, "parameters": 362e6},
        "fused": {"baseline_mb": 1000.0, "peak_mb": 1550.0, "seconds": 1.0, "parameters": 362e6},
    }
    text = render(MemorySettings(modes=("plain", "fused"), allocator="tcmalloc"), results, "cmd")
    assert "allocator tcmalloc (preloaded)" in text and "meets the goal" in text
    with pytest.raises(ValueError, match="Unknown allocator 'jemalloc'"):
        measure(MemorySettings(allocator="jemalloc"), "plain", str(tmp_path))
