"""The level of compare's mean rows on the shapes LLM changes take (zero-inflated, skewed, a noisy reference, a %
tolerance on a 0/1 metric), the family of `equivalent`, `lower` and `higher`, and an interval that agrees with its
verdict. The simulations are seeded and small (a few hundred rows): a rate at most alpha within 2.5 standard
errors. Run: pytest tests/test_compare_shapes.py
"""

import math

import numpy as np
import pandas as pd
import pytest

from evalkit.compare.statistics import verdict
from evalkit.compare.statistics.stats import compare_paired

ALPHA, TRIALS = 0.05, 200
LIMIT = ALPHA + 2.5 * math.sqrt(ALPHA * (1 - ALPHA) / TRIALS)


def row(ref, cand, *, relative=True, tolerance=0.02, iterations=1_000):
    from lm_eval.api.registry import get_aggregation

    return compare_paired(list(ref), list(cand), aggregate=get_aggregation("mean"), aggregate_name="mean",
                          by_mean=True, higher_is_better=True, tolerance=tolerance, relative=relative,
                          iterations=iterations)


def rate(make, claim, trials=TRIALS) -> float:
    return float(np.mean([getattr(make(), claim) < ALPHA for _ in range(trials)]))


@pytest.mark.parametrize("n", [5, 10, 30, 200])
def test_a_few_large_drops_are_not_called_equivalent(n):
    """5 % of documents drop by 5 (values about 2.5: a true change of -10 %, relative): the sign-flip test called
    such rows `equivalent` 0.76 / 0.64 / 0.23 of the time at 5 / 10 / 30 documents, mostly those where no drop
    was drawn. Below 200 documents the row is untested, and from there the test holds."""
    rng = np.random.default_rng(n)

    def make():
        ref = rng.uniform(2.0, 3.0, n)
        return row(ref, ref - np.where(rng.random(n) < 0.05, 5.0, 0.0))

    assert rate(make, "p_equivalent") <= LIMIT


@pytest.mark.parametrize("n", [10, 30, 100, 200])
def test_many_small_drops_and_a_rare_large_gain_at_the_bound_are_not_called_worse(n):
    """98 % of documents at -0.153 and 2 % at +5 (a true change of -0.05, the bound of a 2 % relative tolerance
    at a score of 2.5): the sign-flip test called such rows `worse` 0.86 / 0.56 / 0.17 of the time at 10 / 30 /
    100 documents, where no gain was drawn."""
    rng = np.random.default_rng(n)

    def make():
        ref = np.full(n, 2.5)
        return row(ref, ref + np.where(rng.random(n) < 0.02, 5.0, -0.153))

    assert rate(make, "p_worse") <= LIMIT


def test_equal_differences_on_five_documents_are_no_evidence():
    """Identical unbounded values on 5 documents were `equivalent` (p = 1/32) beside a note saying "no evidence
    of equivalence"; the row is untested and says why."""
    ref = [2.1, 2.4, 2.5, 2.7, 2.9]
    shown = row(ref, ref)
    assert shown.p_equivalent == 1.0 and shown.p_floor == 1.0
    assert shown.note.startswith("5 documents of values outside [0, 1]: no test of a mean of unbounded values")


@pytest.mark.parametrize("n", [200, 1000])
def test_a_relative_row_counts_the_noise_of_its_reference(n):
    """truthfulqa's bleu_diff shape: per-document reference values around -8 spread by 20, the candidate's
    differences -0.16 give or take 0.05, independent of them (a true change of exactly -2 %). Taking |mean(ref)|
    as a known constant called such rows `worse` 0.30 of the time at 100 documents and 0.38 at 1,000; testing
    c_i - r_i - t s r_i per document holds the level."""
    rng = np.random.default_rng(n)

    def make():
        ref = -8.0 + rng.normal(0.0, 20.0, n)
        shown = row(ref, ref - 0.16 + rng.normal(0.0, 0.05, n))
        assert shown.method == "sign-flip"
        return shown

    assert rate(make, "p_worse", trials=150) <= ALPHA + 2.5 * math.sqrt(ALPHA * (1 - ALPHA) / 150)


