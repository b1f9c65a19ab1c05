"""One-sided tests of a paired mean difference that hold at every number of documents, from 2 up, and the
intervals they invert. Pure functions, no I/O.

* Values not known to be bounded: the sign-flip randomization test (Fisher 1935, "The Design of Experiments"
  section 21; Pitman 1937) of H0: mean difference = t, on x_i = d_i - t, with one pseudo-document added against
  the claim. Alone, the test is exact where the x_i are symmetric about 0 (a candidate that is one more run of the
  reference's process, at t = 0), but only there: skewed differences make it liberal (differences shaped as
  Exp(1) - 1 at the bound were called worse 12-16 % of the time at 5-30 documents, at alpha 0.05), since the few
  large values on the far side that hold their mean at t are mostly missing from a small sample. No test of a mean
  over unbounded values can hold its level for every distribution (Bahadur & Savage 1956, Ann Math Stat
  27:1115-1122: a rare value large enough can move the mean anywhere), so the test says what it accounts for:
  the pseudo-document stands for an unseen document as far from the rest as the sample's whole range,
  a = max(x) - min(x), on the side that holds the mean back (+a for H1: mean < t, -a for H1: mean > t), and is
  flipped with the others. Its p-value is never below the plain test's (the half of the patterns that keeps the
  pseudo-document's sign is the plain test, the other half counts at least as often), so it stays exact-or-
  conservative under symmetry, and it holds the level on Exp-shaped differences at every size from 2 to 1,000
  (benchmarks/small_samples.py; tests/test_compare_values.py). It cannot see what a small sample has not drawn:
  5 % of documents dropping by 5 were `equivalent` 0.64 of the time at 10 documents (none drawn), and 98 %
  at -0.153 beside 2 % at +5 `worse` 0.17 of the time at 100. So a mean row of values outside [0, 1] is read
  from MIN_UNBOUNDED documents on, where the zero-inflated, skewed and heavy-tailed shapes of
  benchmarks/small_samples.py --shapes hold the level, and is untested below (too_few_unbounded says why).
  Every sign pattern is enumerated up to EXACT_MAX documents (so 3 documents cannot give a p-value below 1/8),
  random ones above, whose p-value (1 + as extreme) / (1 + draws) is valid (Phipson & Smyth 2010, Stat Appl
  Genet Mol Biol 9:39). Each pattern's statistic is linear in t, so one set of draws answers every bound, and
  the interval is read off exactly: the bounds where each pattern starts to count (tests/test_compare_values.py
  checks the p-values against scipy.stats.permutation_test). With units u_i > 0 (sign_flip's units: a
  perplexity's words) the test is of sum(d) / sum(u), on x_i = d_i - t u_i, and a = max(u) times the range of
  d / u.
* Values in [0, 1] (per-document F1, ROUGE, ...), whose differences lie in [-1, 1], or in a range [lo, hi] the
  user declares (--range-for; stats.bounded_tests): testing by betting
  (Waudby-Smith & Ramdas 2023, "Estimating means of bounded random variables by betting", JRSS B 86:1-27, the
  predictable plug-in bets of section 5.1): p = 1 / the largest wealth of a bettor who wins when the mean lies
  beyond the bound, valid at every n by Ville's inequality, with no assumption on the shape. It accounts for
  what the documents not drawn could do: no flip on 10 documents is no evidence of equivalence within 0.02,
  however small the differences seen (about 150 unchanged documents are, as for a 0/1 metric).
"""

from __future__ import annotations

import collections
import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

EXACT_MAX = 16  # documents up to which every sign pattern is enumerated (2^16 patterns)
MAX_CELLS = 1 << 21  # signs held at once by sign_patterns
DRAWN_CELLS = 1 << 23  # bytes of drawn patterns (8 documents' signs each) held in one block
TILE_CELLS = 1 << 15  # gathers a block's patterns make at once, from a tile of at least TILE_GROUPS groups' tables
TILE_GROUPS = 64  # 64 groups' tables: 256 KiB, held in the processor's cache while every pattern of a block reads them
THREADS = min(8, os.cpu_count() or 1)  # threads that sum the drawn patterns of many documents
BET_CAP = 0.75  # the largest bet as a share of what the bettor could lose at the bound (the paper's c)


