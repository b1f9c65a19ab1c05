"""Paired statistics for comparing two runs on the same documents. Pure functions, no I/O.

* 0/1 metrics averaged over documents: Tango's asymptotic score interval for the difference of paired
  proportions (Tango 1998, Statistics in Medicine 17:891-908, with the correction in Stat Med 18:3511, 1999),
  one of the intervals Fagerland, Lydersen & Laake (2014, "Recommended tests and confidence intervals for
  paired binomial proportions", Stat Med 33:2850-2875) recommend. Unlike a bootstrap it keeps its width when
  no document flips: with none of n documents changing it still spans +-z^2/(n+z^2) (+-0.088 at n=40).
  Newcombe's hybrid score interval (1998, method 10) would collapse to zero width there. The comparison shows
  the interval its exact tests invert instead (tost.tango_limits), so the interval and the verdict agree.
* McNemar's exact test (McNemar 1947): for 0/1 metrics only the discordant documents (b: right in the
  reference only, c: right in the candidate only) carry information; under no change b ~ Binomial(b+c, 1/2).
* Everything else: the paired bootstrap (Efron & Tibshirani, 1993; for NLP, Koehn 2004 and Dror et al.
  2018): resample documents with replacement, keeping each document's pair of values together, and read the
  interval of the difference off the percentiles. The statistic is the mean paired difference, or for
  corpus-level metrics (perplexity, BLEU, F1, ...) the metric's own aggregation of the candidate's resample
  minus that of the reference's, on the same resampled documents. Resamples are drawn in bounded chunks.
* The p-values of the one-sided tests against the tolerance (evalkit/compare/tost.py) go with each interval;
  evalkit/compare/verdict.py turns them into verdicts, Holm-adjusted over every row of a comparison.
* A relative comparison (unbounded metrics: perplexity, BLEU, ...) bootstraps candidate / reference - 1.
* lm-eval's perplexity-family aggregations (perplexity, word/byte perplexity, bits_per_byte) are not resampled:
  evalkit/compare/ratio.py tests them analytically (the delta method), so their p-values have no floor.
* Resamples are sized to the family: a bootstrap p-value is at least 1 / (B + 1), and Holm over m rows needs
  alpha / m, so a bootstrap draws at least 20 m / alpha resamples (resamples_for); corpus-level aggregations
  that re-aggregate every resample at most aggregate_iterations (BLEU, whose resamples are sums of per-document
  counts, evalkit/compare/corpus.py, is not bounded). Each row says the smallest
  p-value its method can give (p_floor), and verdict.decide says where that limits the row.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from scipy.optimize import brentq
from scipy.stats import binomtest, norm

from evalkit.compare import corpus, ratio, tost

MAX_CELLS = 1 << 21  # resampled document indices held at once by the bootstrap (16 MiB of float64)
RESOLUTION = 20  # resamples per unit of the level a row needs (alpha / family): a p-value floor 20 times below it


def resamples_for(family: int, alpha: float) -> int:
    """Fewest bootstrap resamples whose p-value floor, 1 / (B + 1), lies RESOLUTION times below alpha / family."""
    return int(math.ceil(RESOLUTION * max(family, 1) / alpha))


@dataclass(frozen=True)
class Interval:
    diff: float  # candidate - reference, negated where lower is better: positive is better when oriented
    low: float
    high: float
    confidence: float


def orient(interval: Interval, higher_is_better: bool | None) -> Interval:
    """Negate a candidate - reference interval for lower-is-better metrics; unknown direction stays as is."""
    if higher_is_better is not False:
        return interval
    return Interval(diff=0.0 - interval.diff, low=0.0 - interval.high, high=0.0 - interval.low,
                    confidence=interval.confidence)


def z_value(confidence: float) -> float:
    return float(norm.ppf(0.5 + confidence / 2))


def tango_score(delta: float, b: int, c: int, n: int) -> float:
    """Tango's score statistic for H0: p_cand - p_ref = delta, from the discordant counts b (right in the
    reference only) and c (right in the candidate only) of n documents.

    In Tango's notation (Fagerland et al. 2014, eq. for the "Tango asymptotic score interval") n12 = c,
    n21 = b; p21 is replaced by its maximum-likelihood estimate under H0, the root of a quadratic.
    """
    qa = 2 * n
    qb = -b - c + (2 * n - c + b) * delta
    qc = -b * delta * (1 - delta)
    p21 = (math.sqrt(max(qb * qb - 4 * qa * qc, 0.0)) - qb) / (2 * qa)
    variance = n * (2 * p21 + delta * (1 - delta))
    return (c - b - n * delta) / math.sqrt(max(variance, 1e-300))


def tango_interval(b: int, c: int, n: int, *, confidence: float = 0.95) -> Interval:
    """Tango's score interval for p_cand - p_ref: the deltas in (-1, 1) whose score lies within +-z.

    The score is infinite at the edges -1 and 1 unless every document flipped one way, in which case that
    edge itself is the limit. Closed form when nothing flipped (b = c = 0): +-z^2 / (n + z^2).
    """
    if n <= 0 or b < 0 or c < 0 or b + c > n:
        raise ValueError(f"no valid paired table: b={b}, c={c}, n={n}")
    z, estimate = z_value(confidence), (c - b) / n
    edge = 1.0 - 1e-12

    def limit(target: float, lo: float, hi: float) -> float:
        return float(brentq(lambda d: tango_score(d, b, c, n) - target, lo, hi, xtol=1e-12))

    low = -1.0 if b == n else limit(z, -edge, estimate)
    high = 1.0 if c == n else limit(-z, estimate, edge)
    return Interval(diff=estimate, low=low, high=high, confidence=confidence)


def documents_needed(tolerance: float, *, confidence: float = 0.95) -> int:
    """Fewest documents that, with none flipping, show a 0/1 metric equivalent within +-tolerance on their own:
    the two one-sided tests (tost.tango_p, exact at every size) at alpha = 1 - confidence."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance {tolerance} must lie in (0, 1) for 0/1 metrics")
    alpha = 1.0 - confidence
    shown = lambda n: tost.tango_p(0, 0, n, -tolerance, "above") < alpha  # noqa: E731 (symmetric at b = c = 0)
    low, high = 1, 2
    while not shown(high):
        low, high = high, high * 2
    while high - low > 1:  # shown(high) holds, shown(low) does not (or low = 1)
        middle = (low + high) // 2
        low, high = (low, middle) if shown(middle) else (middle, high)
    return high if not shown(low) else low


