"""The statistics of one row of a comparison: which method reads a metric's paired per-document values, and the
interval and one-sided p-values it gives (compare_paired, Comparison). Pure functions, no I/O.

* 0/1 metrics averaged over documents, absolute: Tango's score interval and McNemar's exact test
  (evalkit/compare/statistics/proportions.py), with the exact one-sided tests of evalkit/compare/statistics/tost.py.
* Other means over documents (evalkit/compare/statistics/means.py): betting where every value lies in [0, 1],
  valid at every size whatever the shape (a relative row, a % tolerance on a 0/1 metric included: on
  c_i - (1 + t) r_i); else the sign-flip test with its pseudo-document, from means.MIN_UNBOUNDED documents on (no
  test of a mean of unbounded values holds for every shape; below that the row is untested and says why), a
  relative row on c_i - r_i - t s r_i so that the reference's noise is counted.
* Everything else: the paired bootstrap (evalkit/compare/statistics/bootstrap.py) of the metric's own aggregation,
  read from bootstrap.MIN_DOCUMENTS documents on (on fewer the row is untested and its note says why).
* The p-values of the one-sided tests against the tolerance (evalkit/compare/statistics/tost.py) go with each interval;
  evalkit/compare/statistics/verdict.py turns them into verdicts, Holm-adjusted over every row of a comparison.
* A relative comparison (unbounded metrics: perplexity, BLEU, ...) reads (candidate - reference) / |reference|,
  whose sign is the difference's whatever the sign of the reference's score.
* lm-eval's perplexity-family aggregations (perplexity, word/byte perplexity, bits_per_byte), a task's or a
  group's, are not resampled: their change is a ratio of per-document sums (ratio.paired_sums), which the sign-flip
  test of means.py reads on the documents' log-likelihood changes, each weighted by its words or bytes (and, in a
  group, its leaf's share), from means.MIN_UNBOUNDED documents on (a t test by the delta method was above the
  level at every size, 0.058-0.077, and the sign-flip test is below that number of documents on zero-inflated or
  skewed log-likelihood changes: benchmarks/small_samples.py). A row below that, or with no such ratio, is untested
  (perplexity_reading).
* Resamples are sized to the family (bootstrap.resamples_for); corpus-level aggregations that re-aggregate every
  resample draw at most aggregate_iterations (BLEU, whose resamples are sums of per-document counts,
  evalkit/compare/statistics/corpus.py, is not bounded). Each row says the smallest p-value its method can give (p_floor),
  and verdict.decide says where that limits the row.
"""

from __future__ import annotations

import math
import numbers
import operator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from evalkit.compare.statistics import corpus, means, ratio, tost
from evalkit.compare.statistics.bootstrap import aggregate_statistics, resamples_for, too_few
from evalkit.compare.statistics.interval import Interval, orient, relative_change
from evalkit.compare.statistics.proportions import mcnemar_exact, tango_interval


def is_binary(values: np.ndarray) -> bool:
    return bool(np.isin(np.asarray(values, dtype=float), (0.0, 1.0)).all())


def all_scalar(*runs: Sequence[Any]) -> bool:
    plain = (float, int, bool)  # the types JSON gives, checked first: numbers.Real's isinstance is an ABC's, slow
    return all(set(map(type, values)) <= set(plain) or all(isinstance(v, numbers.Real) for v in values)
               for values in runs)


def all_binary(*runs: Sequence[Any]) -> bool:
    return all_scalar(*runs) and all(is_binary(np.asarray(values, dtype=float)) for values in runs)


def tost_p_values(below: Callable[[float], float], above: Callable[[float], float], *, tolerance: float,
                  higher_is_better: bool | None) -> dict[str, float]:
    """The one-sided p-values the verdicts are made of, oriented (positive is better), from below(t) = p(H1:
    diff < t) and above(t) = p(H1: diff > t) on the candidate - reference scale. Direction unknown: p_worse is
    for a change beyond the tolerance either way (the smaller side, doubled), and there is no p_better."""
    if higher_is_better is False:  # oriented diff = -(candidate - reference)
        below, above = (lambda t, f=above: f(-t)), (lambda t, f=below: f(-t))
    p = {"p_worse": below(-tolerance), "p_better": above(tolerance),
         "p_equivalent": max(above(-tolerance), below(tolerance)), "p_lower": below(0.0), "p_higher": above(0.0)}
    if higher_is_better is None:
        p["p_worse"], p["p_better"] = min(1.0, 2 * min(p["p_worse"], p["p_better"])), math.nan
    return p


