"""The size of the exact one-sided tests of paired 0/1 scores (evalkit/compare/statistics/tost.py) at the sizes users run,
and the intervals they invert.

Size: the largest chance, over every nuisance value on the null's boundary, that a test rejects. The test rejects
exactly the tables whose Tango score is at most (or at least) a critical score, found here by bisection on the
p-value of a score; the chance of those tables is computed apart from tost.py (scipy.stats.binom: for each
number d of discordant documents, the binomial chance of d times that of the c at or below the table's
threshold) over a dense grid of the nuisance, denser still where few documents flip one way. The asymptotic
score test, used above 500 documents until this change, reached 0.061 at 600 and 0.055 at 2,000 documents.
Run: pytest tests/test_tost_size.py
"""

import numpy as np
import pytest
from scipy.stats import binom, norm

from evalkit.compare.statistics import tost

ALPHA = 0.05


def critical_score(n, delta, side, alpha=ALPHA):
    """The score between the tables the test rejects (p < alpha) and those it does not."""
    known = {}  # a score's p-value depends only on the tables in its tail (tost.thresholds): one tail_p per tail

    def p_value(score):
        tail = tost.thresholds(n, delta, score, side).tobytes()
        if tail not in known:
            known[tail] = tost.tail_p(n, delta, score, side)
        return known[tail]

    z = float(norm.isf(alpha))  # about where it lies
    rejected, kept = (-z - 1, -z + 0.5) if side == "below" else (z + 1, z - 0.5)
    assert p_value(rejected) < alpha <= p_value(kept)
    for _ in range(40):  # to 1e-12: closer than any two tables' scores at these sizes
        middle = (rejected + kept) / 2
        rejected, kept = (middle, kept) if p_value(middle) < alpha else (rejected, middle)
    return rejected


def rejection_chance(n, delta, limits, side, pc):
    """P(the test rejects) at nuisance pc (pb = pc - delta), with scipy's binomials, apart from tost.py."""
    s = min(max(2 * pc - delta, 0.0), 1.0)
    q = pc / s if s > 0 else 0.5
    first, last = (int(x) for x in binom.interval(1 - 1e-13, n, s))  # outside: at most 1e-13, added
    d = np.arange(first, last + 1)
    c = limits[first:last + 1]  # rejected: c <= c[d] ("below"), c > c[d] ("above")
    given = binom.cdf(c, d, q) if side == "below" else binom.sf(c, d, q)
    return float(binom.pmf(d, n, s) @ given) + 1e-13


def dense_nuisance(n, delta):
    low, high = tost.boundary(delta)
    flips = np.arange(0.0, 60.0, 0.5) / n  # every half expected flip near each end, every 5 across
    grid = np.concatenate([np.linspace(low, high, int(n * (high - low) / 5) + 2), low + flips, high - flips])
    return np.unique(np.clip(grid, low, high))


@pytest.mark.parametrize("n, tolerance, side, bound, alpha", [
    (600, 0.02, "below", -1, ALPHA), (2000, 0.02, "below", -1, ALPHA),  # worse, at the sizes the issue measured
    (20000, 0.02, "below", -1, ALPHA),
    (2000, 0.05, "above", -1, ALPHA), (2000, 0.02, "below", 1, ALPHA),  # the two halves of equivalence
    (5000, 0.02, "above", 1, ALPHA),  # better
    (2000, 0.02, "below", 0, ALPHA),  # lower (a real loss inside the tolerance)
    (2000, 0.05, "below", -1, 0.001),  # the level Holm asks of one row among 50 (size 0.0009996 here)
    (10000, 0.01, "above", -1, ALPHA),  # its largest chance 55 flips from an end, which a coarser grid missed
])
def test_every_one_sided_test_keeps_its_level_up_to_20000_documents(n, tolerance, side, bound, alpha):
    delta = bound * tolerance
    score = critical_score(n, delta, side, alpha)
    limits = tost.thresholds(n, delta, score, side)
    d = int(np.argmax(np.arange(n + 1) > 0.6 * n))  # a table at the edge: rejected, and its neighbour not
    edge = (d - limits[d], limits[d]) if side == "below" else (d - limits[d] - 1, limits[d] + 1)
    assert tost.tango_p(int(edge[0]), int(edge[1]), n, delta, side) < alpha
    size = max(rejection_chance(n, delta, limits, side, pc) for pc in dense_nuisance(n, delta))
    assert size <= alpha * (1 + 1e-7), f"size {size:.5f} at {n} documents"
    assert size > 0.6 * alpha  # and not far below: the test is exact, not merely conservative


@pytest.mark.parametrize("n", [1, 2, 7, 25])
def test_thresholds_are_every_table_ordered_by_score(n):
    """The tail found per number of discordant documents is the tail over every table, enumerated."""
    b, c = [x.ravel() for x in np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")]
    b, c = b[b + c <= n], c[b + c <= n]
    for delta in (-0.3, -0.02, 0.0, 0.1):
        scores = tost.tango_scores(delta, b, c, n)
        for observed in scores[::3]:
            for side in tost.SIDES:
                limits = tost.thresholds(n, delta, float(observed), side)
                tail = c <= limits[b + c] if side == "below" else c > limits[b + c]
                expected = scores <= observed + 1e-9 if side == "below" else scores >= observed - 1e-9
                assert (tail == expected).all()


@pytest.mark.parametrize("b, c, n", [(0, 0, 140), (0, 0, 149), (3, 1, 300), (12, 2, 300), (30, 60, 2000),
                                     (0, 5, 40), (40, 0, 40)])
def test_the_interval_is_the_one_the_tests_invert(b, c, n):
    """Below -tolerance exactly when p(diff < -tolerance) < alpha; inside exactly when both halves of
    equivalence are; at every decision point, and between them where the p-value crosses alpha."""
    points = (-0.02, 0.0, 0.02)
    low, high = tost.tango_limits(b, c, n, ALPHA, points)
    assert low <= (c - b) / n <= high
    for t in points:
        assert (tost.tango_p(b, c, n, t, "below") < ALPHA) == (high < t)
        assert (tost.tango_p(b, c, n, t, "above") < ALPHA) == (t < low)
    for limit, side in ((low, "above"), (high, "below")):  # the p-value crosses alpha at the limit
        if -1 < limit < 1:
            near = [tost.tango_p(b, c, n, limit + e, side) for e in (-2e-5, 2e-5)]
            assert min(near) < ALPHA <= max(near)


def test_bootstrap_limits_are_the_ones_bootstrap_p_inverts():
    statistics = np.random.default_rng(0).normal(0.0, 0.01, 999)
    low, high = tost.bootstrap_limits(statistics, ALPHA)
    for t in np.concatenate([statistics, statistics + 1e-12, statistics - 1e-12]):
        assert (tost.bootstrap_p(statistics, t, "above") < ALPHA) == (t < low)
        assert (tost.bootstrap_p(statistics, t, "below") < ALPHA) == (high < t)
    assert tost.bootstrap_limits(statistics[:10], ALPHA) == (-np.inf, np.inf)  # 10 resamples reject nothing


def test_no_table_is_no_p_value():
    for b, c, n in [(0, 0, 0), (3, 0, 2), (-1, 0, 5)]:
        with pytest.raises(ValueError, match="no valid paired table"):
            tost.tango_p(b, c, n, -0.02, "below")
