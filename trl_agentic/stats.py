"""Statistics of the ablation: paired t intervals with seeds as the unit, the minimum detectable effect, verdicts.

Pure functions of plain numbers (no numpy or scipy: the Student t distribution is computed here from the regularized
incomplete beta function, and tested against closed forms and published quantiles).

**Seeds are the unit.** Every arm of a seed starts from the seed's warm start and is evaluated on the same problems, so
the comparison of arms A and B is the per-seed difference `d_s = mean_A(s) - mean_B(s)`, where each mean is over that
seed's problems (and samples). Every seed is scored on the same held-out problems (one list, `task_seed` 0), so
problems are shared by the seeds, not nested within them: the interval generalises over seeds (the warm start, the RL
seed, the sampling) for this set of problems, not over new problems. The interval is Student's t over the `n`
differences:

    mean(d) ± t_{1 - alpha/2, n - 1} * sd(d) / sqrt(n)

A bootstrap over 3 seeds cannot reach beyond the range of the 3 seed means; the t interval, with `n - 1` degrees of
freedom, is honest about how little 3 seeds say.

**Minimum detectable effect** (MDE) of a paired t test of level `alpha` (two-sided) with power `1 - beta`, for `n`
seeds whose differences have standard deviation `sd` (the usual approximation of the noncentral t by a shifted t):

    MDE = (t_{1 - alpha/2, n - 1} + t_{1 - beta, n - 1}) * sd / sqrt(n)

An effect of this size is found (the interval excludes 0) with probability about `1 - beta`; smaller ones may be
missed. [`seeds_needed`] inverts it.

**Verdict** of a comparison from its interval `[low, high]` and the pre-registered minimum effect worth detecting:
`helps` when `low > 0`, `hurts` when `high < 0`, else `no effect larger than X` with `X = max(|low|, |high|)` (the
interval says, at its level, that the effect is within ±X). When `X` exceeds the minimum effect, the comparison is
*underpowered*: it cannot rule out an effect worth having.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes' `betacf`)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def regularized_beta(x: float, a: float, b: float) -> float:
    """`I_x(a, b)`, the regularized incomplete beta function, for `0 <= x <= 1` and `a, b > 0`."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"`x` must be in [0, 1], got {x}.")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry I_x(a,b) = 1 - I_{1-x}(b,a).
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """`P(T <= t)` for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"`df` must be positive, got {df}.")
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (bisection on [`t_cdf`], to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"`p` must be in (0, 1), got {p}.")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return (low + high) / 2.0


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (`n - 1` in the denominator; 0.0 for one value)."""
    n = len(values)
    if n == 0:
        raise ValueError("No values.")
    if not all(math.isfinite(v) for v in values):
        # A NaN would pass through as "not enough seeds"; a cell with one is broken, not short of seeds.
        raise ValueError(f"Every value must be a finite number, got {list(values)!r}.")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


@dataclass(frozen=True)
class Interval:
    """A t interval of a mean over seeds.

    Attributes:
        mean: The mean of the per-seed values.
        low, high: The interval's bounds (`nan` with fewer than 2 seeds).
        sd: The standard deviation of the per-seed values.
        n: The number of seeds.
        level: The coverage.
    """

    mean: float
    low: float
    high: float
    sd: float
    n: int
    level: float


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Student's t interval of the mean of `values` (one per seed; for a paired comparison, the per-seed
    differences)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"`level` must be in (0, 1), got {level}.")
    mean, sd = mean_sd(values)
    n = len(values)
    if n < 2:
        return Interval(mean, math.nan, math.nan, sd, n, level)
    half = t_quantile(1.0 - (1.0 - level) / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, sd, n, level)


def paired_t_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """The t interval of `a - b` paired by seed: `a[s]` and `b[s]` are two arms' means on seed `s`."""
    if len(a) != len(b):
        raise ValueError(f"Both arms need the same seeds, got {len(a)} and {len(b)} values.")
    return t_interval([x - y for x, y in zip(a, b, strict=True)], level)


def minimum_detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """`(t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / sqrt(n)`: the smallest true mean difference that a two-sided
    paired t test of level `alpha` over `n` seeds detects with probability about `power` (see the module docstring).
    `inf` for fewer than 2 seeds."""
    if n < 2:
        return math.inf
    return (t_quantile(1.0 - alpha / 2.0, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


def seeds_needed(sd: float, effect: float, alpha: float = 0.05, power: float = 0.8, most: int = 100) -> int | None:
    """The fewest seeds (at least 2) whose [`minimum_detectable_effect`] is at most `effect`; `None` beyond `most`."""
    if effect <= 0:
        raise ValueError(f"`effect` must be positive, got {effect}.")
    for n in range(2, most + 1):
        if minimum_detectable_effect(sd, n, alpha, power) <= effect:
            return n
    return None


def verdict(low: float, high: float, min_effect: float) -> tuple[str, bool]:
    """The decision rule: `("helps", ...)` when `low > 0`, `("hurts", ...)` when `high < 0`, else
    `("no effect larger than X", ...)` with `X = max(|low|, |high|)`. The flag says the comparison is underpowered: the
    interval reaches beyond ±`min_effect`, so it cannot rule out an effect worth detecting."""
    if math.isnan(low) or math.isnan(high):
        return "not enough seeds", True
    underpowered = max(abs(low), abs(high)) > min_effect
    if low > 0:
        return "helps", False
    if high < 0:
        return "hurts", False
    return f"no effect larger than {max(abs(low), abs(high)):.3f}", underpowered


# ------------------------------------------------------------------------------------------------ first ablation


def bootstrap_interval(
    values_per_seed: Sequence[Sequence[float]], *, samples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """The first ablation's interval (docs/ablation-superseded/first/): a percentile bootstrap of the mean over seeds of
    the per-seed mean, resampling seeds and one shared set of problems. Kept so that its report recomputes; the
    current ablation uses [`t_interval`] over seeds.

    Args:
        values_per_seed: One list of per-problem values per seed, the same problems in the same order.
        samples: Bootstrap resamples.
        level: Coverage of the interval.
        seed: Seed of the resampling.

    Returns:
        `(mean, low, high)`.
    """
    groups = [list(v) for v in values_per_seed if len(v)]
    if not groups:
        raise ValueError("No values.")
    if len({len(g) for g in groups}) > 1:
        raise ValueError(f"Every seed must be evaluated on the same problems, got {[len(g) for g in groups]}.")
    n = len(groups[0])
    mean = sum(sum(g) / n for g in groups) / len(groups)
    rng = random.Random(seed)
    stats = []
    for _ in range(samples):
        chosen = [groups[rng.randrange(len(groups))] for _ in groups]
        problems = [rng.randrange(n) for _ in range(n)]
        stats.append(sum(sum(g[p] for p in problems) for g in chosen) / (n * len(chosen)))
    stats.sort()
    tail = (1 - level) / 2
    low = stats[max(0, math.floor(tail * samples))]
    high = stats[min(samples - 1, math.ceil((1 - tail) * samples) - 1)]
    return mean, low, high