NO_EVIDENCE = {"p_worse": 1.0, "p_better": 1.0, "p_equivalent": 1.0, "p_lower": 1.0, "p_higher": 1.0}


@dataclass(frozen=True)
class Comparison:
    """One metric compared on paired documents: the comparison table's statistics columns."""

    reference: float  # the metric over the reference run's documents (its aggregation)
    candidate: float
    diff: float  # Interval.diff: oriented so that positive is better, unless the direction is unknown
    ci_low: float  # the (1 - 2 alpha) interval: inside +-tolerance exactly when TOST shows equivalence
    ci_high: float
    mcnemar_b: int | None  # 0/1 metrics: documents right only in the reference
    mcnemar_c: int | None  # ... right only in the candidate
    mcnemar_p: float | None
    method: str | None  # "tango", "betting", "sign-flip", "sign-flip <aggregation>", "delta <aggregation>" or
    # "bootstrap <aggregation>"
    p_worse: float  # one-sided p-values (tost_p_values), before any adjustment for the number of rows
    p_better: float
    p_equivalent: float
    p_lower: float
    p_higher: float
    note: str  # why a reading is weaker than it looks ("" when nothing to say)
    p_floor: float = 0.0  # the smallest p-value the method can give: 1 / (draws + 1) for a bootstrap or drawn
    # sign-flips, 2^-n for enumerated ones, 1 for a row its method cannot read (too few documents), else 0
    changed: int | None = None  # documents whose values differ between the runs


def _tango(ref: np.ndarray, cand: np.ndarray, *, tolerance: float, confidence: float,
           higher_is_better: bool | None) -> tuple[Interval, tuple, dict[str, float]]:
    """Tango's exact tests and the interval they invert. Where some document changed, the tests of a change
    beyond a bound away from 0 (worse at -tolerance, better at +tolerance) are those given that some document
    changed, as verdict.decide's screen needs (tost.tango_p's given_change), the others unconditional; the
    interval inverts the same tests, so it lies below -tolerance exactly when the row's own test of worse
    rejects (inverting the unconditional ones put it there beside an inconclusive verdict)."""
    b, c, p = mcnemar_exact(ref, cand)
    n, alpha, points = len(ref), 1.0 - confidence, (-tolerance, 0.0, tolerance)
    below = lambda t: tost.tango_p(b, c, n, t, "below", bool(b + c) and t < 0)  # noqa: E731
    above = lambda t: tost.tango_p(b, c, n, t, "above", bool(b + c) and t > 0)  # noqa: E731
    guess = tango_interval(b, c, n, confidence=1.0 - 2 * alpha)  # the asymptotic limits, close from ~1,000 on
    with ThreadPoolExecutor(1) as pool:  # the two limits at once: numpy and scipy's special functions let go of
        lower = pool.submit(tost._limit, lambda t: above(t) < alpha, above, alpha, points, lower=True,  # the GIL
                            guess=guess.low)
        high = tost._limit(lambda t: below(t) < alpha, below, alpha, points, lower=False, guess=guess.high)
        low = lower.result()
    interval = orient(Interval((c - b) / n, *at_zero(low, high, below, above, alpha), 2 * confidence - 1),
                      higher_is_better)
    return interval, (b, c, p), tost_p_values(below, above, tolerance=tolerance, higher_is_better=higher_is_better)


def at_zero(low: float, high: float, below: Callable[[float], float], above: Callable[[float], float],
            alpha: float) -> tuple[float, float]:
    """The interval's limits where 0 is concerned: the direction of a change inside the tolerance (`lower`,
    `higher`) is claimed at alpha / 2 a side, since either could be (verdict.inside_family), so 0 stays in the
    interval unless the row's own test rejects it at that level; elsewhere the limits are the tests' at alpha."""
    if high < 0 and not below(0.0) < alpha / 2:
        high = 0.0
    if low > 0 and not above(0.0) < alpha / 2:
        low = 0.0
    return low, high


