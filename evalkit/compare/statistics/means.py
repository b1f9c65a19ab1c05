"""One-sided tests of a paired mean difference that hold at every number of documents, from 2 up, and the
intervals they invert. Pure functions, no I/O.

* Values not known to be bounded: the sign-flip randomization test (Fisher 1935, "The Design of Experiments"
  section 21; Pitman 1937), of H0: mean difference = t on the differences d_i - t. Under a candidate that is one
  more run of the reference's process the differences are symmetric about 0 and the test is exact at every n;
  at a bound t other than 0 it assumes the differences symmetric about their mean. Every sign pattern is
  enumerated up to EXACT_MAX documents (so 3 documents cannot give a p-value below 1/8), random ones above, whose
  p-value (1 + as extreme) / (1 + draws) is valid (Phipson & Smyth 2010, Stat Appl Genet Mol Biol 9:39). Each
  pattern's statistic is linear in t, so one set of draws answers every bound, and the interval is read off
  exactly: the bounds where each pattern starts to count (tests/test_compare_values.py checks the p-values
  against scipy.stats.permutation_test).
* Values in [0, 1] (per-document F1, ROUGE, ...), whose differences lie in [-1, 1]: testing by betting
  (Waudby-Smith & Ramdas 2023, "Estimating means of bounded random variables by betting", JRSS B 86:1-27, the
  predictable plug-in bets of section 5.1): p = 1 / the largest wealth of a bettor who wins when the mean lies
  beyond the bound, valid at every n by Ville's inequality, with no assumption on the shape. It accounts for
  what the documents not drawn could do: no flip on 10 documents is no evidence of equivalence within 0.02,
  however small the differences seen (about 150 unchanged documents are, as for a 0/1 metric).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EXACT_MAX = 16  # documents up to which every sign pattern is enumerated (2^16 patterns)
MAX_CELLS = 1 << 21  # signs held at once when drawing patterns
BET_CAP = 0.75  # the largest bet as a share of what the bettor could lose at the bound (the paper's c)


@dataclass(frozen=True)
class SignFlip:
    """The sign-flip test's thresholds: pattern j counts for p(diff > t) from t >= tau[j] on, and for
    p(diff < t) up to t <= tau[j]; always counts where the pattern is the observed one (or the observation)."""

    tau: np.ndarray  # sorted
    always: int
    total: int  # 2^n patterns, or draws + 1

    @property
    def floor(self) -> float:
        return self.always / self.total

    def p(self, bound: float, side: str) -> float:
        """p-value for H1: mean difference < bound ("below") or > bound ("above")."""
        slack = 1e-12 * (1.0 + abs(bound))
        if side == "above":
            counted = np.searchsorted(self.tau, bound + slack, side="right")
        else:
            counted = len(self.tau) - np.searchsorted(self.tau, bound - slack, side="left")
        return float(min(1.0, (self.always + counted) / self.total))

    def limits(self, alpha: float) -> tuple[float, float]:
        """(low, high): p(diff > t) < alpha exactly for t < low, p(diff < t) < alpha exactly for t > high."""
        k = math.ceil(alpha * self.total - self.always)
        if k <= 0:
            return -math.inf, math.inf
        if k > len(self.tau):
            return math.inf, -math.inf
        return float(self.tau[k - 1]), float(self.tau[len(self.tau) - k])


def sign_patterns(n: int, draws: int, seed: int):
    """Sign patterns (rows of +-1), in chunks: all 2^n (the observed one among them) for n <= EXACT_MAX, else
    draws random ones."""
    if n <= EXACT_MAX:
        codes = np.arange(2 ** n, dtype=np.int64)
        yield 1 - 2 * ((codes[:, None] >> np.arange(n)) & 1).astype(np.int8)
        return
    rng, rows = np.random.default_rng(seed), max(1, MAX_CELLS // n)
    for start in range(0, draws, rows):
        yield 1 - 2 * rng.integers(0, 2, size=(min(rows, draws - start), n), dtype=np.int8)


def sign_flip(differences: np.ndarray, *, draws: int, seed: int = 0) -> SignFlip:
    """The test of the mean of differences, each pattern's threshold: sum_i s_i (d_i - t) >= sum_i (d_i - t)
    exactly when t >= (sum d - sum s d) / (n - sum s)."""
    d = np.asarray(differences, dtype=float)
    n, total_d = len(d), float(d.sum())
    if n == 0:
        raise ValueError("no paired documents to compare")
    taus, always = [], 0
    for signs in sign_patterns(n, draws, seed):
        flipped, kept = signs @ d, signs.sum(axis=1, dtype=np.int64)
        same = kept == n
        always += int(same.sum())
        taus.append((total_d - flipped[~same]) / (n - kept[~same]))
    exact = n <= EXACT_MAX
    return SignFlip(tau=np.sort(np.concatenate(taus)), always=always if exact else always + 1,
                    total=2 ** n if exact else draws + 1)


def betting_p(x: np.ndarray, bound: float, side: str, *, alpha: float, low: float = -1.0,
              high: float = 1.0) -> float:
    """p-value for H1: mean of x (each in [low, high]) < bound ("below") or > bound ("above"), by betting: the
    predictable plug-in bets of Waudby-Smith & Ramdas (2023, eq. 26), capped at BET_CAP of what the bettor could
    lose at the bound; p = 1 / the largest wealth reached (Ville's inequality), 1 where the bound lies outside."""
    x = np.asarray(x, dtype=float)
    if side == "below":
        x, bound, low, high = -x, -bound, -high, -low
    if bound >= high:
        return 1.0
    if bound <= low:
        return 0.0 if (x > bound).any() else 1.0
    n, prior = len(x), (high - low) ** 2 / 4  # the paper's prior variance, 1/4 on [0, 1]
    i = np.arange(1, n + 1)
    means = (0.5 * (low + high) + np.cumsum(x)) / (i + 1)
    spread = (prior + np.cumsum((x - means) ** 2)) / (i + 1)
    previous = np.concatenate([[prior], spread[:-1]])
    bets = np.minimum(np.sqrt(2.0 * math.log(1.0 / alpha) / (n * previous)), BET_CAP / (bound - low))
    wealth = np.cumsum(np.log1p(bets * (x - bound)))
    return float(min(1.0, math.exp(-max(0.0, float(wealth.max())))))
