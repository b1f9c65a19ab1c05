"""lm-eval's perplexity-family aggregations as ratios of per-document sums: the form the sign-flip test reads
(paired_sums), and the delta method for what has no such form (read).

Where the documents' denominators are the same in both runs (words and bytes are the document's), a relative
perplexity row and every bits_per_byte row is sum(d) / sum(u) over the documents (paired_sums), which
means.sign_flip tests at every size; the delta method below reads the rest (an absolute perplexity row, a group
of perplexity leaves).

lm-eval's ``perplexity`` (exp(-mean(ll))), ``weighted_perplexity`` (word_perplexity and byte_perplexity:
exp(-sum(ll) / sum(words or bytes))) and ``bits_per_byte`` (-sum(ll) / sum(bytes) / ln 2) are each a smooth
function of one ratio of sums, R = sum(num) / sum(den), over the documents (den = 1 for ``perplexity``). The
difference of two runs' scores on the same documents is a smooth function of the two ratios, and the delta
method (a first-order expansion; e.g. Casella & Berger, Statistical Inference, 5.5.4) gives its standard error
from each document's influence: (num_i - R den_i) / mean(den) for each run, paired document by document. A group
of such leaves, weighted (lm-eval's ``aggregate_subtask_metrics``), adds each leaf's part, the leaves
independent strata. The one-sided tests are Student t tests on that scale (Welch-Satterthwaite degrees of
freedom over the strata): for a relative comparison on log(candidate / reference), so that bounds
log(1 +- tolerance) are those of candidate / reference - 1; for an absolute one on candidate - reference.
The p-values are asymptotic: exact in the limit of many documents, as the t test of a paired mean is.
Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from scipy.stats import t as student

LN2 = math.log(2)
LOG_SCORE: dict[str, tuple[Callable[[float], float], Callable[[float], float]]] = {
    # aggregation -> (log of the score as a function of R, its derivative in R)
    "perplexity": (lambda r: -r, lambda r: -1.0),
    "weighted_perplexity": (lambda r: -r, lambda r: -1.0),
    "bits_per_byte": (lambda r: math.log(-r / LN2), lambda r: 1.0 / r),
}


@dataclass(frozen=True)
class Stratum:
    """One leaf's (or one task's) paired documents: numerators and denominators of the ratio in each run."""

    num: np.ndarray  # shape (2, n): reference, candidate
    den: np.ndarray

    @property
    def n(self) -> int:
        return self.num.shape[1]


def stratum(reference: Sequence[Any], candidate: Sequence[Any], aggregation: str) -> Stratum:
    """The ratio's parts from lm-eval's per-document values: ll (perplexity) or (ll, words or bytes) pairs."""
    if aggregation == "perplexity":
        num = np.array([reference, candidate], dtype=float)
        return Stratum(num=num, den=np.ones_like(num))
    pairs = np.array([[tuple(v) for v in reference], [tuple(v) for v in candidate]], dtype=float)
    if pairs.ndim != 3 or pairs.shape[2] != 2:
        raise ValueError(f"{aggregation}: expected (log-likelihood, count) pairs per document")
    return Stratum(num=pairs[..., 0], den=pairs[..., 1])


@dataclass(frozen=True)
class Reading:
    """The estimate on the test's scale, its standard error, degrees of freedom, and the map back to the row's
    scale (candidate / reference - 1, or candidate - reference)."""

    estimate: float
    se: float
    df: float
    scores: tuple[float, float]  # the reference's and the candidate's score (weighted over the strata)
    relative: bool

    def to_row(self, x: float) -> float:
        return math.expm1(x) if self.relative else x

    def to_test(self, bound: float) -> float:
        if not self.relative:
            return bound
        return math.log1p(bound) if bound > -1.0 else -math.inf

    def p(self, bound: float, side: str) -> float:
        """p-value for H1: row-scale difference < bound ("below") or > bound ("above")."""
        statistic = (self.estimate - self.to_test(bound)) / self.se
        return float(student.cdf(statistic, self.df) if side == "below" else student.sf(statistic, self.df))

    def interval(self, confidence: float) -> tuple[float, float]:
        """The two-sided interval at confidence on the row's scale (the one the one-sided tests invert)."""
        if not self.se > 0:
            return self.to_row(self.estimate), self.to_row(self.estimate)
        half = float(student.ppf(0.5 + confidence / 2, self.df)) * self.se
        return self.to_row(self.estimate - half), self.to_row(self.estimate + half)