def bootstrap_reading(diff: float, statistics: np.ndarray, *, tolerance: float, confidence: float,
                      higher_is_better: bool | None) -> tuple[Interval, dict[str, float]]:
    """The (1 - 2 alpha) percentile interval and the one-sided p-values of a bootstrap distribution."""
    below = lambda t: tost.bootstrap_p(statistics, t, "below")  # noqa: E731
    above = lambda t: tost.bootstrap_p(statistics, t, "above")  # noqa: E731
    low, high = tost.bootstrap_limits(statistics, 1.0 - confidence)  # the interval bootstrap_p inverts
    if high > low:
        low, high = at_zero(low, high, below, above, 1.0 - confidence)
    interval = orient(Interval(float(diff), low, high, 2 * confidence - 1), higher_is_better)
    if not interval.high > interval.low:  # a point, or NaN: no evidence of anything
        return interval, dict(NO_EVIDENCE, p_better=math.nan if higher_is_better is None else 1.0)
    return interval, tost_p_values(below, above, tolerance=tolerance, higher_is_better=higher_is_better)


def untested(diff: float, *, tolerance: float, confidence: float, higher_is_better: bool | None
             ) -> tuple[Interval, dict[str, float]]:
    """A row its method cannot read (bootstrap.too_few): an unbounded interval and no evidence of anything."""
    interval = orient(Interval(float(diff), -math.inf, math.inf, 2 * confidence - 1), higher_is_better)
    return interval, dict(NO_EVIDENCE, p_better=math.nan if higher_is_better is None else 1.0)


def is_bounded(*runs: np.ndarray) -> bool:
    """Every value of both runs in [0, 1]: the metric is read as bounded there (F1, ROUGE, a share)."""
    return all(bool(((values >= 0.0) & (values <= 1.0)).all()) for values in runs)


def bounded_tests(reference: np.ndarray, candidate: np.ndarray, bounds: tuple[float, float], *, relative: bool,
                  alpha: float, far: float) -> tuple[Callable, Callable, tuple[float, float]]:
    """(below, above, ends): the betting tests of a mean of values known to lie in bounds [lo, hi] (means.betting_p,
    valid at every n), and how far their interval may reach. Absolute: on c_i - r_i in [lo - hi, hi - lo] against
    t. Relative, a change of t over |mean(r)|: on c_i - k r_i (k = 1 + s t, s the sign of the reference's mean)
    against 0, each term in [lo - max(k lo, k hi), hi - min(k lo, k hi)]. Where the range fixes that sign (lo >= 0:
    +1, hi <= 0: -1) it is known; where it straddles 0 the test is done for both signs and its p-value is the
    larger (a change beyond -t |mean(r)| is one beyond -t s mean(r) for both s, and one inside for either), so
    the sign is never read off the data."""
    lo, hi = bounds
    signs = (1.0,) if lo >= 0 else (-1.0,) if hi <= 0 else (1.0, -1.0)

    def p(t: float, side: str) -> float:
        if not relative:
            return means.betting_p(candidate - reference, t, side, alpha=alpha, low=lo - hi, high=hi - lo)
        tests = []
        for s in signs:
            k = 1.0 + s * t
            tests.append(means.betting_p(candidate - k * reference, 0.0, side, alpha=alpha,
                                         low=lo - max(k * lo, k * hi), high=hi - min(k * lo, k * hi)))
        return max(tests)

    ends = (lo - hi, hi - lo) if not relative else (-1.0 if lo >= 0 else -far, far)
    return (lambda t: p(t, "below")), (lambda t: p(t, "above")), ends


