"""The interval of a paired difference (candidate - reference) that every statistic of compare returns, and its
orientation: for a lower-is-better metric the difference is negated, so a positive difference is better on every row.
Pure functions, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import ndtri


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


def relative_change(reference, candidate):
    """(candidate - reference) / |reference|: a relative change whose sign is the difference's, whatever the sign of
    the reference's score (lm-eval's ``bleu_diff`` and ``rouge*_diff`` are usually negative, where candidate /
    reference - 1 would call a drop a rise). No change (0 / 0) is 0; a change from exactly 0 is +-inf."""
    ref, cand = np.asarray(reference, dtype=float), np.asarray(candidate, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        change = np.where(cand == ref, 0.0, (cand - ref) / np.abs(ref))
    return float(change) if change.ndim == 0 else change


def z_value(confidence: float) -> float:
    return float(ndtri(0.5 + confidence / 2))  # the standard normal quantile, as scipy.stats.norm.ppf