@pytest.mark.parametrize("n", [5, 50, 400])
@pytest.mark.parametrize("change, claim", [(-0.02, "p_equivalent"), (-0.02, "p_worse"), (-0.10, "p_equivalent")])
def test_a_percent_tolerance_on_a_0_1_metric_holds_its_level(n, change, claim):
    """--tolerance-for t/acc=2%: each document right in the reference (with probability 0.8) lost with
    probability -change (a true relative change of exactly change). The sign-flip test, which such a row got
    instead of Tango, called it `equivalent` 0.91 of the time at 5 documents and 0.35 at 50 at the bound, and
    0.62 at 5 for a change of -10 %; betting on c_i - (1 + t) r_i (in [-(1 + t), 1]) holds at every size."""
    rng = np.random.default_rng(n)

    def make():
        ref = (rng.random(n) < 0.8).astype(float)
        ref[0] = 1.0  # a reference score above 0, which a relative row needs
        shown = row(ref, np.where(rng.random(n) < -change, 0.0, ref))
        assert shown.method == "betting"
        return shown

    assert rate(make, claim, trials=100) <= ALPHA + 2.5 * math.sqrt(ALPHA * (1 - ALPHA) / 100)


def one_row(p_lower: float, p_equivalent: float = 1e-4, p_worse: float = 1.0, n: int = 1) -> pd.DataFrame:
    return pd.DataFrame({"p_worse": [p_worse] * n, "p_better": [1.0] * n, "p_equivalent": [p_equivalent] * n,
                         "p_lower": [p_lower] * n, "p_higher": [1.0 - p_lower] * n, "higher_is_better": [True] * n,
                         "note": [""] * n, "tolerance": [0.02] * n, "diff": [0.0] * n, "ci_high": [0.01] * n,
                         "p_floor": [0.0] * n, "changed": [1] * n})


def test_lower_and_higher_are_one_family_with_equivalent():
    """A row inside its tolerance whose true change is exactly 0: p_lower uniform, p_higher = 1 - p_lower. Adjusted
    as two families beside equivalence, it was called `lower` or `higher` with probability 2 alpha; as one, alpha."""
    grid = (np.arange(200) + 0.5) / 200
    verdicts = [verdict.decide([one_row(u)], ALPHA)[0].verdict[0] for u in grid]
    assert set(verdicts) <= {"lower", "higher", "equivalent"}
    assert np.mean([v != "equivalent" for v in verdicts]) == pytest.approx(ALPHA, abs=1e-9)


def test_one_row_spends_alpha_on_equivalence_then_on_direction():
    """One row: its equivalence at alpha, then its direction at alpha / 2 a side (p_lower 0.03 was `lower`);
    a second row shares alpha."""
    (alone,) = verdict.decide([one_row(0.02, p_equivalent=0.04)], ALPHA)
    assert alone.verdict[0] == "lower" and alone.p_equivalent_holm[0] == pytest.approx(0.04)
    assert verdict.decide([one_row(0.03, p_equivalent=0.04)], ALPHA)[0].verdict[0] == "equivalent"
    (two,) = verdict.decide([one_row(0.02, p_equivalent=0.04, n=2)], ALPHA)
    assert list(two.verdict) == ["inconclusive"] * 2 and list(two.p_equivalent_holm) == pytest.approx([0.08] * 2)


def test_a_claim_the_family_does_not_make_is_noted():
    """Two rows whose own tests show them worse (p 0.03: intervals below -tolerance) but not at the family-wise
    level (adjusted 0.06): `inconclusive`, and each note says the adjustment over the 2 rows is why."""
    (table,) = verdict.decide([one_row(0.99, p_equivalent=1.0, p_worse=0.03, n=2)], ALPHA)
    assert list(table.verdict) == ["inconclusive"] * 2
    assert all(note == "its interval lies beyond the tolerance on the worse side, as its own test at 0.05 shows, but "
               "not worse at the family-wise level over the 2 rows compared (adjusted p 0.06)" for note in table.note)


