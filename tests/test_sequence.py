"""The betting confidence sequence without replacement (evalkit/run/sequence.py): valid at every look, closed on the
exact difference once every document is drawn. Run: .venv/bin/python -m pytest tests/test_sequence.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from evalkit.run.sequence import look, rules_out_above, rules_out_below


def population(total: int, worse: int, better: int) -> np.ndarray:
    return np.array([-1.0] * worse + [1.0] * better + [0.0] * (total - worse - better))


@pytest.mark.parametrize("worse, better", [(20, 0), (30, 10), (100, 100), (0, 0)])
def test_the_true_mean_is_ruled_out_at_some_look_in_at_most_alpha_of_random_orders(worse, better):
    """Ville's inequality: the chance that the true mean is ever outside the sequence, over all 200 draws, is at
    most alpha on each side. A fixed-n interval read at every draw, or one that ignored that the draws are
    without replacement, exceeds it."""
    total, alpha, runs = 200, 0.1, 2000
    d = population(total, worse, better)
    true = d.mean()
    rng = np.random.default_rng(7)
    orders = np.stack([d[rng.permutation(total)] for _ in range(runs)])
    for side in (rules_out_above, rules_out_below):
        for target in (true, -0.02, 0.02):
            missed = side(orders, total, true, alpha, (target,))[:, :-1].any(axis=1).mean()
            assert missed <= alpha, (side.__name__, target, missed)


def test_a_fixed_n_interval_read_at_every_look_would_fail_the_same_check():
    """The check above has teeth: a normal interval at each draw's own level alpha misses the true mean at some
    draw far more often than alpha."""
    total, alpha, runs = 200, 0.1, 2000
    d = population(total, 30, 10)
    rng = np.random.default_rng(7)
    orders = np.stack([d[rng.permutation(total)] for _ in range(runs)])
    n = np.arange(1, total + 1)
    means = np.cumsum(orders, axis=1) / n
    width = 1.2816 * d.std() * np.sqrt((total - n) / np.maximum(total - 1, 1) / n)  # with the finite-population factor
    missed = (means - width > d.mean())[:, 5:-1].any(axis=1).mean()
    assert missed > 2 * alpha


def test_the_interval_closes_on_the_exact_difference_once_every_document_is_drawn():
    d = population(300, 21, 6)
    order = d[np.random.default_rng(1).permutation(300)]
    last = look(order, 300, tolerance=0.02, alpha=0.05, equivalence=True)
    assert last.low == pytest.approx(-0.05, abs=1e-6) and last.high == pytest.approx(-0.05, abs=1e-6)
    assert last.verdict == "worse"


def test_the_interval_holds_the_drawn_mean_and_narrows_as_documents_are_drawn():
    d = population(1000, 50, 0)
    order = d[np.random.default_rng(3).permutation(1000)]
    looks = [look(order[:n], 1000, tolerance=0.02, alpha=0.05, equivalence=False) for n in (100, 400, 900)]
    for one in looks:
        assert one.low <= one.mean <= one.high
    widths = [one.high - one.low for one in looks]
    assert widths[0] > widths[1] > widths[2]


def test_the_verdict_matches_the_interval_against_the_tolerance():
    """worse exactly when the upper end is below -tolerance; equivalent when the interval lies inside."""
    rng = np.random.default_rng(5)
    for worse, better, equivalence in [(60, 0, False), (5, 5, True), (0, 0, True), (30, 30, True)]:
        d = population(1000, worse, better)[rng.permutation(1000)]
        for n in (150, 400, 700):
            one = look(d[:n], 1000, tolerance=0.02, alpha=0.05, equivalence=equivalence)
            if one.verdict == "worse":
                assert one.high < -0.02 + 1e-9
            elif one.verdict == "equivalent":
                assert -0.02 - 1e-9 < one.low and one.high < 0.02 + 1e-9
            else:
                assert one.high >= -0.02 - 1e-9


def test_a_five_point_regression_is_shown_worse_long_before_the_end():
    d = population(1000, 50, 0)[np.random.default_rng(11).permutation(1000)]
    shown = rules_out_above(d, 1000, -0.02, 0.05, (-0.02,))
    assert shown.any() and shown.argmax() + 1 < 500


def test_differences_outside_minus_one_to_one_are_refused():
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        look(np.array([2.0]), 10, tolerance=0.02, alpha=0.05, equivalence=False)
