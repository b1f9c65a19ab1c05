"""Resampling corpus-level metrics fast, where their score is a function of per-document counts that add up.

lm-eval's ``bleu`` aggregation is sacrebleu's ``corpus_bleu`` with its defaults, and corpus BLEU is a function of
the n-gram matches, n-gram totals, hypothesis and reference lengths summed over the segments (Papineni et al.
2002; sacrebleu sums them the same way). Each document's counts are read once through sacrebleu's public
``BLEU.sentence_score``; a resample then sums them and scores the sum with ``BLEU.compute_bleu`` (public), in
microseconds instead of re-tokenising every segment (0.15 s per resample of 1,012 segments). The read checks
itself: the counts of all documents must give lm-eval's own score of the corpus, or the metric is resampled the
slow way (every resample re-aggregated by lm-eval's function). Other aggregations are always resampled the slow
way.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

ORDER = 4  # corpus_bleu's default max n-gram order


def _bleu_counts(items: Sequence[Any]) -> np.ndarray:
    """(documents, 2 + 2 ORDER): sys_len, ref_len, matches and totals of each n-gram order, per document. An item
    is (reference or references, prediction or [prediction]), as lm-eval's bleu metric passes it through."""
    from sacrebleu.metrics import BLEU

    scorer = BLEU(effective_order=True)  # the counts do not depend on it; it silences sacrebleu's advice
    rows = []
    for ref, pred in items:
        refs = [ref] if isinstance(ref, str) else list(ref)
        (pred,) = [pred] if isinstance(pred, str) else list(pred)
        score = scorer.sentence_score(pred, refs)
        rows.append([score.sys_len, score.ref_len, *score.counts, *score.totals])
    return np.asarray(rows, dtype=float)


def _bleu_score(summed: np.ndarray) -> float:
    from sacrebleu.metrics import BLEU

    counts = summed.astype(np.int64).tolist()
    return float(BLEU.compute_bleu(correct=counts[2:2 + ORDER], total=counts[2 + ORDER:], sys_len=counts[0],
                                   ref_len=counts[1], smooth_method="exp").score)


def additive(aggregate: Callable[[list], float], values: Sequence[Any]
             ) -> tuple[np.ndarray, Callable[[np.ndarray], float]] | None:
    """(per-document counts, score of summed counts) for lm-eval's bleu aggregation when they reproduce its score
    of values, else None."""
    from lm_eval.api.registry import get_aggregation

    if aggregate is not get_aggregation("bleu") or not values:
        return None
    try:
        counts = _bleu_counts(values)
    except (TypeError, ValueError, IndexError, AssertionError):
        return None
    return (counts, _bleu_score) if math.isclose(_bleu_score(counts.sum(axis=0)), aggregate(list(values)),
                                                 rel_tol=1e-9, abs_tol=1e-9) else None


def resampled(aggregate: Callable[[list], float], values: Sequence[Any], rows: np.ndarray,
              fast: tuple[np.ndarray, Callable[[np.ndarray], float]] | None) -> np.ndarray:
    """aggregate over each resample (a row of document indices), through the summed counts where fast."""
    if fast is None:
        return np.array([aggregate([values[i] for i in row]) for row in rows], dtype=float)
    counts, score = fast
    return np.array([score(total) for total in counts[rows].sum(axis=1)], dtype=float)