def mean_reading(reference: np.ndarray, candidate: np.ndarray, *, relative: bool, draws: int, seed: int,
                 tolerance: float, confidence: float, higher_is_better: bool | None,
                 bounds: tuple[float, float] | None = None) -> tuple[str, Interval, dict[str, float], float, str]:
    """(method, interval, p-values, p_floor, note) of a mean of per-document values, by tests whose level does not
    rest on the shape of the changes where the values are bounded (means.py): betting where every value lies in
    [0, 1], or in the range bounds the user declared (bounded_tests), on c_i - r_i - t (absolute) or on
    c_i - (1 + t) r_i (relative: the change over the reference's mean as a ratio of sums, every term in
    [-(1 + t), 1] on [0, 1], so a % tolerance on a 0/1 metric is tested too); else the
    sign-flip test, from means.MIN_UNBOUNDED documents on (untested below, saying why), of c_i - r_i against t
    (absolute) or of c_i - r_i - t s r_i (relative, s the sign of the reference's sum: means.ratio_flip), the
    reference's values never taken as a known constant."""
    delta, alpha, n = candidate - reference, 1.0 - confidence, len(reference)
    sign = 1.0 if float(reference.sum()) >= 0 else -1.0
    diff = float(delta.sum() / (sign * reference.sum())) if relative else float(delta.mean())
    points, level = (-tolerance, 0.0, tolerance), 2 * confidence - 1
    if bounds is None and is_bounded(reference, candidate):
        bounds = (0.0, 1.0)
    if bounds is not None:
        below, above, ends = bounded_tests(reference, candidate, bounds, relative=relative, alpha=alpha,
                                           far=max(1.0, 4.0 * (abs(diff) + tolerance)))
        low = means.inverted(above, alpha, points, lower=True, ends=ends)
        high = means.inverted(below, alpha, points, lower=False, ends=ends)
        method, floor, note = "betting", 0.0, ""
    elif n < means.MIN_UNBOUNDED:
        interval, p_values = untested(diff, tolerance=tolerance, confidence=confidence,
                                      higher_is_better=higher_is_better)
        return "sign-flip", interval, p_values, 1.0, (means.too_few_unbounded(n) + "; where its values are known to "
                                                       "lie in a range, --range-for TASK/METRIC=LO:HI has it tested "
                                                       "by betting at every size")
    elif relative:
        test = means.ratio_flip(delta, sign * reference, draws=draws, seed=seed)
        below, above = (lambda t: test.p(t, "below")), (lambda t: test.p(t, "above"))
        ends = (-max(1.0, 4.0 * (abs(diff) + tolerance)), max(1.0, 4.0 * (abs(diff) + tolerance)))
        low = means.inverted(above, alpha, points, lower=True, ends=ends)
        high = means.inverted(below, alpha, points, lower=False, ends=ends)
        method, floor, note = "sign-flip", test.floor, ""
    else:
        test = means.sign_flip(delta, draws=draws, seed=seed)
        below, above = (lambda t: test.p(t, "below")), (lambda t: test.p(t, "above"))
        low, high = test.limits(alpha)
        method, floor, note = "sign-flip", test.floor, ""
    interval = orient(Interval(diff, *at_zero(low, high, below, above, alpha), level), higher_is_better)
    p_values = tost_p_values(below, above, tolerance=tolerance, higher_is_better=higher_is_better)
    return method, interval, p_values, floor, note


