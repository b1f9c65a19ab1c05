"""The divergence figures over many positions, with intervals that come from documents.

Positions in one document are not independent (one hard question shifts all its tokens), so every interval here
treats the document as the unit: each mean over positions is a ratio of sums over documents, R = sum_d num_d /
sum_d n_d, whose standard error is the cluster-robust (delta-method) one of evalkit/compare/statistics/ratio.py's leaves:
the spread over documents of (num_d - R n_d) / mean(n), divided by sqrt(D) (Cochran, Sampling Techniques, 3rd
ed., 6.9; the CR1 sandwich of a ratio). That is the "+-" shown beside each mean. The intervals:

* Mean KLD: per-document KLD is positive and heavily right-skewed, and a t interval on R (or on log R) covers
  too little at tens of documents (benchmarks/divergence_coverage.py: 0.86 at 10 documents). So its interval
  is a studentized document bootstrap of log R (bootstrap-t, Efron & Tibshirani 1993, 12.5 and 14.3):
  BOOTSTRAP resamples of the documents, each studentized by its own delta-method standard error, with a fixed
  seed, so the same runs always give the same interval.
* Same top p: the share of agreeing among decided positions, with Korn & Graubard's interval for a clustered
  proportion (1998, Survey Methodology 24:193): Clopper-Pearson at the effective sample size N / deff, deff =
  (cluster-robust variance) / (binomial variance), at least 1, scaled by (z / t_{D-1})^2; it keeps its width
  when every position agrees.
* Mean Δp, Mean ln(PPL(Q)/PPL(base)) (the mean of ln p_ref - ln p_cand): Student t on D - 1 degrees of freedom
  (nearly symmetric per document: the coverage holds). RMS Δp: the root of the mean of Δp² and of its interval.
  Mean PPL(Q)/PPL(base): the exponential of the log ratio and of its interval.
* Percentiles of KLD and of Δp over all positions, as ``llama-perplexity --kl-divergence`` prints them (linear
  interpolation between order statistics, as its ``percentile``): no interval, as there.

Names follow llama.cpp (tools/perplexity/README.md), so the figures can be set side by side with its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np

from evalkit.compare.divergence.positions import Positions

KLD_PERCENTILES = (("Maximum", 100.0), ("99.9%", 99.9), ("99.0%", 99.0), ("95.0%", 95.0), ("90.0%", 90.0),
                   ("Median", 50.0), ("10.0%", 10.0), ("5.0%", 5.0), ("1.0%", 1.0), ("0.1%", 0.1),
                   ("Minimum", 0.0))
BOOTSTRAP = 1999  # resamples of the documents for the Mean KLD interval (2.5 % tails of 50 resamples each)
CHUNK = 1 << 20  # resample weights held at once (8 MiB of float64)
DP_PERCENTILES = KLD_PERCENTILES[:5] + (("75.0%", 75.0),) + KLD_PERCENTILES[5:6] + (("25.0%", 25.0),) \
    + KLD_PERCENTILES[6:]


@dataclass(frozen=True)
class Estimate:
    """A figure, its standard error and its interval at the summary's confidence (NaN where undefined)."""

    value: float
    se: float
    low: float
    high: float


@dataclass(frozen=True)
class Summary:
    """The figures of one task (or of all tasks together) over its documents."""

    documents: int
    positions: int
    exact_positions: int  # positions whose KLD is exact (both sides full); the rest are lower bounds
    captured: float  # mean reference mass known on both sides (1.0 where all exact)
    mean_kld: Estimate
    kld_percentiles: dict[str, float]
    same_top: Estimate
    undecided_top: int  # positions whose top-1 agreement is unknown, left out of same_top
    mean_dp: Estimate
    rms_dp: Estimate
    dp_percentiles: dict[str, float]
    ln_ppl_ratio: Estimate
    ppl_ratio: Estimate
    confidence: float


def document_index(documents: Sequence[Hashable]) -> tuple[np.ndarray, list]:
    """Each position's document as 0..D-1, and the D document keys in that order."""
    if isinstance(documents, np.ndarray) and documents.dtype != object:
        keys, index = np.unique(documents, return_inverse=True)
        return index.reshape(-1), keys.tolist()
    seen: dict[Hashable, int] = {}
    index = np.fromiter((seen.setdefault(d, len(seen)) for d in documents), dtype=np.int64, count=len(documents))
    return index, list(seen)


def _sums(values: np.ndarray, index: np.ndarray, count: int) -> np.ndarray:
    return np.bincount(index, weights=values, minlength=count)


def ratio_estimate(num: np.ndarray, den: np.ndarray, *, confidence: float) -> Estimate:
    """sum(num) / sum(den) over documents, its cluster-robust standard error and t interval (D - 1 df)."""
    from scipy.stats import t as student  # imported here: it costs every compare 0.3 s to import

    keep = den > 0
    num, den = num[keep], den[keep]
    if len(den) == 0:
        return Estimate(math.nan, math.nan, math.nan, math.nan)
    r = float(num.sum() / den.sum())
    if len(den) < 2:
        return Estimate(r, math.nan, math.nan, math.nan)
    influence = (num - r * den) / den.mean()
    se = math.sqrt(float(np.var(influence, ddof=1)) / len(den))
    half = float(student.ppf(0.5 + confidence / 2, len(den) - 1)) * se
    return Estimate(r, se, r - half, r + half)


