"""One-sided tests of a paired difference against a bound: the p-values the verdicts are made of. Pure functions.

Equivalence testing (Schuirmann 1987, "two one-sided tests", TOST) reads a difference against a tolerance with
one-sided tests: "worse" is H1: diff < -tolerance, "equivalent" is H1: diff > -tolerance and H1: diff < +tolerance
(its p-value the larger of the two), "lower" is H1: diff < 0. This module gives p(diff < bound) and p(diff > bound):

* paired 0/1 scores (b documents right in the reference only, c in the candidate only, of n): Tango's score
  statistic at the bound (evalkit/compare/stats.py) ordered exactly: the p-value is the largest probability,
  over the nuisance parameter on the boundary (pc - pb = bound), of a table at least as extreme, summed over
  every table of n documents (an exact unconditional test, as Chan 1998, Stat Med 17:1403, and Sidik 2003,
  Biometrical Journal 45:729, construct it for paired non-inferiority). Its size never exceeds the level,
  which the asymptotic score test's does with few documents (0.071 at 40 documents and a bound of 0.05). Above
  EXACT_DOCUMENTS documents the asymptotic normal p-value of the same score is used;
* anything bootstrapped: the percentile bootstrap's p-value, (1 + resamples on the null side) / (1 + resamples).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import gammaln, xlogy
from scipy.stats import norm

EXACT_DOCUMENTS = 500  # up to this many documents the 0/1 p-values are exact (every table enumerated)
GRID = 64  # nuisance values tried before the largest is refined
SIDES = ("below", "above")


def tango_scores(delta: float, b: np.ndarray, c: np.ndarray, n: int) -> np.ndarray:
    """stats.tango_score over arrays of tables (b, c) of n documents."""
    b, c = np.asarray(b, dtype=float), np.asarray(c, dtype=float)
    qb = -b - c + (2 * n - c + b) * delta
    qc = -b * delta * (1 - delta)
    p21 = (np.sqrt(np.maximum(qb * qb - 8 * n * qc, 0.0)) - qb) / (4 * n)
    variance = n * (2 * p21 + delta * (1 - delta))
    return (c - b - n * delta) / np.sqrt(np.maximum(variance, 1e-300))


@lru_cache(maxsize=64)
def _tables(n: int, delta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every table (b, c) of n documents, its multinomial log-coefficient and its score at delta."""
    b, c = np.triu_indices(n + 1)
    b, c = b.ravel(), (c - b).ravel()  # all b + c <= n
    coefficient = gammaln(n + 1) - gammaln(b + 1) - gammaln(c + 1) - gammaln(n - b - c + 1)
    return b, c, coefficient, tango_scores(delta, b, c, n)


def _probability(cells: tuple[np.ndarray, np.ndarray, np.ndarray], n: int, delta: float, pc: float) -> float:
    """P(the tables in cells) when the candidate is right alone with probability pc, the reference with pc - delta."""
    b, c, coefficient = cells
    pb = pc - delta
    rest = max(1.0 - pb - pc, 0.0)
    return float(np.exp(coefficient + xlogy(b, pb) + xlogy(c, pc) + xlogy(n - b - c, rest)).sum())


@lru_cache(maxsize=1 << 16)
def tango_p(b: int, c: int, n: int, bound: float, side: str) -> float:
    """p-value for H1: p_cand - p_ref < bound (side "below") or > bound ("above"), from b, c of n documents."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    if not -1.0 < bound < 1.0:
        return 1.0 if (side == "below") == (bound <= -1.0) else 0.0
    observed = float(tango_scores(bound, np.array([b]), np.array([c]), n)[0])
    if n > EXACT_DOCUMENTS:
        return float(norm.cdf(observed) if side == "below" else norm.sf(observed))
    tb, tc, coefficient, score = _tables(n, bound)
    slack = 1e-9 * (1.0 + abs(observed))  # equal scores computed in another order count as equal
    extreme = score <= observed + slack if side == "below" else score >= observed - slack
    cells = (tb[extreme], tc[extreme], coefficient[extreme])
    low, high = max(0.0, bound), (1.0 + bound) / 2  # pc on the boundary: pb = pc - bound >= 0, pb + pc <= 1
    grid = np.linspace(low, high, GRID)
    values = [_probability(cells, n, bound, pc) for pc in grid]
    best = int(np.argmax(values))
    step = (high - low) / (GRID - 1)
    refined = minimize_scalar(lambda pc: -_probability(cells, n, bound, pc), method="bounded",
                              bounds=(max(low, grid[best] - step), min(high, grid[best] + step)))
    return float(min(1.0, max(values[best], -refined.fun)))


def bootstrap_p(statistics: np.ndarray, bound: float, side: str) -> float:
    """Percentile-bootstrap p-value for H1: statistic < bound ("below") or > bound ("above")."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    null = statistics >= bound if side == "below" else statistics <= bound
    return float((1 + np.count_nonzero(null)) / (1 + len(statistics)))