def ratio_reading(form: ratio.Form, *, draws: int, seed: int, tolerance: float, confidence: float,
                  higher_is_better: bool | None, diff: float | None = None
                  ) -> tuple[Interval, dict[str, float], float]:
    """(interval, p-values, p_floor) of a perplexity-family row, a task's or a group's, whose change is a ratio of
    per-document sums (ratio.paired_sums): the sign-flip test of means.py on the documents' log-likelihood
    changes, each with its unit (words or bytes, in a group times its leaf's share). diff: the row's change on its
    scale, where sum(d) / sum(u) is only its first-order form (a group of perplexities); by default that form's."""
    d, u, to_test, to_row = form
    if not d.any():  # no document's log-likelihood moved: no evidence of anything
        none = dict(NO_EVIDENCE, p_better=math.nan if higher_is_better is None else 1.0)
        return Interval(0.0, 0.0, 0.0, 2 * confidence - 1), none, 1.0
    alpha, points = 1.0 - confidence, (-tolerance, 0.0, tolerance)
    diff = to_row(float(d.sum() / u.sum())) if diff is None else diff
    if (u > 0).all():
        test = means.sign_flip(d, units=u, draws=draws, seed=seed)
        low, high = (to_row(x) for x in test.limits(alpha))
    else:  # units of either sign (a relative group of means whose reference values change sign): means.ratio_flip
        test = means.ratio_flip(d, u, draws=draws, seed=seed)
    below, above = (lambda t: test.p(to_test(t), "below")), (lambda t: test.p(to_test(t), "above"))
    if not (u > 0).all():
        ends = (-max(1.0, 4.0 * (abs(diff) + tolerance)), max(1.0, 4.0 * (abs(diff) + tolerance)))
        low, high = (means.inverted(f, alpha, points, lower=lower, ends=ends)
                     for f, lower in ((above, True), (below, False)))
    interval = orient(Interval(diff, *at_zero(low, high, below, above, alpha), 2 * confidence - 1), higher_is_better)
    p = tost_p_values(below, above, tolerance=tolerance, higher_is_better=higher_is_better)
    return interval, p, test.floor


PERPLEXITY_VALUES = "whose log-likelihood changes are unbounded"  # too_few_unbounded's words for a perplexity row
NO_RATIO = ("the documents' words or bytes differ between the runs, or a unit is not positive: no ratio of "
            "per-document sums to test, so this row is not tested (inconclusive, whatever it shows)")


def perplexity_reading(strata: list[ratio.Stratum], weights: Sequence[float], name: str, scores: tuple[float, float],
                       *, relative: bool, draws: int, seed: int, **settings: Any
                       ) -> tuple[Interval, dict[str, float], float, str] | None:
    """(interval, p-values, p_floor, note) of a perplexity-family row (a task: one stratum; a group: its leaves,
    weighted): ratio_reading from means.MIN_UNBOUNDED documents on (all leaves together), untested below (the
    sign-flip test of zero-inflated or skewed log-likelihood changes, a few documents moving a lot, is liberal
    there, as for a mean of unbounded values: benchmarks/small_samples.py --shapes) and where it is no ratio of
    sums; None where the values do not reproduce lm-eval's scores (the row is then read as any corpus row)."""
    try:
        if not np.allclose(ratio.scores(strata, weights, name), scores, rtol=1e-9, atol=0.0):
            return None
        form = ratio.paired_sums(strata, weights, name, relative=relative)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return None
    diff = relative_change(*scores) if relative else scores[1] - scores[0]
    if form is None:
        return *untested(diff, **settings), 1.0, NO_RATIO
    documents = sum(s.n for s in strata)
    if documents < means.MIN_UNBOUNDED:  # zero-inflated, skewed log-likelihood changes: benchmarks/small_samples.py
        return *untested(diff, **settings), 1.0, means.too_few_unbounded(documents, PERPLEXITY_VALUES)
    return *ratio_reading(form, draws=draws, seed=seed, diff=diff, **settings), ""


def _perplexity(reference: Sequence[Any], candidate: Sequence[Any], name: str, scores: tuple[float, float],
                **settings: Any) -> tuple[Interval, dict[str, float], float, str] | None:
    """A task's perplexity-family row: perplexity_reading of its one stratum (None: not lm-eval's values)."""
    try:
        part = ratio.stratum(reference, candidate, name)
    except (TypeError, ValueError):
        return None
    return perplexity_reading([part], [1.0], name, scores, **settings)


