"""The paired bootstrap (Efron & Tibshirani, 1993; for NLP, Koehn 2004 and Dror et al. 2018), for every metric
that is not a 0/1 score averaged over documents. Pure functions, no I/O.

Documents are resampled with replacement, each document's pair of values kept together, and the interval of the
difference is read off the percentiles. The statistic is the mean paired difference, or for corpus-level metrics
(perplexity, BLEU, F1, ...) the metric's own aggregation of the candidate's resample minus that of the
reference's, on the same resampled documents (relative: that difference over |the reference's|). Resamples are drawn in bounded chunks.

Resamples are sized to the family: a bootstrap p-value is at least 1 / (B + 1), and Holm over m rows needs
alpha / m, so a bootstrap draws at least 20 m / alpha resamples (resamples_for).

The percentile bootstrap is asymptotic: on few documents its resamples vary less than the documents do (a
resample of 2 documents is one of 3 tables), and it falsely calls a row worse 25 % of the time at 2 documents,
10 % at 5 (benchmarks/small_samples.py). A row read by it on fewer than MIN_DOCUMENTS documents (for a group,
in its smallest leaf, whose resamples vary least) shows no evidence either way: too_few says why.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from evalkit.compare.statistics import corpus
from evalkit.compare.statistics.interval import Interval, orient, relative_change

MAX_CELLS = 1 << 21  # resampled document indices held at once by the bootstrap (16 MiB of float64)
RESOLUTION = 20  # resamples per unit of the level a row needs (alpha / family): a p-value floor 20 times below it


MIN_DOCUMENTS = 30  # fewest documents a percentile bootstrap is read at: measured, benchmarks/small_samples.py


def too_few(documents: int) -> str:
    """The note of a bootstrap row on fewer than MIN_DOCUMENTS documents ("" from MIN_DOCUMENTS on)."""
    if documents >= MIN_DOCUMENTS:
        return ""
    return (f"{documents} documents: a percentile bootstrap does not hold its level on fewer than {MIN_DOCUMENTS}, "
            "so this row is not tested (inconclusive, whatever it shows)")


def resamples_for(family: int, alpha: float) -> int:
    """Fewest bootstrap resamples whose p-value floor, 1 / (B + 1), lies RESOLUTION times below alpha / family."""
    return int(math.ceil(RESOLUTION * max(family, 1) / alpha))


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
    """aggregate(candidate) - aggregate(reference) (relative: that over |aggregate(reference)|) and the same over paired resamples;
    fast: each run's corpus.additive counts (None: read here), which make a resample a sum."""
    if len(reference) == 0 or len(reference) != len(candidate):
        raise ValueError(f"need paired documents, got {len(reference)} and {len(candidate)}")
    fast = fast or (corpus.additive(aggregate, reference), corpus.additive(aggregate, candidate))

    def statistic(ref: Any, cand: Any) -> Any:
        return relative_change(ref, cand) if relative else cand - ref

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