def bootstrap_log_ratio(num: np.ndarray, den: np.ndarray, *, confidence: float, resamples: int = BOOTSTRAP,
                        seed: int = 0) -> Estimate:
    """sum(num) / sum(den) of a positive quantity with a studentized document bootstrap interval of its log."""
    plain = ratio_estimate(num, den, confidence=confidence)
    keep = den > 0
    num, den = num[keep], den[keep]
    r, se, d = plain.value, plain.se, len(den)
    if not (r > 0 and se > 0):
        return plain
    rng = np.random.default_rng(seed)
    stats = []
    for start in range(0, resamples, max(1, CHUNK // d)):
        w = rng.multinomial(d, np.full(d, 1.0 / d), size=min(resamples - start, max(1, CHUNK // d))).astype(float)
        total_num, total_den = w @ num, w @ den
        rb = total_num / total_den
        # each resample's own delta-method standard error (its influences have mean 0 by construction)
        squares = (w * (num[None, :] - rb[:, None] * den[None, :]) ** 2).sum(axis=1)
        var = squares / (total_den / d) ** 2 / (d * (d - 1))
        ok = (rb > 0) & (var > 0)  # a resample of one document repeated has no spread to studentize by
        stats.append((np.log(rb[ok]) - math.log(r)) / (np.sqrt(var[ok]) / rb[ok]))
    t = np.concatenate(stats)
    if len(t) == 0:
        return plain
    upper, lower = np.percentile(t, [100 * (0.5 + confidence / 2), 100 * (0.5 - confidence / 2)])
    return Estimate(r, se, r * math.exp(-upper * se / r), r * math.exp(-lower * se / r))


def clustered_share(agree: np.ndarray, decided: np.ndarray, *, confidence: float) -> Estimate:
    """A share of positions with Korn & Graubard's interval for clustered data (module docstring)."""
    from scipy.stats import beta, norm, t as student  # imported here, as ratio_estimate's

    plain = ratio_estimate(agree, decided, confidence=confidence)
    total, documents = float(decided.sum()), int((decided > 0).sum())
    if not total > 0 or documents < 2:
        return plain
    p = plain.value
    binomial = p * (1 - p) / total
    deff = max(1.0, plain.se ** 2 / binomial) if binomial > 0 else 1.0
    quantile = 0.5 + confidence / 2
    n = total / deff * (float(norm.ppf(quantile)) / float(student.ppf(quantile, documents - 1))) ** 2
    x, tail = p * n, (1 - confidence) / 2
    low = float(beta.ppf(tail, x, n - x + 1)) if x > 0 else 0.0
    high = float(beta.ppf(1 - tail, x + 1, n - x)) if x < n else 1.0
    return Estimate(p, plain.se, low, high)


def _percentiles(values: np.ndarray, levels) -> dict[str, float]:
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return {name: math.nan for name, _ in levels}
    return {name: float(v) for (name, _), v in zip(levels, np.percentile(values, [q for _, q in levels]))}


def summarize(positions: Positions, documents: Sequence[Hashable], *, confidence: float = 0.95) -> Summary:
    """The figures of positions whose documents are given per position (any hashable key)."""
    if len(documents) != positions.n:
        raise ValueError(f"{len(documents)} document keys for {positions.n} positions")
    index, keys = document_index(documents)
    count = len(keys)
    n_d = np.bincount(index, minlength=count).astype(float)

    def mean_of(values: np.ndarray) -> Estimate:
        return ratio_estimate(_sums(values, index, count), n_d, confidence=confidence)

    decided = ~np.isnan(positions.same_top)
    square = mean_of(positions.delta_p ** 2)
    ln_ratio = mean_of(-positions.llr)
    return Summary(
        documents=count, positions=positions.n, exact_positions=int(positions.exact.sum()),
        captured=float(positions.captured.mean()) if positions.n else math.nan,
        mean_kld=bootstrap_log_ratio(_sums(positions.kld, index, count), n_d, confidence=confidence),
        kld_percentiles=_percentiles(positions.kld, KLD_PERCENTILES),
        same_top=clustered_share(_sums(np.where(decided, positions.same_top, 0.0), index, count),
                                  _sums(decided.astype(float), index, count), confidence=confidence),
        undecided_top=int((~decided).sum()),
        mean_dp=mean_of(positions.delta_p),
        rms_dp=Estimate(math.sqrt(square.value), square.se / (2 * math.sqrt(square.value))
                        if square.value > 0 else math.nan,
                        math.sqrt(max(square.low, 0.0)), math.sqrt(max(square.high, 0.0))),
        dp_percentiles=_percentiles(positions.delta_p, DP_PERCENTILES),
        ln_ppl_ratio=ln_ratio,
        ppl_ratio=Estimate(math.exp(ln_ratio.value), math.exp(ln_ratio.value) * ln_ratio.se,
                           math.exp(ln_ratio.low), math.exp(ln_ratio.high)),
        confidence=confidence)


def summarize_tasks(tasks: Mapping[str, tuple[Positions, Sequence[Hashable]]], *,
                    confidence: float = 0.95) -> tuple[dict[str, Summary], Summary]:
    """Each task's figures, and all tasks together (every position weighs the same, as in llama.cpp; each
    task's documents stay distinct clusters)."""
    per_task = {name: summarize(p, docs, confidence=confidence) for name, (p, docs) in tasks.items()}
    everything = Positions.concat([p for p, _ in tasks.values()])
    keys = [(name, d) for name, (_, docs) in tasks.items() for d in docs]
    return per_task, summarize(everything, keys, confidence=confidence)


def document_divergence(kld: np.ndarray, documents: Sequence[Hashable]) -> dict[Hashable, float]:
    """Mean KLD per document: the input of the verdict against noise (evalkit/compare/divergence/verdict.py)."""
    index, keys = document_index(documents)
    means = _sums(np.asarray(kld, dtype=float), index, len(keys)) / np.bincount(index, minlength=len(keys))
    return {key: float(means[i]) for i, key in enumerate(keys)}
