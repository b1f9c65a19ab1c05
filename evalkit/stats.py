"""Paired statistics for comparing two runs on the same documents. Pure functions, no I/O.

* Paired bootstrap (Efron & Tibshirani, 1993; for NLP, Koehn 2004 and Dror et al. 2018): resample
  documents with replacement, keeping each document's pair of scores together, and read the
  confidence interval of the mean difference off the percentiles.
* McNemar's exact test (McNemar 1947): for 0/1 metrics only the discordant documents (b: right in the
  reference only, c: right in the candidate only) carry information; under no change b ~ Binomial(b+c, 1/2).
* The verdict is a non-inferiority/equivalence reading of the interval against a tolerance, not "p > 0.05".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import binomtest

VERDICTS = ("equivalent", "better", "worse", "inconclusive")


@dataclass(frozen=True)
class Interval:
    diff: float  # mean(candidate - reference), oriented so that positive is better
    low: float
    high: float
    confidence: float


def paired_bootstrap(reference: np.ndarray, candidate: np.ndarray, *, iterations: int = 10_000,
                     confidence: float = 0.95, seed: int = 0, higher_is_better: bool = True) -> Interval:
    """Percentile interval of the mean paired difference, oriented so that positive means better."""
    delta = np.asarray(candidate, dtype=float) - np.asarray(reference, dtype=float)
    if not higher_is_better:
        delta = -delta
    n = len(delta)
    if n == 0:
        raise ValueError("no paired documents to compare")
    rng = np.random.default_rng(seed)
    means = delta[rng.integers(0, n, size=(iterations, n))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return Interval(diff=float(delta.mean()), low=float(low), high=float(high), confidence=confidence)


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


def verdict(interval: Interval, tolerance: float) -> str:
    """Read the oriented interval against +-tolerance (in the metric's units):

    equivalent    the whole interval lies inside (-tolerance, +tolerance)
    worse         the whole interval lies below 0 and reaches -tolerance or beyond
    better        the whole interval lies above 0 and reaches +tolerance or beyond
    inconclusive  anything else: the interval straddles 0 and a tolerance edge (more documents needed)
    """
    if -tolerance < interval.low and interval.high < tolerance:
        return "equivalent"
    if interval.high < 0:
        return "worse"
    if interval.low > 0:
        return "better"
    return "inconclusive"
