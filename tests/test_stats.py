"""Paired statistics against published and hand-computed answers (evalkit/compare/statistics/stats.py, proportions.py,
bootstrap.py, interval.py). Run: pytest tests/test_stats.py"""

import math
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest

from scipy.stats import multinomial

from evalkit.compare.statistics import tost
from evalkit.compare.statistics.bootstrap import paired_bootstrap, paired_bootstrap_aggregate, resamples
from evalkit.compare.statistics.interval import Interval, orient, z_value
from evalkit.compare.statistics.proportions import documents_needed, mcnemar_exact, tango_interval
from evalkit.compare.statistics.stats import compare_paired, is_binary, tost_p_values
from evalkit.compare.statistics.verdict import decide

Z2 = z_value(0.95) ** 2


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


@pytest.mark.parametrize("n", [1, 2, 7, 40, 399, 5_000])
def test_mcnemar_exact_is_the_exact_binomial_test_at_a_half(n):
    # the two-sided p computed exactly in integers: both tails as far from n/2 as min(b, c), at most 1
    for b in sorted({0, 1, n // 3, n // 2, (n + 1) // 2, n - 1, n}):
        tail = sum(math.comb(n, k) for k in range(min(b, n - b) + 1))
        exact = min(1.0, float(Fraction(2 * tail, 2 ** n)))
        ref, cand = table(b, n - b)
        assert mcnemar_exact(ref, cand)[2] == pytest.approx(exact, rel=1e-9, abs=0.0)


def test_tango_interval_matches_the_published_cavo_example():
    # Complete response before and after consolidation therapy (Cavo et al. 2012), the worked example of the
    # paired 2x2 table in Fagerland, Lydersen & Laake (Statistical Analysis of Contingency Tables, 2017, ch. 8),
    # table [[59, 6], [16, 80]]; their R package contingencytables prints, in its tests (test-ch8.R):
    # "Tango asymptotic score CI: estimate = -0.0621 (95% CI -0.1240 to -0.0054)". The estimate is
    # (n12 - n21) / N, so here the candidate is right alone on n12 = 6 and the reference on n21 = 16.
    interval = tango_interval(b=16, c=6, n=161)
    assert (round(interval.diff, 4), round(interval.low, 4), round(interval.high, 4)) == (-0.0621, -0.1240, -0.0054)


def yang_sun_hardin_roots(b, c, n):
    """Real roots of the quartic whose outermost roots are Tango's limits: the non-iterative form of Yang, Sun &
    Hardin (2012), "A non-iterative implementation of Tango's score confidence interval for a paired difference
    of proportions", Stat Med 31, doi:10.1002/sim.5561 (their b, c: the candidate-only and reference-only cells)."""
    g, d, s = Z2, c - b, b + c
    m = [n ** 2 * (n / g + 1) ** 2, -n * d * (n / g + 1) * (4 * n / g + 1),
         2 * n * d ** 2 * (3 * n / g + 2) / g - n ** 2 * (s / g + 1),
         n * d * (2 * s / g + 1) - d ** 3 * (4 * n / g + 1) / g, d ** 2 * (d ** 2 / g - s) / g]
    return sorted(r.real for r in np.roots(m) if abs(r.imag) < 1e-9)


@pytest.mark.parametrize("b, c, n", [
    (16, 6, 161),  # Cavo et al. 2012, above
    (7, 1, 21),  # Bentur et al. 2009, airway hyper-responsiveness (Fagerland et al. 2014): (1, 1, 7, 12)
    (20, 40, 160),  # PropCIs' example scoreci.mp(b = 40, c = 20, n = 160)
    (8, 16, 86),  # Agresti & Min (2005), the example in ratesci's pairbinci: c(53, 16, 8, 9)
    (0, 3, 25),  # an off-diagonal zero cell, which Tango's interval was made for
])
def test_tango_limits_agree_with_the_closed_form_quartic(b, c, n):
    roots = yang_sun_hardin_roots(b, c, n)
    interval = tango_interval(b=b, c=c, n=n)
    assert interval.low == pytest.approx(roots[0], abs=1e-9) and interval.high == pytest.approx(roots[-1], abs=1e-9)


@pytest.mark.parametrize("n", [1, 12, 40, 189, 1000])
def test_tango_without_flips_is_plus_minus_z2_over_n_plus_z2(n):
    interval = tango_interval(b=0, c=0, n=n)
    half = Z2 / (n + Z2)  # 0.0876 at n = 40
    assert (interval.diff, interval.low, interval.high) == (0.0, pytest.approx(-half), pytest.approx(half))


def test_tango_at_the_edges_and_mirrored():
    assert tango_interval(b=5, c=0, n=5).low == -1.0 and tango_interval(b=0, c=5, n=5).high == 1.0
    up, down = tango_interval(b=2, c=9, n=30), tango_interval(b=9, c=2, n=30)
    assert (down.low, down.high) == (pytest.approx(-up.high), pytest.approx(-up.low))
    with pytest.raises(ValueError, match="no valid paired table"):
        tango_interval(b=3, c=3, n=5)


def one_row(comparison, higher_is_better=True, alpha=0.05, tolerance=0.02):
    """The verdict of a comparison standing alone (a family of one row), made at tolerance (every comparison
    here is: the row carries it, as compare's rows do)."""
    row = pd.DataFrame([{**comparison.__dict__, "higher_is_better": higher_is_better, "tolerance": tolerance}])
    return decide([row], alpha)[0].verdict.iloc[0]


def test_documents_the_tolerance_needs():
    # the asymptotic score test would need z^2 (1 - tol) / tol = 133 documents at 0.02; the exact one, 149
    assert documents_needed(0.02) == 149
    assert tost.tango_p(0, 0, 148, -0.02, "above") >= 0.05 > tost.tango_p(0, 0, 149, -0.02, "above")
    assert documents_needed(0.1) == 29


@pytest.mark.parametrize("tolerance, confidence", [(0.05, 0.99), (0.3, 0.9), (0.01, 0.95), (0.9, 0.95)])
def test_documents_needed_is_the_fewest_that_show_equivalence(tolerance, confidence):
    """Searched from the asymptotic answer, whichever side of the exact one it falls: the exact test shows
    equivalence at the count found, and not at one fewer."""
    needed = documents_needed(tolerance, confidence=confidence)
    shown = [tost.tango_p(0, 0, n, -tolerance, "above") < 1 - confidence for n in (needed - 1, needed)]
    assert shown == [False, True] or (needed == 1 and shown[1])


@pytest.mark.parametrize("n, expected", [(12, "inconclusive"), (40, "inconclusive"), (300, "equivalent")])
def test_identical_documents_need_enough_of_them(n, expected):
    ref = np.array([1, 0] * (n // 2))
    comparison = compare_paired(ref, ref.copy(), aggregate=np.mean, aggregate_name="mean", by_mean=True,
                                higher_is_better=True, tolerance=0.02)
    assert (comparison.method, comparison.diff, one_row(comparison)) == ("tango", 0.0, expected)


@pytest.mark.parametrize("n, b, c", [(39, 4, 0), (79, 5, 0), (78, 9, 2)])
def test_the_interval_lies_below_the_tolerance_exactly_when_the_row_is_worse(n, b, c):
    """Tables where the unconditional test of worse rejects (p < 0.05) and the one given that some document
    changed, which the verdict uses, does not: the interval is the one the verdict's tests invert, so it reaches
    -tolerance and the row is not worse (an interval inverting the unconditional test lay wholly below it)."""
    assert tost.tango_p(b, c, n, -0.02, "below") < 0.05 <= tost.tango_p(b, c, n, -0.02, "below", True)
    ref = np.array([1] * b + [0] * c + [1] * (n - b - c))
    cand = np.array([0] * b + [1] * c + [1] * (n - b - c))
    comparison = compare_paired(ref, cand, aggregate=np.mean, aggregate_name="mean", by_mean=True,
                                higher_is_better=True, tolerance=0.02)
    assert comparison.method == "tango" and comparison.ci_high >= -0.02 and one_row(comparison) != "worse"


def rejection_probability(n, pb, pc, rejects):
    """P(rejects(b, c)) when each of n documents is right in the reference only with probability pb, in the
    candidate only with pc: every table of n documents, weighted by its multinomial probability. A table less
    likely than 1e-12 counts as rejected without asking (an upper bound, by under 1e-9)."""
    chances = ((b, c, multinomial.pmf([b, c, n - b - c], n, [pb, pc, 1 - pb - pc]))
               for b in range(n + 1) for c in range(n + 1 - b))
    return sum(p for b, c, p in chances if p < 1e-12 or rejects(b, c))


@pytest.mark.parametrize("tolerance", [0.02, 0.05, 0.1, 0.2])
@pytest.mark.parametrize("pc", [0.0, 0.005, 0.02, 0.1])  # pc = 0: no document can improve; b = c = 0 likely
def test_at_40_documents_the_one_sided_tests_keep_their_level(tolerance, pc):
    """What "at most 5 % false alarms" claims, at the boundary of each null hypothesis (the worst case), on 40
    documents: the asymptotic score test reaches 7.1 % there (tolerance 0.05, pc 0.02); the exact one may not."""
    n, pb = 40, pc + tolerance  # true difference -tolerance: not worse beyond it, and not equivalent
    worse = rejection_probability(n, pb, pc, lambda b, c: tost.tango_p(b, c, n, -tolerance, "below") < 0.05)
    equivalent = rejection_probability(n, pb, pc, lambda b, c: max(
        tost.tango_p(b, c, n, -tolerance, "above"), tost.tango_p(b, c, n, tolerance, "below")) < 0.05)
    assert worse <= 0.05 and equivalent <= 0.05


def test_no_discordant_pair_in_40_documents_shows_equivalence_only_where_it_may():
    # b = c = 0 of 40: within +-0.1 shown (1 - 0.9^40 = 98.5 % of candidates 0.1 worse would have flipped one)
    assert max(tost.tango_p(0, 0, 40, -0.1, "above"), tost.tango_p(0, 0, 40, 0.1, "below")) < 0.05
    assert tost.tango_p(0, 0, 40, -0.02, "above") > 0.05  # within +-0.02: 0.98^40 = 45 % would show no flip
    assert tost.tango_p(0, 0, 40, -0.1, "above") >= 0.9 ** 40  # never below the chance of the table itself


def test_exact_p_values_match_a_hand_enumeration():
    # H1: diff < 0 from b = 3, c = 0 of 3 documents: under the null (pc = pb = p) the tables at least as extreme
    # are b = 3 (p^3) and... only that one; the p-value is the largest p^3 on the boundary, p <= 1/2: 1/8
    assert tost.tango_p(3, 0, 3, 0.0, "below") == pytest.approx(0.125, abs=1e-6)
    assert tost.tango_p(0, 3, 3, 0.0, "above") == pytest.approx(0.125, abs=1e-6)
    assert tost.tango_p(3, 0, 3, 0.0, "above") == pytest.approx(1.0)


def test_bootstrap_of_a_constant_difference_is_a_point_and_no_evidence():
    interval = paired_bootstrap(np.zeros(30), np.full(30, 0.25), iterations=500)
    assert (interval.diff, interval.low, interval.high) == (0.25, 0.25, 0.25)
    same = compare_paired(np.full(30, 0.5), np.full(30, 0.5), aggregate=np.mean, aggregate_name="mean",
                          by_mean=True, higher_is_better=True, tolerance=0.02, iterations=200)
    # values in [0, 1], read by betting (means.py): 30 unchanged documents show no change within 0.02, since the
    # documents not drawn could hide one; nothing points to worse
    assert (same.method, one_row(same)) == ("betting", "inconclusive") and same.ci_low < -0.02 < 0.02 < same.ci_high
    assert same.p_worse == 1.0 and same.p_equivalent > 0.5


def test_bootstrap_matches_the_normal_approximation():
    # differences: 50 documents +1, 50 documents 0 -> mean 0.5, sd of mean sqrt(0.25 / 100) = 0.05
    ref, cand = np.zeros(100), np.array([1.0] * 50 + [0.0] * 50)
    interval = paired_bootstrap(ref, cand, iterations=20_000, seed=1)
    assert interval.diff == 0.5
    assert interval.low == pytest.approx(0.5 - 1.96 * 0.05, abs=0.012)
    assert interval.high == pytest.approx(0.5 + 1.96 * 0.05, abs=0.012)


def test_bootstrap_is_seeded_oriented_and_the_same_in_any_chunk_size():
    ref, cand = np.random.default_rng(0).random((2, 40))
    assert paired_bootstrap(ref, cand, seed=3) == paired_bootstrap(ref, cand, seed=3)
    assert paired_bootstrap(ref, cand, seed=3) == paired_bootstrap(ref, cand, seed=3, max_cells=7)
    assert paired_bootstrap(ref, cand, seed=3) != paired_bootstrap(ref, cand, seed=4)
    up = paired_bootstrap(ref, cand, seed=3)
    down = paired_bootstrap(ref, cand, seed=3, higher_is_better=False)
    assert down.diff == pytest.approx(-up.diff) and down.low == pytest.approx(-up.high)
    assert paired_bootstrap(ref, cand, seed=3, higher_is_better=None) == up  # unknown direction: not flipped


def test_resamples_hold_a_bounded_number_of_indices():
    chunks = list(resamples(1000, 2500, seed=0, max_cells=100_000))
    assert [c.shape for c in chunks] == [(100, 1000)] * 25
    assert all(c.min() >= 0 and c.max() < 1000 for c in chunks)
    assert [c.shape for c in resamples(50_000, 3, seed=0, max_cells=10)] == [(1, 50_000)] * 3  # one row at least


def test_aggregate_bootstrap_is_the_mean_bootstrap_when_the_aggregation_is_the_mean():
    ref, cand = np.random.default_rng(1).random((2, 25))
    by_mean = paired_bootstrap(ref, cand, iterations=300, seed=5)
    by_aggregate = paired_bootstrap_aggregate(list(ref), list(cand), lambda xs: sum(xs) / len(xs), iterations=300,
                                              seed=5)
    assert by_aggregate.diff == pytest.approx(by_mean.diff)
    assert (by_aggregate.low, by_aggregate.high) == (pytest.approx(by_mean.low), pytest.approx(by_mean.high))


@pytest.mark.parametrize("n, verdict", [(2, "inconclusive"), (5, "inconclusive"), (29, "inconclusive"),
                                        (30, "worse"), (100, "worse")])
def test_aggregate_of_tuples_is_compared_through_the_aggregation_lower_is_better(n, verdict):
    """A perplexity 50 % higher in log terms, bootstrapped through the aggregation (not lm-eval's own function, so
    not the sign-flip test): worse from 30 documents on; on fewer, a percentile bootstrap does not hold its
    level (it called 5 such documents worse), so the row is not tested and says why."""
    def weighted_perplexity(items):  # lm-eval's: exp(-sum(loglikelihoods) / sum(words))
        return math.exp(-sum(ll for ll, _ in items) / sum(w for _, w in items))

    rng = np.random.default_rng(n)
    ref = [(-float(w) * rng.uniform(0.4, 0.6), int(w)) for w in rng.integers(2, 7, size=n)]
    cand = [(ll * 1.5, w) for ll, w in ref]
    comparison = compare_paired(ref, cand, aggregate=weighted_perplexity, aggregate_name="weighted_perplexity",
                                by_mean=False, higher_is_better=False, tolerance=0.02, iterations=400)
    expected = weighted_perplexity(cand) - weighted_perplexity(ref)  # higher perplexity: worse
    assert comparison.diff == pytest.approx(-expected)
    assert (comparison.method, one_row(comparison, higher_is_better=False)) == ("bootstrap weighted_perplexity",
                                                                                verdict)
    assert (comparison.ci_high < 0) == (verdict == "worse") and (comparison.p_floor == 1.0) == (n < 30)
    assert ("a percentile bootstrap does not hold its level on fewer than 30" in comparison.note) == (n < 30)


def test_unknown_direction_is_never_oriented_and_a_fall_is_changed():
    ref, cand = np.ones(20), np.array([1.0] * 12 + [0.0] * 8)  # 1.0 -> 0.6
    comparison = compare_paired(ref, cand, aggregate=np.mean, aggregate_name="mean", by_mean=True,
                                higher_is_better=None, tolerance=0.02)
    assert comparison.diff == pytest.approx(-0.4) and one_row(comparison, higher_is_better=None) == "changed"
    assert "direction unknown" in comparison.note
    assert orient(Interval(0.1, 0.05, 0.2, 0.95), None) == Interval(0.1, 0.05, 0.2, 0.95)


def test_a_metric_lm_eval_cannot_aggregate_is_not_compared():
    comparison = compare_paired([1.0], [0.0], aggregate=None, aggregate_name="<function agg>", by_mean=False,
                                higher_is_better=True, tolerance=0.02)
    assert one_row(comparison) == "inconclusive" and "not in lm-eval's registry" in comparison.note


def test_tost_p_values_are_oriented_and_read_both_bounds():
    below = {-0.02: 0.9, 0.02: 0.01, 0.0: 0.4}.__getitem__  # p(H1: diff < t), candidate - reference
    above = {-0.02: 0.03, 0.02: 0.99, 0.0: 0.6}.__getitem__
    up = tost_p_values(below, above, tolerance=0.02, higher_is_better=True)
    assert up == {"p_worse": 0.9, "p_better": 0.99, "p_equivalent": 0.03, "p_lower": 0.4, "p_higher": 0.6}
    down = tost_p_values(below, above, tolerance=0.02, higher_is_better=False)  # oriented = -(raw)
    assert down == {"p_worse": 0.99, "p_better": 0.9, "p_equivalent": 0.03, "p_lower": 0.6, "p_higher": 0.4}
    unknown = tost_p_values(below, above, tolerance=0.02, higher_is_better=None)
    assert unknown["p_worse"] == pytest.approx(1.0) and math.isnan(unknown["p_better"])  # min(0.9, 0.99) * 2, capped


def test_is_binary():
    assert is_binary(np.array([0, 1, 1.0])) and not is_binary(np.array([0, 0.5]))


def test_holm_adjusts_step_down_by_hand():
    from evalkit.compare.statistics.verdict import holm

    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> monotone: 0.02, 0.03, 0.06, 0.06
    assert holm(np.array([0.01, 0.04, 0.03, 0.005])) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm(np.array([0.2, math.nan])) == pytest.approx([0.4, 1.0])  # no test: never rejected, still counted


def word_perplexity_documents(rng, n, ratio):
    """n documents of 50-400 words, the candidate's perplexity `ratio` times the reference's in expectation,
    each document's log-likelihood per word spread 10 % around it, the runs' spreads correlated."""
    words = rng.integers(50, 400, size=n).astype(float)
    base = -math.log(15.0) * (1 + rng.normal(0, 0.1, size=n))
    cand = base * (1 + rng.normal(0, 0.02, size=n)) - math.log(ratio)
    return list(zip(base * words, words)), list(zip(cand * words, words))


@pytest.mark.parametrize("n", [3, 30, 200, 300])
def test_the_perplexity_test_keeps_its_level_at_the_tolerance(n):
    """A candidate whose word perplexity is exactly 2 % higher (the tolerance): `worse` is H1: more than 2 %
    higher, so at most alpha of such candidates may be shown worse (400 simulations: within 2.5 standard errors
    of 0.05; the delta method's t test was above it at every size, 0.058-0.077), and one 8 % higher is shown
    worse almost always from 200 documents on; below 200 the row is untested (p_floor 1: never worse), as the
    sign-flip test there is liberal on zero-inflated and skewed changes."""
    from lm_eval.api.registry import get_aggregation

    rng = np.random.default_rng(n)
    weighted = get_aggregation("weighted_perplexity")

    def worse(ratio):
        ref, cand = word_perplexity_documents(rng, n, ratio)
        row = compare_paired(ref, cand, aggregate=weighted, aggregate_name="weighted_perplexity", by_mean=False,
                             higher_is_better=False, tolerance=0.02, relative=True, analytic=True)
        assert row.method == "sign-flip weighted_perplexity" and row.p_floor == (1.0 if n < 200 else 1 / 10_001)
        return row.p_worse < 0.05

    size = np.mean([worse(1.02) for _ in range(400)])
    assert size <= 0.05 + 2.5 * math.sqrt(0.05 * 0.95 / 400)
    power = np.mean([worse(1.08) for _ in range(50)])
    assert power == 0.0 if n < 200 else power >= 0.9


def test_bleu_resamples_summed_from_counts_equal_lm_evals_bleu():
    """corpus.py's fast path is exact: each resample's BLEU from summed per-segment counts is lm-eval's bleu of
    the resampled documents."""
    from lm_eval.api.registry import get_aggregation

    from evalkit.compare.statistics import corpus

    rng = np.random.default_rng(0)
    words = "the a cat dog sat on mat river runs to sea birds sing".split()
    items = [(" ".join(rng.choice(words, size=12)), [" ".join(rng.choice(words, size=10))]) for _ in range(50)]
    bleu = get_aggregation("bleu")
    fast = corpus.additive(bleu, items)
    rows = rng.integers(0, 50, size=(20, 50))
    assert fast is not None
    assert corpus.resampled(bleu, items, rows, fast) == pytest.approx(corpus.resampled(bleu, items, rows, None),
                                                                      rel=1e-12, abs=1e-12)
    assert corpus.additive(get_aggregation("chrf"), [(a, b[0]) for a, b in items]) is None  # no counts to sum


def test_vectorised_bleu_is_sacrebleus_compute_bleu():
    """bleu_scores against sacrebleu's own BLEU.compute_bleu (smooth "exp", corpus_bleu's default) on counts with
    every edge: no match at some orders, no n-grams at an order, a short or empty hypothesis."""
    from sacrebleu.metrics import BLEU

    from evalkit.compare.statistics.corpus import bleu_scores

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(2000):
        total = np.sort(rng.integers(0, 30, size=4))[::-1]
        correct = np.minimum(total, rng.integers(0, 30, size=4)) * (rng.random(4) > 0.3)
        rows.append([rng.integers(0, 40), rng.integers(1, 40), *correct, *total])
    rows = np.array(rows)
    expected = [BLEU.compute_bleu(correct=list(map(int, r[2:6])), total=list(map(int, r[6:])), sys_len=int(r[0]),
                                  ref_len=int(r[1]), smooth_method="exp").score for r in rows]
    assert bleu_scores(rows) == pytest.approx(expected, rel=1e-12, abs=1e-12)