def test_a_direction_shown_only_at_alpha_leaves_0_in_the_interval(tmp_path):
    """200 documents about -0.5 (unbounded, absolute), the candidate 0.004 lower give or take 0.03: p_lower 0.026,
    inside the tolerance. It was `lower` beside an interval below 0; the direction is claimed at alpha / 2 a side,
    so the row is `equivalent` and its interval reaches 0."""
    rng = np.random.default_rng(2)
    ref = -0.5 + rng.uniform(-0.3, 0.3, 200)
    shown = row(ref, ref + rng.normal(-0.004, 0.03, 200), relative=False, iterations=10_000)
    assert 0.025 < shown.p_lower < 0.05 and shown.ci_high == 0.0 and -0.02 < shown.ci_low
    (table,) = verdict.decide([pd.DataFrame([{**shown.__dict__, "higher_is_better": True, "tolerance": 0.02}])],
                              ALPHA)
    assert table.verdict[0] == "equivalent"


def perplexity_row(rng, n, per_word_change):
    """A word-perplexity row (relative, lower is better) of n documents of 50-400 words, perplexity about 15, each
    document's log-likelihood per word changed by per_word_change (an array of n)."""
    from lm_eval.api.registry import get_aggregation

    words = rng.integers(50, 400, n).astype(float)
    per_word = math.log(1 / 15.0) * (1 + 0.1 * rng.normal(size=n))
    ref = [(float(w * p), float(w)) for w, p in zip(words, per_word)]
    cand = [(float(w * (p + c)), float(w)) for w, p, c in zip(words, per_word, per_word_change)]
    shown = compare_paired(ref, cand, aggregate=get_aggregation("weighted_perplexity"),
                           aggregate_name="weighted_perplexity", by_mean=False, higher_is_better=False,
                           tolerance=0.02, relative=True, analytic=True, iterations=1_000)
    assert shown.method == "sign-flip weighted_perplexity"
    return shown


@pytest.mark.parametrize("n", [10, 30, 200])
def test_a_perplexity_rise_carried_by_a_few_documents_is_not_called_equivalent(n):
    """5 % of documents' log-likelihood per word falls by log(1.1) / 0.05 (a true 10 % rise in word perplexity),
    every document moving by Normal(0, 0.002) too: the sign-flip test called such rows `equivalent` 0.61-0.65 of
    the time at 5-10 documents and 0.22 at 30, mostly where no fall was drawn. Below 200 documents the row is
    untested, and from there the test holds."""
    rng = np.random.default_rng(n)

    def make():
        fall = np.where(rng.random(n) < 0.05, -math.log(1.1) / 0.05, 0.0)
        return perplexity_row(rng, n, fall + rng.normal(0.0, 0.002, n))

    assert rate(make, "p_equivalent") <= LIMIT


@pytest.mark.parametrize("n", [10, 30, 100, 200])
def test_a_perplexity_at_the_bound_with_a_rare_large_gain_is_not_called_worse(n):
    """98 % of documents a little less likely per word and 2 % far more (0.4 per word), a true rise of exactly
    2 % in word perplexity (the bound): the sign-flip test called such rows `worse` 0.84 / 0.61 / 0.12 of the
    time at 10 / 30 / 100 documents, where no gain was drawn."""
    rng = np.random.default_rng(n)
    gain = 0.4
    fall = (math.log(1.02) + 0.02 * gain) / 0.98

    def make():
        return perplexity_row(rng, n, np.where(rng.random(n) < 0.02, gain, -fall))

    assert rate(make, "p_worse") <= LIMIT