def compare_paired(reference: Sequence[Any], candidate: Sequence[Any], *, aggregate: Callable[[list], float] | None,
                   aggregate_name: str, by_mean: bool, higher_is_better: bool | None, tolerance: float,
                   relative: bool = False, confidence: float = 0.95, iterations: int = 10_000,
                   aggregate_iterations: int = 1_000, seed: int = 0, family: int = 1,
                   analytic: bool = False, bounds: tuple[float, float] | None = None) -> Comparison:
    """The interval and the one-sided p-values for one metric's paired per-document values.

    by_mean (the metric's aggregation is the mean) with 0/1 values: Tango's interval, McNemar's test and the
    exact p-values (tost.py); with other numbers: mean_reading (betting or sign-flip, means.py); anything else
    (perplexity's (ll, words), BLEU's (ref, pred), a non-mean aggregation) or relative (tolerance a fraction
    of the reference's score): the bootstrap of the aggregation itself (from bootstrap.MIN_DOCUMENTS documents on),
    except analytic (aggregate is lm-eval's perplexity-family aggregation aggregate_name): the sign-flip test of
    the documents' log-likelihood changes (perplexity_reading). confidence is 1 - alpha: the
    interval is the (1 - 2 alpha) one that the two one-sided tests at alpha read. family: the rows the
    verdicts are Holm-adjusted over, which sizes the resamples (resamples_for). bounds: the range [lo, hi] the
    user declared the values to lie in (--range-for; checked against them before), read by betting as [0, 1] is.
    """
    nan, notes = math.nan, [] if higher_is_better is not None else [
        "direction unknown (higher_is_better null): diff is candidate - reference, unoriented"]
    scores, mcnemar, method, floor = (nan, nan), (None, None, None), None, 0.0
    changed = sum(map(operator.ne, reference, candidate))
    needed = resamples_for(family, 1.0 - confidence)
    try:
        if aggregate is None:
            raise ValueError(f"aggregation {aggregate_name!r} is not in lm-eval's registry")
        scores = (float(aggregate(list(reference))), float(aggregate(list(candidate))))
        settings = dict(tolerance=tolerance, confidence=confidence, higher_is_better=higher_is_better)
        if by_mean and not relative and all_binary(reference, candidate):
            method = "tango"
            interval, mcnemar, p = _tango(np.asarray(reference, dtype=float), np.asarray(candidate, dtype=float),
                                          **settings)
            floor = tost.GAMMA if len(reference) >= tost.CONFINED_FROM else 0.0  # tost.plausible's allowance
        elif by_mean and all_scalar(reference, candidate) and not (relative and scores[0] == 0):
            method, interval, p, floor, note = mean_reading(np.asarray(reference, dtype=float),
                                                            np.asarray(candidate, dtype=float), relative=relative,
                                                            draws=max(iterations, needed), seed=seed,
                                                            bounds=bounds, **settings)
            notes += [note] if note else []
        elif analytic and (read := _perplexity(reference, candidate, aggregate_name, scores, relative=relative,
                                               draws=max(iterations, needed), seed=seed, **settings)) is not None:
            method, (interval, p, floor, note) = f"sign-flip {aggregate_name}", read
            notes += [note] if note else []
        else:
            fast = (corpus.additive(aggregate, reference, scores[0]), corpus.additive(aggregate, candidate, scores[1]))
            count = max(iterations, needed)
            count = count if None not in fast else min(count, aggregate_iterations)  # slow: each re-aggregates
            method, short = f"bootstrap {aggregate_name}", too_few(len(reference))
            if short:
                diff = relative_change(*scores) if relative else scores[1] - scores[0]
                (interval, p), floor = untested(diff, **settings), 1.0
                notes.append(short)
            else:
                interval, p = bootstrap_reading(*aggregate_statistics(
                    reference, candidate, aggregate, relative=relative, iterations=count, seed=seed, fast=fast),
                    **settings)
                floor = 1.0 / (count + 1)
    except (TypeError, ValueError, ZeroDivisionError, KeyError, IndexError) as error:
        return Comparison(*scores, nan, nan, nan, *mcnemar, method, **NO_EVIDENCE,
                          note="; ".join(notes + [f"not compared: {error}"]), changed=changed)
    if math.isnan(interval.low) or math.isnan(interval.high):
        notes.append("no interval: the values or their aggregation are NaN")
    elif not interval.high > interval.low:
        notes.append("zero-width interval: the paired differences never vary, which is no evidence of equivalence")
    return Comparison(*scores, interval.diff, interval.low, interval.high, *mcnemar, method, **p,
                      note="; ".join(notes), p_floor=floor, changed=changed)
