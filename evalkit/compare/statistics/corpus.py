"""Resampling corpus-level metrics fast, where their score is a function of per-document counts that add up.

lm-eval's ``bleu`` aggregation is sacrebleu's ``corpus_bleu`` with its defaults, and corpus BLEU is a function of
the n-gram matches, n-gram totals, hypothesis and reference lengths summed over the segments (Papineni et al.
2002; sacrebleu sums them the same way). Each document's counts are read once through sacrebleu's public
``BLEU.sentence_score``; a resample then sums them and scores the sum as ``BLEU.compute_bleu`` does (bleu_scores,
vectorised over resamples), in microseconds instead of re-tokenising every segment (0.15 s per resample of
1,012 segments). The read checks
itself: the counts of all documents must give lm-eval's own score of the corpus, or the metric is resampled the
slow way (every resample re-aggregated by lm-eval's function). Other aggregations are always resampled the slow
way.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np

ORDER = 4  # corpus_bleu's default max n-gram order


@lru_cache(maxsize=1 << 16)
def _segment_counts(pred: str, refs: tuple[str, ...]) -> tuple[float, ...]:
    """sys_len, ref_len, matches and totals of each n-gram order of one segment (a group row and its leaves' rows
    read the same segments: read once)."""
    from sacrebleu.metrics import BLEU

    score = BLEU(effective_order=True).sentence_score(pred, list(refs))  # the counts do not depend on the order
    return (score.sys_len, score.ref_len, *score.counts, *score.totals)


def _bleu_counts(items: Sequence[Any]) -> np.ndarray:
    """(documents, 2 + 2 ORDER) counts per document. An item is (reference or references, prediction or
    [prediction]), as lm-eval's bleu metric passes it through."""
    rows = []
    for ref, pred in items:
        refs = (ref,) if isinstance(ref, str) else tuple(ref)
        (pred,) = [pred] if isinstance(pred, str) else list(pred)
        rows.append(_segment_counts(pred, refs))
    return np.asarray(rows, dtype=float)


def bleu_scores(summed: np.ndarray) -> np.ndarray:
    """Corpus BLEU of each row of summed counts, as sacrebleu's BLEU.compute_bleu(smooth_method="exp") computes it
    (corpus_bleu's defaults), vectorised: the brevity penalty, the n-gram precisions up to the first order with no
    n-grams, an order with no match smoothed by 1 / 2^k (k: such orders so far), log 0 floored as sacrebleu floors it.
    tests/test_stats.py checks it against compute_bleu."""
    summed = np.atleast_2d(np.asarray(summed, dtype=float))
    sys_len, ref_len = summed[:, 0], summed[:, 1]
    correct, total = summed[:, 2:2 + ORDER], summed[:, 2 + ORDER:]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        penalty = np.where(sys_len < ref_len, np.where(sys_len > 0, np.exp(1 - ref_len / sys_len), 0.0), 1.0)
        alive = np.cumprod(total > 0, axis=1).astype(bool)  # sacrebleu stops at the first order with no n-grams
        unmatched = (correct == 0) & alive
        precision = np.where(unmatched, 100.0 / (2.0 ** np.cumsum(unmatched, axis=1) * total), 100.0 * correct / total)
        precision = np.where(alive, precision, 0.0)
        logs = np.where(precision > 0, np.log(np.where(precision > 0, precision, 1.0)), -9999999999.0)
        score = penalty * np.exp(logs.sum(axis=1) / ORDER)
    return np.where(correct.any(axis=1), score, 0.0)


def additive(aggregate: Callable[[list], float], values: Sequence[Any], score: float | None = None
             ) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]] | None:
    """(per-document counts, scores of summed counts) for lm-eval's bleu aggregation when they reproduce its score
    of values (score: that score, when already computed), else None."""
    from lm_eval.api.registry import get_aggregation

    if aggregate is not get_aggregation("bleu") or not values:
        return None
    try:
        counts = _bleu_counts(values)
    except (TypeError, ValueError, IndexError):
        return None
    expected = aggregate(list(values)) if score is None else score
    summed = float(bleu_scores(counts.sum(axis=0))[0])
    return (counts, bleu_scores) if math.isclose(summed, expected, rel_tol=1e-9, abs_tol=1e-9) else None


def resampled(aggregate: Callable[[list], float], values: Sequence[Any], rows: np.ndarray,
              fast: tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]] | None) -> np.ndarray:
    """aggregate over each resample (a row of document indices), through the summed counts where fast."""
    if fast is None:
        return np.array([aggregate([values[i] for i in row]) for row in rows], dtype=float)
    counts, scores = fast
    n = len(counts)
    times = np.bincount((np.arange(len(rows))[:, None] * n + rows).ravel(), minlength=len(rows) * n)
    return scores(times.reshape(len(rows), n).astype(float) @ counts)  # each document's counts times its draws
