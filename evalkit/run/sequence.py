"""An anytime-valid confidence sequence for the mean of bounded paired differences over the N documents of a task,
drawn in a random order without replacement. Pure functions over numpy arrays, no I/O.

The sequence is Waudby-Smith & Ramdas (2023), "Estimating means of bounded random variables by betting", JRSS B
86:1-27, section 6 (sampling without replacement). A document's difference d in [-1, 1] (a 0/1 metric's
candidate minus reference: -1, 0 or +1) is read as y = (d + 1) / 2 in [0, 1]. For a candidate mean m of the N
documents' y, the mean of the documents not yet drawn before draw i is mu_i(m) = (N m - S_{i-1}) / (N - i + 1),
S the sum drawn so far; under a uniformly random order y_i has that conditional mean, so a bettor's wealth

    K+_t(m) = prod_{i <= t} (1 + lam_i (y_i - mu_i(m))),   K-_t(m) = prod_{i <= t} (1 - lam_i (y_i - mu_i(m)))

is a nonnegative martingale for any bet lam_i in [0, c / mu_i] (resp. [0, c / (1 - mu_i)]) fixed before y_i is
seen, and by Ville's inequality P(sup_t K_t(m) >= 1 / a) <= a at the true m. So m is ruled out once the wealth
betting against it reaches 1 / a, at any look, however the looks are chosen; and m is ruled out outright once
mu_i(m) leaves [0, 1] (the documents left could not make it up), which makes the sequence close on the exact
mean of the N documents at t = N.

The bet's size (lam~, before its cap) never depends on the m tested, only on the documents drawn and on a target:
the aGRAPA bet of the paper's section 5.3, (mean - mu_i(m*)) / (variance + (mean - mu_i(m*))^2), aimed at the
bound m* the decision is about (the tolerance). Each factor then falls with m for K+ and rises with m for K-, the
cap c / mu_i included, so the set of m not ruled out is an interval and one capital at the bound decides: the
upper end lies below -tolerance exactly when K-(-tolerance) reached 1 / a. K- bets on two targets where an
equivalence is asked (-tolerance and +tolerance) as the mean of two bettors' wealth, still a martingale.

Each side is a one-sided test at its own level a (as two one-sided tests are): at any true mean only one side
can err (a false `worse` and a false `equivalent` above the margin both need K- to rule out the true mean), so a
row's chance of a wrong claim, at any look, is at most a; the interval shown is the 1 - 2a sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BET_CAP = 0.75  # the largest bet as a share of what the bettor could lose at mu_i (the paper's c)
AIMED = 0.9  # the share of the stake on the bets aimed at the tolerance; the rest on the paper's plug-in bet
BISECTIONS = 48  # halvings of [-1, 1] when the interval's ends are read


@dataclass(frozen=True)
class Look:
    """One row at one look: n of total documents drawn, their mean difference, the sequence's interval for the
    mean difference of all total documents, and what it shows against the tolerance."""

    n: int
    total: int
    mean: float
    low: float
    high: float
    verdict: str  # "worse", "equivalent", "better" or "undecided"


def _log_wealth(y: np.ndarray, total: int, m: np.ndarray | float, targets: tuple[float, ...],
                alpha: float) -> np.ndarray:
    """log K+_t(m) at every t (last axis), the largest so far (Ville's inequality bounds the supremum), for y in
    [0, 1] in the order drawn (any leading axes: runs) and m on y's scale; +inf from the draw on which the sum
    drawn exceeds N m (no documents left could bring the mean down to m). The bettors aimed at each target m* share
    AIMED of the stake, the plug-in bettor the rest. K- is this on 1 - y and 1 - m."""
    n = y.shape[-1]
    i = np.arange(1, n + 1)
    drawn = np.cumsum(y, axis=-1)
    before = drawn - y  # S_{i-1}
    left = total - i + 1
    m = np.asarray(m, dtype=float)[..., None] if np.ndim(m) else float(m)
    mu = np.clip((total * m - before) / left, 0.0, 1.0)
    mean = (0.5 + before) / i  # the paper's prior: one pseudo-document at 1/2
    centred = y - drawn / i
    spread = (0.25 + np.cumsum(centred ** 2, axis=-1) - centred ** 2) / i
    with np.errstate(divide="ignore", invalid="ignore"):
        cap = np.where(mu > 0, BET_CAP / np.maximum(mu, 1e-300), np.inf)
        bets = [np.maximum(gap, 0.0) / (spread + gap ** 2)
                for gap in (mean - (total * target - before) / left for target in targets)]
        bets.append(np.sqrt(2.0 * math.log(1.0 / alpha) / (spread * i * np.log1p(i))))
        weights = [AIMED / len(targets)] * len(targets) + [1.0 - AIMED]
        wealth = [math.log(w) + np.cumsum(np.log1p(np.minimum(bet, cap) * (y - mu)), axis=-1)
                  for w, bet in zip(weights, bets)]
    log_k = np.logaddexp.reduce(np.stack(wealth), axis=0)
    ruled_out = total * m - drawn < -1e-9 * total
    return np.where(np.maximum.accumulate(ruled_out, axis=-1), np.inf, np.maximum.accumulate(log_k, axis=-1))


def _scaled(d: np.ndarray) -> np.ndarray:
    d = np.asarray(d, dtype=float)
    if d.size and (d.min() < -1 or d.max() > 1):
        raise ValueError("the betting sequence needs differences in [-1, 1]")
    return (d + 1.0) / 2.0


def rules_out_above(d: np.ndarray, total: int, bound: float, alpha: float, targets: tuple[float, ...]) -> np.ndarray:
    """Whether every mean difference >= bound is ruled out at level alpha, at every draw (last axis)."""
    y = _scaled(d)
    return _log_wealth(1.0 - y, total, 1.0 - (bound + 1.0) / 2.0, tuple(1.0 - (t + 1) / 2 for t in targets), alpha) \
        >= math.log(1.0 / alpha)


def rules_out_below(d: np.ndarray, total: int, bound: float, alpha: float, targets: tuple[float, ...]) -> np.ndarray:
    """Whether every mean difference <= bound is ruled out at level alpha, at every draw (last axis)."""
    return _log_wealth(_scaled(d), total, (bound + 1.0) / 2.0, tuple((t + 1) / 2 for t in targets), alpha) \
        >= math.log(1.0 / alpha)


def targets_for(tolerance: float, equivalence: bool) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The bets' targets (below, above): the lower end is aimed at -tolerance; the upper end at -tolerance (a
    `worse` claim) and, where an equivalence is asked, at +tolerance too."""
    return (-tolerance,), ((-tolerance, tolerance) if equivalence else (-tolerance,))


def look(d: np.ndarray, total: int, *, tolerance: float, alpha: float, equivalence: bool) -> Look:
    """The row after the documents drawn so far (d, in the order drawn): the 1 - 2 alpha sequence interval of the
    mean difference over all total documents, and its verdict against +-tolerance."""
    d = np.asarray(d, dtype=float)
    n = len(d)
    if not 0 < n <= total:
        raise ValueError(f"{n} documents drawn of {total}")
    below, above = targets_for(tolerance, equivalence)

    def end(side) -> float:
        # the last m (from the inside) that side does not rule out; the wealth is monotone in m
        lo, hi = (-1.0, 1.0)
        for _ in range(BISECTIONS):
            mid = 0.5 * (lo + hi)
            out = side(mid)
            lo, hi = (mid, hi) if out == (side is down) else (lo, mid)
        return lo if side is down else hi

    def down(m: float) -> bool:
        return bool(rules_out_below(d, total, m, alpha, below)[-1])

    def up(m: float) -> bool:
        return bool(rules_out_above(d, total, m, alpha, above)[-1])

    low, high = end(down), end(up)
    worse = bool(rules_out_above(d, total, -tolerance, alpha, above)[-1])
    inside = bool(rules_out_below(d, total, -tolerance, alpha, below)[-1]) and \
        bool(rules_out_above(d, total, tolerance, alpha, above)[-1])
    better = bool(rules_out_below(d, total, tolerance, alpha, below)[-1])
    verdict = "worse" if worse else "equivalent" if inside else "better" if better else "undecided"
    return Look(n=n, total=total, mean=float(d.mean()), low=low, high=high, verdict=verdict)