@dataclass(frozen=True)
class SignFlip:
    """The sign-flip test's thresholds, with the pseudo-document (the module's docstring) counted at both of its
    signs: pattern j counts for p(diff > t) from t >= above[j] on, and for p(diff < t) up to t <= below[j];
    always counts where the real documents keep their signs."""

    above: np.ndarray  # sorted
    below: np.ndarray  # sorted
    always: int
    total: int  # 2^(n + 1) patterns, or 2 (draws + 1)

    @property
    def floor(self) -> float:
        return self.always / self.total

    def p(self, bound: float, side: str) -> float:
        """p-value for H1: mean difference < bound ("below") or > bound ("above")."""
        slack = 1e-12 * (1.0 + abs(bound))
        if side == "above":
            counted = np.searchsorted(self.above, bound + slack, side="right")
        else:
            counted = len(self.below) - np.searchsorted(self.below, bound - slack, side="left")
        return float(min(1.0, (self.always + counted) / self.total))

    def limits(self, alpha: float) -> tuple[float, float]:
        """(low, high): p(diff > t) < alpha exactly for t < low, p(diff < t) < alpha exactly for t > high."""
        k = math.ceil(alpha * self.total - self.always)
        if k <= 0:
            return -math.inf, math.inf
        if k > len(self.above):
            return math.inf, -math.inf
        return float(self.above[k - 1]), float(self.below[len(self.below) - k])


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