def test_a_perplexity_row_below_200_documents_says_why_it_is_untested():
    """A word perplexity 50 % higher on 150 documents was `worse`; below 200 documents the row is untested, its
    interval unbounded and its note saying why."""
    shown = perplexity_row(np.random.default_rng(0), 150, np.full(150, -math.log(1.5)))
    assert shown.p_worse == 1.0 and shown.p_floor == 1.0 and shown.ci_low == -math.inf
    assert shown.note.startswith("150 documents whose log-likelihood changes are unbounded: no test of a mean")


def judge_row(ref, cand, *, bounds=(1.0, 10.0), relative=True):
    from lm_eval.api.registry import get_aggregation

    shown = compare_paired(list(ref), list(cand), aggregate=get_aggregation("mean"), aggregate_name="mean",
                           by_mean=True, higher_is_better=True, tolerance=0.02, relative=relative, iterations=1_000,
                           bounds=bounds)
    assert shown.method == "betting"
    return shown


@pytest.mark.parametrize("n", [10, 30, 100])
def test_a_declared_range_holds_the_level_at_the_bound_with_a_rare_large_gain(n):
    """A judge's score in [1, 10] (--range-for t/score=1:10), about 5: 98 % of documents a little lower and 2 %
    up by 4.5, a true change of exactly -2 % (the bound). Undeclared, such a row is untested below 200 documents
    (the sign-flip test called it `worse` most of the time there); declared, betting reads it at every size and
    holds the level."""
    rng = np.random.default_rng(n)
    fall = (0.02 * 5.0 + 0.02 * 4.5) / 0.98

    def make():
        ref = np.full(n, 5.0)
        return judge_row(ref, ref + np.where(rng.random(n) < 0.02, 4.5, -fall))

    assert rate(make, "p_worse") <= LIMIT


@pytest.mark.parametrize("n", [10, 30, 100])
def test_a_declared_range_is_not_fooled_by_a_few_large_drops(n):
    """A judge's score about 8 in [1, 10]; 5 % of documents drop to 1 (a true change of about -4.4 %, beyond a
    2 % tolerance): `equivalent` at most alpha of the time, though most rows of 10-30 documents draw no drop."""
    rng = np.random.default_rng(n)

    def make():
        ref = rng.uniform(7.5, 8.5, n)
        return judge_row(ref, np.where(rng.random(n) < 0.05, 1.0, ref + rng.uniform(-0.05, 0.05, n)))

    assert rate(make, "p_equivalent") <= LIMIT


def test_a_declared_range_gives_a_claim_below_200_documents():
    """30 documents of a judge's score falling from about 8 to about 6 (-25 %): undeclared, untested
    (`inconclusive` below 200 documents); declared 1..10, shown worse by betting, absolute or relative."""
    rng = np.random.default_rng(0)
    ref = rng.uniform(7.5, 8.5, 30)
    cand = ref - 2.0
    assert row(ref, cand).p_floor == 1.0 and row(ref, cand).p_worse == 1.0
    assert judge_row(ref, cand).p_worse < ALPHA and judge_row(ref, cand).ci_high < -0.02
    assert judge_row(ref, cand, relative=False).p_worse < ALPHA


@pytest.mark.parametrize("bounds", [(-10.0, 10.0), (-10.0, 0.0)])
def test_a_declared_range_around_or_below_0_keeps_a_relative_rows_direction(bounds):
    """Scores about -5 (relative: a fall is away from 0) in a range [-10, 10] or [-10, 0]: a 20 % fall on 200
    documents is worse, a 20 % rise better, and no change is not worse. Where the range straddles 0 the sign of
    the reference's mean is not taken from the data: both signs are tested, the larger p-value kept."""
    rng = np.random.default_rng(1)
    ref = rng.uniform(-6.0, -4.0, 200)
    fall, rise, same = (judge_row(ref, ref * k, bounds=bounds) for k in (1.2, 0.8, 1.0))
    assert fall.p_worse < 0.01 and fall.diff == pytest.approx(-0.2)
    assert rise.p_better < 0.01 and rise.diff == pytest.approx(0.2)
    assert same.p_worse == 1.0 and same.p_better == 1.0
