"""The ablation's statistics (`trl_agentic.stats`) against closed forms, published quantiles and hand computations."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trl_agentic import stats


@pytest.mark.parametrize("p", [0.6, 0.8, 0.9, 0.975, 0.995, 0.3, 0.025])
def test_t_quantile_matches_the_closed_forms_of_one_and_two_degrees_of_freedom(p):
    # df = 1 is the Cauchy distribution: tan(pi (p - 1/2)); df = 2: (2p - 1) / sqrt(2 p (1 - p)).
    assert stats.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert stats.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [  # published two-sided 95 % and one-sided 80 % critical values (e.g. NIST/SEMATECH e-Handbook table 1.3.6.7.2)
        (0.975, 3, 3.182446305),
        (0.975, 4, 2.776445105),
        (0.975, 7, 2.364624252),
        (0.975, 9, 2.262157163),
        (0.975, 30, 2.042272456),
        (0.8, 4, 0.940964577),
        (0.95, 10, 1.812461123),
    ],
)
def test_t_quantile_matches_published_values(p, df, expected):
    assert stats.t_quantile(p, df) == pytest.approx(expected, abs=1e-7)


def test_t_cdf_matches_a_numerical_integral_of_the_density():
    # Simpson's rule on the t density, an independent computation of P(T <= t) for 9 degrees of freedom.
    df, t, n = 9, 0.8834, 20000

    def density(x):
        return (
            math.gamma((df + 1) / 2)
            / (math.sqrt(df * math.pi) * math.gamma(df / 2))
            * (1 + x * x / df) ** (-(df + 1) / 2)
        )

    h = t / n
    area = density(0) + density(t) + sum((4 if k % 2 else 2) * density(k * h) for k in range(1, n))
    assert stats.t_cdf(t, df) == pytest.approx(0.5 + area * h / 3, abs=1e-10)


def test_t_quantile_tends_to_the_normal_quantile():
    assert stats.t_quantile(0.975, 1e7) == pytest.approx(1.959963985, abs=1e-6)


@given(st.floats(-20, 20), st.sampled_from([1, 2, 3, 5, 12]))
def test_t_cdf_is_symmetric_and_inverts_the_quantile(t, df):
    assert stats.t_cdf(t, df) + stats.t_cdf(-t, df) == pytest.approx(1.0, abs=1e-12)
    p = stats.t_cdf(t, df)
    if 1e-9 < p < 1 - 1e-9:
        assert stats.t_quantile(p, df) == pytest.approx(t, abs=1e-6 * max(1, abs(t)))


def test_paired_t_interval_by_hand():
    # Differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1, se 0.1/sqrt(3); t_{0.975, 2} = 4.302652730 (closed form above).
    interval = stats.paired_t_interval([0.6, 0.7, 0.8], [0.5, 0.5, 0.5])
    half = 4.302652730 * 0.1 / math.sqrt(3)
    assert interval.mean == pytest.approx(0.2) and interval.sd == pytest.approx(0.1) and interval.n == 3
    assert interval.low == pytest.approx(0.2 - half) and interval.high == pytest.approx(0.2 + half)
    with pytest.raises(ValueError, match="same seeds"):
        stats.paired_t_interval([0.1, 0.2], [0.1])


def test_one_seed_has_no_interval_and_identical_seeds_a_point():
    one = stats.t_interval([0.3])
    assert one.mean == 0.3 and math.isnan(one.low) and math.isnan(one.high)
    same = stats.t_interval([0.25] * 4)
    assert (same.low, same.high) == (0.25, 0.25)


def test_minimum_detectable_effect_by_hand():
    # sd 0.1, 5 seeds: (t_{0.975,4} + t_{0.8,4}) * 0.1 / sqrt(5) with the published quantiles above.
    expected = (2.776445105 + 0.940964577) * 0.1 / math.sqrt(5)
    assert stats.minimum_detectable_effect(0.1, 5) == pytest.approx(expected, rel=1e-7)
    assert stats.minimum_detectable_effect(0.1, 1) == math.inf
    # More seeds, smaller effects; twice the noise, twice the effect.
    assert stats.minimum_detectable_effect(0.1, 10) < expected
    assert stats.minimum_detectable_effect(0.2, 5) == pytest.approx(2 * expected)


def test_seeds_needed_is_the_smallest_sufficient_count():
    n = stats.seeds_needed(0.1, 0.1)
    # (t_{.975,n-1} + t_{.8,n-1}) / sqrt(n) <= 1 first holds at n = 10 (9 seeds: (2.306 + 0.889) / 3 = 1.065).
    assert n == 10
    assert stats.minimum_detectable_effect(0.1, 9) > 0.1 >= stats.minimum_detectable_effect(0.1, 10)
    assert stats.seeds_needed(1.0, 0.01, most=20) is None


def test_verdicts():
    assert stats.verdict(0.01, 0.2, 0.1) == ("helps", False)
    assert stats.verdict(-0.3, -0.02, 0.1) == ("hurts", False)
    assert stats.verdict(-0.04, 0.06, 0.1) == ("no effect larger than 0.060", False)
    # The interval reaches beyond the minimum effect worth detecting: underpowered.
    assert stats.verdict(-0.15, 0.06, 0.1) == ("no effect larger than 0.150", True)
    assert stats.verdict(math.nan, math.nan, 0.1) == ("not enough seeds", True)


def test_bootstrap_interval_of_the_first_ablation():
    assert stats.bootstrap_interval([[1.0, 1.0], [1.0, 1.0]]) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="same problems"):
        stats.bootstrap_interval([[1.0, 1.0], [1.0]])


def test_a_value_that_is_not_finite_is_refused():
    """A NaN passed through as a NaN interval, which the report read as "not enough seeds" (found by a review)."""
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            stats.t_interval([0.01, bad, 0.03])


def _cells(diffs):
    """Cells of the primary comparison whose per-seed differences are `diffs` (128 problems, all at one value)."""
    out = {}
    for seed, d in enumerate(diffs):
        out["calculator", seed, "feedback"] = {"sampled": [0.5] * 128, "greedy": [1.0] * 128}
        out["calculator", seed, "rollback"] = {"sampled": [0.5 + d] * 128, "greedy": [1.0] * 128}
    return out


@pytest.mark.parametrize("diffs", [[1 / 128] * 3, [-1 / 128] * 2, [0.0] * 3])
def test_every_seed_giving_the_same_difference_is_not_a_decided_verdict(diffs):
    """Per-seed success comes in steps of 1/problems: equal differences over 2-3 seeds happen (seed 1's `feedback -
    trl` was exactly 0). Their zero-width t interval rendered "helps" [0.0078, 0.0078], MDE 0.000, 3 seeds enough."""
    from trl_agentic.ablation import design, report

    primary = next(c for c in design.COMPARISONS if (c.a, c.b) == ("rollback", "feedback"))
    s = report.comparison_stats(_cells(diffs), primary)
    assert s["verdict"] == f"undecided: every seed gave {diffs[0]:+.3f}" and s["underpowered"]
    assert s["mde"] == math.inf and s["seeds_needed"] is None and not s["spread"]
    # One seed: no interval, and no claim that one seed is enough ("seeds for 0.1: 1").
    s = report.comparison_stats(_cells([0.05]), primary)
    assert s["verdict"] == "not enough seeds" and s["seeds_needed"] is None
    # With a spread, the registered rule as before.
    s = report.comparison_stats(_cells([0.03, 0.04, 0.05]), primary)
    assert s["verdict"] == "helps" and s["spread"] and s["seeds_needed"] is not None