def resamples(n: int, iterations: int, *, seed: int, max_cells: int = MAX_CELLS) -> Iterator[np.ndarray]:
    """Bootstrap document indices, (rows, n) at a time with rows * n <= max_cells (at least one row).

    Indices come from uniform floats (one draw each), so the resamples are the same whatever the chunk size.
    """
    rng = np.random.default_rng(seed)
    rows = max(1, max_cells // max(n, 1))
    for start in range(0, iterations, rows):
        count = min(rows, iterations - start)
        yield np.minimum((rng.random((count, n)) * n).astype(np.intp), n - 1)


def _percentiles(diff: float, statistics: np.ndarray, confidence: float) -> Interval:
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(statistics, [alpha, 1 - alpha])
    return Interval(diff=float(diff), low=float(low), high=float(high), confidence=confidence)


def bootstrap_means(delta: np.ndarray, *, iterations: int, seed: int, max_cells: int = MAX_CELLS) -> np.ndarray:
    """The mean of each resample of the paired differences delta."""
    return np.concatenate([delta[idx].mean(axis=1)
                           for idx in resamples(len(delta), iterations, seed=seed, max_cells=max_cells)])


def paired_bootstrap(reference: np.ndarray, candidate: np.ndarray, *, iterations: int = 10_000,
                     confidence: float = 0.95, seed: int = 0, higher_is_better: bool | None = True,
                     max_cells: int = MAX_CELLS) -> Interval:
    """Percentile interval of the mean paired difference (candidate - reference, then oriented)."""
    delta = np.asarray(candidate, dtype=float) - np.asarray(reference, dtype=float)
    if len(delta) == 0:
        raise ValueError("no paired documents to compare")
    means = bootstrap_means(delta, iterations=iterations, seed=seed, max_cells=max_cells)
    return orient(_percentiles(delta.mean(), means, confidence), higher_is_better)


def aggregate_statistics(reference: Sequence[Any], candidate: Sequence[Any], aggregate: Callable[[list[Any]], float],
                         *, iterations: int, seed: int, relative: bool = False, max_cells: int = MAX_CELLS,
                         fast: tuple | None = None) -> tuple[float, np.ndarray]:
    """aggregate(candidate) - aggregate(reference) (relative: their ratio - 1) and the same over paired resamples;
    fast: each run's corpus.additive counts (None: read here), which make a resample a sum."""
    if len(reference) == 0 or len(reference) != len(candidate):
        raise ValueError(f"need paired documents, got {len(reference)} and {len(candidate)}")
    fast = fast or (corpus.additive(aggregate, reference), corpus.additive(aggregate, candidate))

    def statistic(ref: Any, cand: Any) -> Any:
        return cand / ref - 1.0 if relative else cand - ref

    with warnings.catch_warnings():  # resamples of one class make sklearn's F1/MCC warn, once per resample
        warnings.simplefilter("ignore")
        statistics = np.concatenate([statistic(corpus.resampled(aggregate, reference, idx, fast[0]),
                                               corpus.resampled(aggregate, candidate, idx, fast[1]))
                                     for idx in resamples(len(reference), iterations, seed=seed, max_cells=max_cells)])
    return statistic(aggregate(list(reference)), aggregate(list(candidate))), statistics


def paired_bootstrap_aggregate(reference: Sequence[Any], candidate: Sequence[Any],
                               aggregate: Callable[[list[Any]], float], *, iterations: int = 1_000,
                               confidence: float = 0.95, seed: int = 0, higher_is_better: bool | None = True,
                               max_cells: int = MAX_CELLS) -> Interval:
    """Percentile interval of aggregate(candidate) - aggregate(reference) over paired document resamples.

    For corpus-level metrics whose per-document values are not scores (perplexity's (log-likelihood,
    words), BLEU's (reference, prediction), ...): each resample draws the same documents for both runs.
    """
    diff, statistics = aggregate_statistics(reference, candidate, aggregate, iterations=iterations, seed=seed,
                                            max_cells=max_cells)
    return orient(_percentiles(diff, statistics, confidence), higher_is_better)


def mcnemar_exact(reference: np.ndarray, candidate: np.ndarray) -> tuple[int, int, float]:
    """(b, c, two-sided exact p): b documents right only in the reference, c right only in the candidate."""
    ref = np.asarray(reference).astype(bool)
    cand = np.asarray(candidate).astype(bool)
    b = int(np.sum(ref & ~cand))
    c = int(np.sum(~ref & cand))
    if b + c == 0:
        return b, c, 1.0
    return b, c, float(binomtest(b, b + c, 0.5, alternative="two-sided").pvalue)


def is_binary(values: np.ndarray) -> bool:
    return bool(np.isin(np.asarray(values, dtype=float), (0.0, 1.0)).all())


def all_scalar(*runs: Sequence[Any]) -> bool:
    return all(isinstance(v, numbers.Real) for values in runs for v in values)


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
    method: str | None  # "tango", "bootstrap" (mean difference) or "bootstrap <aggregation>"
    p_worse: float  # one-sided p-values (tost_p_values), before any adjustment for the number of rows
    p_better: float
    p_equivalent: float
    p_lower: float
    p_higher: float
    note: str  # why a reading is weaker than it looks ("" when nothing to say)
    p_floor: float = 0.0  # the smallest p-value the method can give: 1 / (resamples + 1) for a bootstrap, else 0


def _tango(ref: np.ndarray, cand: np.ndarray, *, tolerance: float, confidence: float,
           higher_is_better: bool | None) -> tuple[Interval, tuple, dict[str, float]]:
    b, c, p = mcnemar_exact(ref, cand)
    n = len(ref)
    low, high = tost.tango_limits(b, c, n, 1.0 - confidence, points=(-tolerance, 0.0, tolerance))  # what they test
    interval = orient(Interval((c - b) / n, low, high, 2 * confidence - 1), higher_is_better)
    return interval, (b, c, p), tost_p_values(lambda t: tost.tango_p(b, c, n, t, "below"),
                                              lambda t: tost.tango_p(b, c, n, t, "above"),
                                              tolerance=tolerance, higher_is_better=higher_is_better)


def bootstrap_reading(diff: float, statistics: np.ndarray, *, tolerance: float, confidence: float,
                      higher_is_better: bool | None) -> tuple[Interval, dict[str, float]]:
    """The (1 - 2 alpha) percentile interval and the one-sided p-values of a bootstrap distribution."""
    interval = orient(Interval(float(diff), *tost.bootstrap_limits(statistics, 1.0 - confidence),
                               2 * confidence - 1), higher_is_better)  # the interval bootstrap_p inverts
    if not interval.high > interval.low:  # a point, or NaN: no evidence of anything
        return interval, dict(NO_EVIDENCE, p_better=math.nan if higher_is_better is None else 1.0)
    return interval, tost_p_values(lambda t: tost.bootstrap_p(statistics, t, "below"),
                                   lambda t: tost.bootstrap_p(statistics, t, "above"),
                                   tolerance=tolerance, higher_is_better=higher_is_better)


def delta_reading(reading: ratio.Reading, *, tolerance: float, confidence: float,
                  higher_is_better: bool | None) -> tuple[Interval, dict[str, float]]:
    """The (1 - 2 alpha) interval and the one-sided p-values of an analytic (delta-method) reading."""
    low, high = reading.interval(2 * confidence - 1)
    interval = orient(Interval(diff=reading.to_row(reading.estimate), low=low, high=high,
                               confidence=2 * confidence - 1), higher_is_better)
    if not reading.se > 0:  # the paired parts never vary: no evidence of anything
        return interval, dict(NO_EVIDENCE, p_better=math.nan if higher_is_better is None else 1.0)
    return interval, tost_p_values(lambda t: reading.p(t, "below"), lambda t: reading.p(t, "above"),
                                   tolerance=tolerance, higher_is_better=higher_is_better)


def _delta(reference: Sequence[Any], candidate: Sequence[Any], name: str, scores: tuple[float, float], *,
           relative: bool, **settings: Any) -> tuple[Interval, dict[str, float]] | None:
    """The analytic reading of a perplexity-family row, None where it does not reproduce lm-eval's scores."""
    try:
        reading = ratio.read([ratio.stratum(reference, candidate, name)], [1.0], name, relative=relative)
    except (TypeError, ValueError, ZeroDivisionError):  # not the values the aggregation's ratio is made of
        return None
    if not np.allclose(reading.scores, scores, rtol=1e-9, atol=0.0):
        return None
    return delta_reading(reading, **settings)


def compare_paired(reference: Sequence[Any], candidate: Sequence[Any], *, aggregate: Callable[[list], float] | None,
                   aggregate_name: str, by_mean: bool, higher_is_better: bool | None, tolerance: float,
                   relative: bool = False, confidence: float = 0.95, iterations: int = 10_000,
                   aggregate_iterations: int = 1_000, seed: int = 0, family: int = 1,
                   analytic: bool = False) -> Comparison:
    """The interval and the one-sided p-values for one metric's paired per-document values.

    by_mean (the metric's aggregation is the mean) with 0/1 values: Tango's interval, McNemar's test and the
    exact p-values (tost.py); with other numbers: the bootstrap of the mean difference; anything else
    (perplexity's (ll, words), BLEU's (ref, pred), a non-mean aggregation) or relative (tolerance a fraction
    of the reference's score): the bootstrap of the aggregation itself, except analytic (aggregate is lm-eval's
    perplexity-family aggregation aggregate_name): the delta method (ratio.py). confidence is 1 - alpha: the
    interval is the (1 - 2 alpha) one that the two one-sided tests at alpha read. family: the rows the
    verdicts are Holm-adjusted over, which sizes the resamples (resamples_for).
    """
    nan, notes = math.nan, [] if higher_is_better is not None else [
        "direction unknown (higher_is_better null): diff is candidate - reference, unoriented"]
    scores, mcnemar, method, floor = (nan, nan), (None, None, None), None, 0.0
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
        elif by_mean and not relative and all_scalar(reference, candidate):
            method, delta = "bootstrap", np.asarray(candidate, dtype=float) - np.asarray(reference, dtype=float)
            count = max(iterations, needed)
            interval, p = bootstrap_reading(float(delta.mean()),
                                            bootstrap_means(delta, iterations=count, seed=seed), **settings)
            floor = 1.0 / (count + 1)
        elif analytic and (read := _delta(reference, candidate, aggregate_name, scores, relative=relative,
                                          **settings)) is not None:
            method, (interval, p) = f"delta {aggregate_name}", read
        else:
            fast = (corpus.additive(aggregate, reference, scores[0]), corpus.additive(aggregate, candidate, scores[1]))
            count = max(iterations, needed)
            count = count if None not in fast else min(count, aggregate_iterations)  # slow: each re-aggregates
            method = f"bootstrap {aggregate_name}"
            interval, p = bootstrap_reading(*aggregate_statistics(
                reference, candidate, aggregate, relative=relative, iterations=count, seed=seed, fast=fast),
                **settings)
            floor = 1.0 / (count + 1)
    except (TypeError, ValueError, ZeroDivisionError, KeyError, IndexError) as error:
        return Comparison(*scores, nan, nan, nan, *mcnemar, method, **NO_EVIDENCE,
                          note="; ".join(notes + [f"not compared: {error}"]))
    if math.isnan(interval.low) or math.isnan(interval.high):
        notes.append("no interval: the values or their aggregation are NaN")
    elif not interval.high > interval.low:
        notes.append("zero-width interval: the paired differences never vary, which is no evidence of equivalence")
    return Comparison(*scores, interval.diff, interval.low, interval.high, *mcnemar, method, **p,
                      note="; ".join(notes), p_floor=floor)
