"""The interval of a paired difference (candidate - reference) that every statistic of compare returns, and its
orientation: for a lower-is-better metric the difference is negated, so a positive difference is better on every row.
Pure functions, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from scipy.stats import norm


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