def read(strata: list[Stratum], weights: Sequence[float], aggregation: str, *, relative: bool) -> Reading:
    """The delta-method reading of sum_k w_k score_k(candidate) against the same for the reference."""
    log_score, slope = LOG_SCORE[aggregation]
    w = np.asarray(weights, dtype=float) / float(np.sum(weights))
    ratios = [s.num.sum(axis=1) / s.den.sum(axis=1) for s in strata]  # per stratum: (R_ref, R_cand)
    scores = [np.exp([log_score(r) for r in pair]) for pair in ratios]
    totals = np.sum([wk * sk for wk, sk in zip(w, scores)], axis=0)  # (reference, candidate)
    parts, df_terms = [], []
    for wk, s, pair, sk in zip(w, strata, ratios, scores):
        # d score / d R = score * slope(R); relative: d log(total) = that / total
        gradient = [wk * sk[i] * slope(pair[i]) / (totals[i] if relative else 1.0) for i in (0, 1)]
        influence = [(s.num[i] - pair[i] * s.den[i]) / s.den[i].mean() for i in (0, 1)]
        paired = gradient[1] * influence[1] - gradient[0] * influence[0]
        variance = float(np.var(paired, ddof=1)) / s.n if s.n > 1 else math.nan
        parts.append(variance)
        df_terms.append(variance ** 2 / (s.n - 1) if s.n > 1 else math.nan)
    variance = float(np.sum(parts))
    df = variance ** 2 / float(np.sum(df_terms)) if variance > 0 else math.nan
    estimate = math.log(totals[1] / totals[0]) if relative else float(totals[1] - totals[0])
    return Reading(estimate=estimate, se=math.sqrt(variance), df=df, scores=(float(totals[0]), float(totals[1])),
                   relative=relative)


def paired_sums(part: Stratum, aggregation: str, *, relative: bool
                ) -> tuple[np.ndarray, np.ndarray, Callable[[float], float], Callable[[float], float]] | None:
    """The row's difference as a ratio of per-document sums, sum(d) / sum(u) with every u > 0, on the scale
    to_test maps a bound to (to_row maps it back), where the documents' denominators are the same in both runs
    (words and bytes are the document's): a relative perplexity row is exp(-sum(ll_c - ll_r) / sum(den)) - 1
    (to_test: log1p); a bits_per_byte row is sum(ll_c - ll_r) / sum(ll_r) relative, -sum(ll_c - ll_r) / ln 2 /
    sum(den) absolute. None for an absolute perplexity row (no ratio of sums) or where a unit is not positive:
    the delta method reads those. means.sign_flip tests such a ratio exactly where it can."""
    if not np.array_equal(part.den[0], part.den[1]):
        return None
    gain = part.num[1] - part.num[0]  # candidate's log-likelihood minus the reference's, per document
    same = (lambda x: x), (lambda x: x)
    if aggregation == "bits_per_byte":
        d, u, scale = (-gain, -part.num[0], same) if relative else (-gain / LN2, part.den[0], same)
    elif relative:
        d, u, scale = -gain, part.den[0], ((lambda x: math.log1p(x) if x > -1.0 else -math.inf),
                                           (lambda x: float(np.expm1(min(x, 700.0)))))
    else:
        return None
    return (d, u, *scale) if (u > 0).all() else None