BYTE_BITS = ((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(float)  # row b: the 8 bits of byte b


def flipped_sums(columns: list[np.ndarray], draws: int, seed: int) -> tuple[list[np.ndarray], int]:
    """sum_i s_i x_i for each column x, over the sign patterns s of sign_patterns except the all-plus one(s), and
    how many all-plus patterns there were. Above EXACT_MAX documents the draws are random bytes, a bit per
    document (1: its sign flipped), summed through tables of each group of 8 documents' 256 partial sums (two
    columns' at once, _paired_tables): a gather a group, where drawing and multiplying a sign a document cost four
    times as much at 100,000 documents. A block of patterns is summed a tile of groups at a time, so that the
    tile's tables stay in the processor's cache while every pattern of the block reads them: a quarter less time
    at 100,000 documents than summing the patterns one at a time, each reading every group's table from memory."""
    n = len(columns[0])
    if n <= EXACT_MAX:
        sums: list[list[np.ndarray]] = [[] for _ in columns]
        always = 0
        for signs in sign_patterns(n, draws, seed):
            same = np.all(signs == 1, axis=1)
            always += int(same.sum())
            for found, x in zip(sums, columns):
                found.append(signs[~same] @ x)
        return [np.concatenate(found) for found in sums], always
    groups = -(-n // 8)
    tables = []
    for x in columns:
        padded = np.zeros(8 * groups)
        padded[:n] = x
        tables.append((padded.reshape(groups, 8) @ BYTE_BITS.T).ravel())  # [group, byte] -> sum of its flipped x
    gathered = _paired_tables(tables)
    totals = [float(x.sum()) for x in columns]
    offsets = np.arange(groups, dtype=np.intp) * 256
    last = (1 << (n - 8 * (groups - 1))) - 1  # the last group's bits that are documents

    rows = max(1, DRAWN_CELLS // groups)
    tile = max(TILE_GROUPS, TILE_CELLS // rows)  # of the block's size, not its thread's: the same sums anywhere

    def summed(drawn: np.ndarray) -> tuple[list[np.ndarray], int]:
        drawn[:, -1] &= last
        same = ~drawn.any(axis=1)
        kept = drawn[~same]
        flipped = [np.zeros(len(kept)) for _ in totals]
        for start in range(0, groups, tile):
            for found, part in zip(flipped, _gathered_sums(gathered, kept[:, start:start + tile]
                                                           + offsets[start:start + tile])):
                found += part
        return [total - 2.0 * found for found, total in zip(flipped, totals)], int(same.sum())

    # drawn in order on this thread, summed on THREADS (numpy lets go of the GIL), taken in the order drawn: the
    # same sums on any machine; at most 2 * THREADS blocks are held at once
    rng = np.random.default_rng(seed)
    pending: collections.deque = collections.deque()
    blocks = []
    with ThreadPoolExecutor(THREADS) as pool:
        for start in range(0, draws, rows):
            drawn = rng.integers(0, 256, size=(min(rows, draws - start), groups), dtype=np.uint8)
            pending.append(pool.submit(summed, drawn))
            if len(pending) > 2 * THREADS:
                blocks.append(pending.popleft().result())
        blocks += [block.result() for block in pending]
    return ([np.concatenate([parts[i] for parts, _ in blocks]) for i in range(len(columns))],
            sum(plus for _, plus in blocks))


def _gathered_sums(tables: list[np.ndarray], where: np.ndarray) -> list[np.ndarray]:
    """Each row's sum of each table's values at where, a complex table's parts summed apart (in column order)."""
    return [part.sum(axis=1) for table in tables for found in [table[where]]
            for part in ((found.real, found.imag) if table.dtype == complex else (found,))]


def _paired_tables(tables: list[np.ndarray]) -> list[np.ndarray]:
    """The tables two at a time as one complex table (the first's values its real parts, the second's its
    imaginary ones, each exact), so that one gather reads both: a gather costs the same for 8 bytes as for 16, and
    each part summed alone is summed as its own table's would be (the same bits). An odd last table alone."""
    paired = []
    for first, second in itertools.zip_longest(tables[::2], tables[1::2]):
        if second is None:
            paired.append(first)
        else:
            both = np.empty(len(first), dtype=complex)
            both.real, both.imag = first, second
            paired.append(both)
    return paired


def sign_flip(differences: np.ndarray, *, draws: int, seed: int = 0, units: np.ndarray | None = None) -> SignFlip:
    """The test of sum(d) / sum(u) (units u > 0, 1 each by default: the mean of d) against a bound t, on
    x_i = d_i - t u_i and the pseudo-document a = max(u) * the range of d / u (the module's docstring). Pattern s
    of the real documents: sum_i s_i x_i >= sum_i x_i exactly when t >= tau = (sum d - s.d) / (sum u - s.u); with
    the pseudo-document flipped as well, the bounds move by 2 a / (sum u - s.u), towards the claim's side."""
    d = np.asarray(differences, dtype=float)
    u = np.ones_like(d) if units is None else np.asarray(units, dtype=float)
    n, total_d, total_u = len(d), float(d.sum()), float(u.sum())
    if n == 0:
        raise ValueError("no paired documents to compare")
    if u.shape != d.shape or not (u > 0).all():
        raise ValueError("the sign-flip test needs a positive unit for every document")
    pseudo = float(u.max() * np.ptp(d / u))
    (flipped, weight), always = flipped_sums([d, u], draws, seed)
    spread = total_u - weight
    tau, shift = (total_d - flipped) / spread, 2.0 * pseudo / spread
    exact = n <= EXACT_MAX
    return SignFlip(above=np.sort(np.concatenate([tau, tau - shift])),
                    below=np.sort(np.concatenate([tau, tau + shift])),
                    always=2 * (always if exact else always + 1), total=2 * (2 ** n if exact else draws + 1))


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


MIN_UNBOUNDED = 200  # fewest documents a mean of values outside [0, 1] is tested on: measured, small_samples.py


def too_few_unbounded(documents: int, what: str = "of values outside [0, 1]") -> str:
    """The note of a row the sign-flip test reads a mean of (what: of which values) on fewer than MIN_UNBOUNDED
    documents ("" from there on)."""
    if documents >= MIN_UNBOUNDED:
        return ""
    return (f"{documents} documents {what}: no test of a mean of unbounded values holds its level "
            "for every shape of change (a few rare, large changes can move it anywhere), and the sign-flip test "
            f"holds it on the skewed, zero-inflated and heavy-tailed shapes measured from {MIN_UNBOUNDED} documents "
            "on, so this row is not tested below that (inconclusive, whatever it shows)")


@dataclass(frozen=True)
class RatioFlip:
    """The sign-flip test of sum(d) / sum(u) = t for units u of any sign (a relative row: d = c - r, u = r times
    the sign of the reference's sum, so that the ratio is (C - R) / |R|), on x_i(t) = d_i - t u_i with the
    pseudo-document a(t) = the range of x(t) against the claim, as sign_flip. The reference's values stay in the
    test as per-document values rather than a known constant |R|, so their noise is counted. Each pattern's
    flipped sums of d and u are kept: a p-value at any t is then one pass over them."""

    d: np.ndarray
    u: np.ndarray
    flipped_d: np.ndarray  # s.d for every pattern but the observed one (all + signs)
    flipped_u: np.ndarray
    always: int  # patterns equal to the observed one
    total: int  # patterns

    @property
    def floor(self) -> float:
        return self.always / self.total

    def p(self, bound: float, side: str) -> float:
        """p-value for H1: sum(d) / sum(u) < bound ("below") or > bound ("above")."""
        x = self.d - bound * self.u
        observed, a = float(x.sum()), float(np.ptp(x))
        stat = self.flipped_d - bound * self.flipped_u
        slack = 1e-12 * (1.0 + np.abs(stat) + abs(observed))
        if side == "below":  # the pseudo-document +a holds the mean back; counted at both of its signs
            edge = observed + a + slack
            counted = np.count_nonzero(stat + a <= edge) + np.count_nonzero(stat - a <= edge)
        else:
            edge = observed - a - slack
            counted = np.count_nonzero(stat - a >= edge) + np.count_nonzero(stat + a >= edge)
        return float(min(1.0, (2 * self.always + counted) / (2 * self.total)))


def ratio_flip(d: np.ndarray, u: np.ndarray, *, draws: int, seed: int = 0) -> RatioFlip:
    """RatioFlip over every sign pattern up to EXACT_MAX documents, draws random ones above."""
    d, u = np.asarray(d, dtype=float), np.asarray(u, dtype=float)
    if len(d) == 0 or u.shape != d.shape:
        raise ValueError("no paired documents to compare")
    (flipped_d, flipped_u), always = flipped_sums([d, u], draws, seed)
    exact = len(d) <= EXACT_MAX
    return RatioFlip(d=d, u=u, flipped_d=flipped_d, flipped_u=flipped_u,
                     always=always if exact else always + 1, total=2 ** len(d) if exact else draws + 1)


def inverted(p, alpha: float, points, *, lower: bool, ends: tuple[float, float]) -> float:
    """Where a one-sided test p(t) (lower: of H1 diff > t, rejected below the limit; else of H1 diff < t,
    rejected above it) stops rejecting at alpha, bracketed between the decision points (the bounds the verdicts
    test) and the ends, so that the limit lies on the same side of each point as the test's verdict there; -inf
    or inf where the test rejects at no point up to the far end."""
    from scipy.optimize import brentq

    grid = sorted({*ends, *(float(t) for t in points if ends[0] < t < ends[1])})
    shown = [p(t) < alpha for t in grid]
    if lower:
        if all(shown):
            return grid[-1]
        i = shown.index(False)
        if i == 0:
            return -math.inf
    else:
        if not any(shown):
            return math.inf
        i = shown.index(True)
        if i == 0:
            return grid[0]
    a, b = grid[i - 1], grid[i]
    root = brentq(lambda t: p(t) - alpha, a, b, xtol=1e-7, rtol=1e-4)
    return max(root, float(np.nextafter(a, b))) if lower else min(root, float(np.nextafter(b, a)))
