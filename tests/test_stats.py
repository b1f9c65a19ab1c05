"""Paired statistics against hand-computed answers (evalkit/stats.py). Run: pytest tests/test_stats.py"""

import numpy as np
import pytest

from evalkit.stats import Interval, is_binary, mcnemar_exact, paired_bootstrap, verdict


def table(b, c, both_right=5, both_wrong=5):
    """Paired 0/1 scores with b documents right only in the reference and c only in the candidate."""
    ref = [1] * both_right + [0] * both_wrong + [1] * b + [0] * c
    cand = [1] * both_right + [0] * both_wrong + [0] * b + [1] * c
    return np.array(ref), np.array(cand)


@pytest.mark.parametrize("b, c, p", [
    (2, 8, 112 / 1024),  # 2 * P(X <= 2), X ~ Bin(10, 1/2) = 2 * (1 + 10 + 45) / 1024
    (0, 5, 2 / 32),  # 2 * P(X = 0), X ~ Bin(5, 1/2)
    (1, 11, 2 * 13 / 4096),  # 2 * (1 + 12) / 2^12
    (4, 4, 1.0),
    (0, 0, 1.0),
])
def test_mcnemar_exact_matches_hand_computation(b, c, p):
    ref, cand = table(b, c)
    assert mcnemar_exact(ref, cand) == (b, c, pytest.approx(p))


def test_bootstrap_of_a_constant_difference_is_a_point():
    interval = paired_bootstrap(np.zeros(30), np.full(30, 0.25), iterations=500)
    assert (interval.diff, interval.low, interval.high) == (0.25, 0.25, 0.25)


def test_bootstrap_matches_the_normal_approximation():
    # differences: 50 documents +1, 50 documents 0 -> mean 0.5, sd of mean sqrt(0.25 / 100) = 0.05
    ref, cand = np.zeros(100), np.array([1.0] * 50 + [0.0] * 50)
    interval = paired_bootstrap(ref, cand, iterations=20_000, seed=1)
    assert interval.diff == 0.5
    assert interval.low == pytest.approx(0.5 - 1.96 * 0.05, abs=0.012)
    assert interval.high == pytest.approx(0.5 + 1.96 * 0.05, abs=0.012)


def test_bootstrap_is_seeded_and_oriented():
    ref, cand = np.random.default_rng(0).random((2, 40))
    assert paired_bootstrap(ref, cand, seed=3) == paired_bootstrap(ref, cand, seed=3)
    up = paired_bootstrap(ref, cand, seed=3)
    down = paired_bootstrap(ref, cand, seed=3, higher_is_better=False)
    assert down.diff == pytest.approx(-up.diff) and down.low == pytest.approx(-up.high)


@pytest.mark.parametrize("low, high, expected", [
    (-0.019, 0.019, "equivalent"),
    (-0.015, -0.005, "equivalent"),  # significantly lower, but within tolerance: non-inferior
    (0.0, 0.0, "equivalent"),
    (-0.02, 0.01, "inconclusive"),  # touches the edge: not shown to be within it
    (-0.01, 0.02, "inconclusive"),
    (-0.05, 0.03, "inconclusive"),
    (-0.03, -0.001, "worse"),
    (-0.05, -0.021, "worse"),
    (0.001, 0.05, "better"),
    (0.021, 0.05, "better"),
])
def test_verdict_at_the_edges_of_the_tolerance(low, high, expected):
    assert verdict(Interval(diff=(low + high) / 2, low=low, high=high, confidence=0.95), 0.02) == expected


def test_is_binary():
    assert is_binary(np.array([0, 1, 1.0])) and not is_binary(np.array([0, 0.5]))
