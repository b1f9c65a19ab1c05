"""Paired 0/1 scores (right or wrong on each document): Tango's score interval, McNemar's exact test, and how many
documents a tolerance needs. Pure functions, no I/O.

* Tango's asymptotic score interval for the difference of paired proportions (Tango 1998, Statistics in Medicine
  17:891-908, with the correction in Stat Med 18:3511, 1999), one of the intervals Fagerland, Lydersen & Laake
  (2014, "Recommended tests and confidence intervals for paired binomial proportions", Stat Med 33:2850-2875)
  recommend. Unlike a bootstrap it keeps its width when no document flips: with none of n documents changing it
  still spans +-z^2/(n+z^2) (+-0.088 at n=40). Newcombe's hybrid score interval (1998, method 10) would collapse
  to zero width there. The comparison shows the interval its exact tests invert instead (tost.tango_limits), so
  the interval and the verdict agree; tost.py orders tables by the score statistic here (tango_score).
* McNemar's exact test (McNemar 1947): for 0/1 metrics only the discordant documents (b: right in the reference
  only, c: right in the candidate only) carry information; under no change b ~ Binomial(b+c, 1/2).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import bdtr

from evalkit.compare.statistics import tost
from evalkit.compare.statistics.interval import Interval, z_value


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

    from scipy.optimize import brentq  # imported here: a compare that inverts no Tango test spares its 0.07 s

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
    # searched from the asymptotic score test's answer, z^2 (1 - tol) / tol (the exact test needs a little more):
    # a few exact tests where a search from 1 takes twice as many
    guess = max(1, math.ceil(z_value(1.0 - 2.0 * alpha) ** 2 * (1.0 - tolerance) / tolerance))
    low, high = guess, guess + max(1, guess // 4)
    while not shown(high):
        low, high = high, high * 2
    while low > 1 and shown(low):
        low, high = max(1, low // 2), low
    while high - low > 1:  # shown(high) holds, shown(low) does not (or low = 1)
        middle = (low + high) // 2
        low, high = (low, middle) if shown(middle) else (middle, high)
    return high if not shown(low) else low


def mcnemar_exact(reference: np.ndarray, candidate: np.ndarray) -> tuple[int, int, float]:
    """(b, c, two-sided exact p): b documents right only in the reference, c right only in the candidate."""
    ref = np.asarray(reference).astype(bool)
    cand = np.asarray(candidate).astype(bool)
    b = int(np.sum(ref & ~cand))
    c = int(np.sum(~ref & cand))
    if b + c == 0:
        return b, c, 1.0
    # the exact two-sided binomial test at 1/2 (scipy.stats.binomtest's): both tails as far from n/2 as min(b, c)
    return b, c, 1.0 if b == c else min(1.0, 2.0 * float(bdtr(min(b, c), b + c, 0.5)))
