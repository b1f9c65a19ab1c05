"""One-sided tests of a paired difference against a bound, and the intervals they invert. Pure functions.

Equivalence testing (Schuirmann 1987, "two one-sided tests", TOST) reads a difference against a tolerance with
one-sided tests: "worse" is H1: diff < -tolerance, "equivalent" is H1: diff > -tolerance and H1: diff < +tolerance
(its p-value the larger of the two), "lower" is H1: diff < 0. This module gives p(diff < bound) and p(diff > bound):

* paired 0/1 scores (b documents right in the reference only, c in the candidate only, of n): Tango's score
  statistic at the bound (evalkit/compare/statistics/proportions.py) ordered exactly, at every n: the p-value is the largest
  probability, over the nuisance parameter on the boundary (pc - pb = bound), of a table at least as extreme
  (an exact unconditional test, as Chan 1998, Stat Med 17:1403, and Sidik 2003, Biometrical Journal 45:729,
  construct it for paired non-inferiority). The asymptotic score test is liberal at every size (0.071 at 40
  documents and a bound of 0.05; 0.061 at 600, 0.056 at 2,000 and 0.052 at 20,000 documents and a bound of
  0.02); the exact one is not: tests/test_tost_size.py computes its size over a dense grid of the nuisance at up
  to 20,000 documents. The score rises with c among the tables of b + c = d discordant documents (checked for
  every table up to 300 documents and on a grid of d up to 20,000), so the tables at least as extreme are, for
  each d, those of c up to (or from) one threshold: P(tail) is a sum over d of a binomial for d times a binomial
  tail for c, O(n) per nuisance value where enumerating every table is O(n^2). The tails for c come from
  scipy's bdtr every BLOCK values of d and from the binomial's recurrences between (conditional_tails), with a
  bound on their rounding that sends a nuisance value back to bdtr at every d where it is not small (bdtr's
  continued fraction at every term is most of a row's cost at 100,000 documents);
* anything bootstrapped: the percentile bootstrap's p-value, (1 + resamples on the null side) / (1 + resamples).

The interval shown beside each p-value is the one these tests invert (tango_limits, bootstrap_limits): the
bounds no one-sided test at alpha rejects, so it lies below -tolerance exactly when p(diff < -tolerance) < alpha,
and inside +-tolerance exactly when both one-sided tests of equivalence are below alpha (before any adjustment
for the number of rows).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Iterable

import numpy as np
from scipy.special import bdtr, bdtrc, betaincinv, gammaln, xlogy

GRID = 48  # nuisance values tried across the boundary, denser at both ends, before the largest few are refined
END_FLIPS = np.geomspace(0.25, 64.0, 17)  # and at these expected counts of the rarer flip (or concordance) at each end
STEP_FLIPS, MAX_STEPS = 16.0, 2048  # and at most this many expected flips apart (at most MAX_STEPS values)
REFINED = 3  # the grid's highest peaks refined, each ZOOMS times between its neighbours on ZOOM_POINTS values
ZOOMS, ZOOM_POINTS = 3, 12
SPREAD = 8.0  # binomial standard deviations of discordant counts summed; the mass outside is added (an upper bound)
SIDES = ("below", "above")
THREADS = min(8, os.cpu_count() or 1)  # threads that share the terms of one sweep over the nuisance
MIN_SHARE = 200_000  # terms each thread takes at least (fewer are not worth a thread)
BLOCK = 64  # columns of a row between exact conditional tails (conditional_tails)
EPSILON = float(np.finfo(float).eps)  # a term's relative rounding: 4 EPSILON per unit of its log's largest part
RELATIVE = 1e-8  # a row's error bound over its sum above which its conditional tails are all computed by bdtr
XTOL = 1e-7  # how closely an interval's limits are located, and to 1e-4 of their size (shown to 4 digits)
CONFINED_FROM = 20_000  # documents from which the nuisance is searched only where the data leave it plausible
GAMMA = 1e-6  # and the chance that this confidence set misses the true rate of change, added to the p-value


def tango_scores(delta: float, b: np.ndarray, c: np.ndarray, n: int) -> np.ndarray:
    """proportions.tango_score over arrays of tables (b, c) of n documents."""
    b, c = np.asarray(b, dtype=float), np.asarray(c, dtype=float)
    qb = -b - c + (2 * n - c + b) * delta
    qc = -b * delta * (1 - delta)
    p21 = (np.sqrt(np.maximum(qb * qb - 8 * n * qc, 0.0)) - qb) / (4 * n)
    variance = n * (2 * p21 + delta * (1 - delta))
    return (c - b - n * delta) / np.sqrt(np.maximum(variance, 1e-300))


@lru_cache(maxsize=16)
def thresholds(n: int, delta: float, score: float, side: str, counts: tuple[int, int] | None = None) -> np.ndarray:
    """For each number d = b + c of discordant documents (0..n), the largest c whose table's score is at most
    score ("below"; -1 when none), or the largest c whose score is below it ("above": the tail is c above it).
    Equal scores computed in another order count as equal. Bisection over c, every d at once; counts: only d = 0
    and those from counts[0] to counts[1] (the others -1, never read: every sum of tail_p lies within them)."""
    d = np.arange(n + 1) if counts is None else np.unique(np.r_[0, np.arange(counts[0], counts[1] + 1)])
    low, high = np.full(len(d), -1), d + 1  # the score at c = low is in the tail, at c = high it is not
    slack = 1e-9 * (1.0 + abs(score))
    while (active := high - low > 1).any():
        middle = np.clip((low + high) // 2, 0, d)
        value = tango_scores(delta, d - middle, middle, n)
        inside = value <= score + slack if side == "below" else value < score - slack
        low, high = np.where(active & inside, middle, low), np.where(active & ~inside, middle, high)
    if counts is not None:
        full = np.full(n + 1, -1)
        full[d] = low
        low = full
    low.flags.writeable = False
    return low


def counts_read(n: int, rates: tuple[float, float]) -> tuple[int, int]:
    """The discordant counts d that tail_at reads for rates s within rates (its windows, as it sizes them)."""
    s = np.clip(np.array([rates[0], rates[1], 0.5]), rates[0], rates[1])  # the widest window lies nearest 1/2
    half = int(np.ceil(SPREAD * np.sqrt(n * s * (1 - s)).max())) + 10
    return max(0, int(np.floor(n * rates[0])) - half - 2), min(n, int(np.ceil(n * rates[1])) + half + 2)


@lru_cache(maxsize=4)
def log_choose(n: int) -> np.ndarray:
    """log C(n, d) for d = 0..n, computed once per n (as gammaln over every d at once)."""
    d = np.arange(n + 1)
    values = gammaln(n + 1) - gammaln(d + 1) - gammaln(n - d + 1)
    values.flags.writeable = False
    return values


@lru_cache(maxsize=4)  # one set of limits serves a whole tail_p: its sweep and its refinements
def _steps(limits: bytes, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each count d = 0..n of discordant documents, from the limits (as bytes: a cache key): log C(d, limits[d])
    (-inf where the limit is below 0 or above d), whether the limit rises by 1 from d to d + 1, and how many
    counts below d the limit moves from by other than 0 or 1 (cumulative)."""
    k = np.frombuffer(limits, dtype=int)[: n + 1]
    d = np.arange(n + 1)
    inside = (k >= 0) & (k <= d)
    log_choose_k = np.where(inside, gammaln(d + 1) - gammaln(np.clip(k, 0, None) + 1)
                            - gammaln(np.clip(d - k, 0, None) + 1), -np.inf)
    step = np.append(np.diff(k), 0)
    irregular = np.concatenate([[0], np.cumsum((step != 0) & (step != 1))])
    return log_choose_k, step == 1, irregular


def conditional_tails(limits: np.ndarray, n: int, d: np.ndarray, q: np.ndarray, side: str
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(tails, bounds) of P(c <= limits[d] | d) ("below") or P(c > limits[d] | d) ("above"), c ~ Bin(d, q), for
    each row's q (0 < q < 1) and consecutive counts d: exact (bdtr) at the first column of each BLOCK columns,
    then along the row by the binomial's own recurrences (d -> d + 1 moves q P(k | d) across the limit, k -> k + 1
    adds P(k + 1 | d + 1)), a few arithmetic operations where bdtr costs a continued fraction. A block where
    the limit moves by other than 0 or 1 is computed by bdtr throughout. bounds: for each row and block, a bound
    on the rounding error of any of its tails: each term summed in the block off by 4 EPSILON times the largest
    part of its log-probability (log C(d, k), d log(1 - q), k log(q / (1 - q)): tens of thousands at 100,000
    documents, which cancel to a few), and by EPSILON at each of the block's additions."""
    rows, width = d.shape
    blocks = -(-width // BLOCK)
    d = np.pad(d, ((0, 0), (0, blocks * BLOCK - width)), mode="edge")  # repeated columns: computed, then left out
    k = limits[d]
    log_choose_k, rises, irregular = _steps(np.ascontiguousarray(limits, dtype=int).tobytes(), n)
    lq, l1q = np.log(q)[:, None], np.log1p(-q)[:, None]
    log_ck = log_choose_k[d]
    pmf = np.exp(log_ck + d * l1q + k * (lq - l1q))  # P(c = k | d); 0 where k < 0 or k > d
    sign = 1.0 if side == "below" else -1.0
    terms = np.empty(d.shape)
    terms[:, 1:] = pmf[:, 1:] * rises[d[:, :-1]] - q[:, None] * pmf[:, :-1]  # P(c <= k), column to column
    terms = terms.reshape(rows, blocks, BLOCK)
    first = d[:, ::BLOCK], k[:, ::BLOCK]
    anchor = (bdtr if side == "below" else bdtrc)(np.clip(first[1], 0, None), first[0], q[:, None])
    terms[:, :, 0] = sign * np.where(first[1] < 0, float(side == "above"),
                                     np.where(first[1] >= first[0], float(side == "below"), anchor))
    largest = log_ck.max(axis=1) + d[:, -1] * (np.abs(lq) + 2 * np.abs(l1q))[:, 0]
    rounding = EPSILON * (4 * np.maximum(largest, 1.0) + 2 * BLOCK)
    bounds = rounding[:, None] * np.abs(terms).sum(axis=2)
    tails = sign * np.cumsum(terms, axis=2)
    jumps = irregular[np.minimum(first[0] + BLOCK - 1, n)] - irregular[first[0]] > 0
    if jumps.any():
        where = np.broadcast_to(jumps[:, :, None], tails.shape)
        dd, kk = d.reshape(tails.shape)[where], k.reshape(tails.shape)[where]
        qq = np.broadcast_to(q[:, None, None], tails.shape)[where]
        tails[where] = (bdtr if side == "below" else bdtrc)(np.clip(kk, 0, None), dd, qq)
        bounds[jumps] = 0.0
    return tails.reshape(rows, -1)[:, :width], bounds


def tail_rows(limits: np.ndarray, n: int, delta: float, s: np.ndarray, q: np.ndarray, start: np.ndarray,
              width: int, side: str, outside: np.ndarray) -> np.ndarray:
    """tail_probability's sum over the discordant counts of each row (s, q, start), outside: the mass outside
    the rows' windows, added. The conditional tails by conditional_tails; a row whose error bound summed over its
    terms is above RELATIVE of its sum (or whose q is 0 or 1) by bdtr at every term."""
    d = start[:, None] + np.arange(width)[None, :]
    with np.errstate(divide="ignore"):
        ls, l1s = np.log(s), np.log1p(-s)
    regular = (s > 0) & (s < 1)
    log_pmf = log_choose(n)[d]
    log_pmf += np.where(regular, n * l1s, 0.0)[:, None] + d * np.where(regular, ls - l1s, 0.0)[:, None]
    if not regular.all():
        log_pmf[~regular] += xlogy(d[~regular], s[~regular, None]) + xlogy(n - d[~regular], 1 - s[~regular, None])
    weight, k = np.exp(log_pmf), limits[d]
    plain = (k < 0) | (k >= d)  # the tail is 0 or 1
    trivial = (k >= 0 if side == "below" else k < 0).astype(float)
    given, error = trivial.copy(), np.zeros(len(s))
    inner = (q > 0) & (q < 1)
    if inner.any():
        tail, bounds = conditional_tails(limits, n, d[inner], q[inner], side)
        given[inner] = np.where(plain[inner], trivial[inner], np.clip(tail, 0.0, 1.0))
        blocks = np.pad(weight[inner], ((0, 0), (0, bounds.shape[1] * BLOCK - width)))
        error[inner] = (blocks.reshape(*bounds.shape, BLOCK).sum(axis=2) * bounds).sum(axis=1)
    total = (weight * given).sum(axis=1) + outside
    exact = ~inner | (error > RELATIVE * total)
    if exact.any():
        needed = ~plain[exact] & (weight[exact] > 0)
        redo = given[exact]
        dq = np.broadcast_to(q[exact][:, None], redo.shape)[needed]
        redo[needed] = (bdtr if side == "below" else bdtrc)(k[exact][needed], d[exact][needed], dq)
        total[exact] = (weight[exact] * redo).sum(axis=1) + outside[exact]
    return total


def tail_probability(limits: np.ndarray, n: int, delta: float, pc: np.ndarray, side: str) -> np.ndarray:
    """P(the tail) for each nuisance value pc on the boundary (documents right in the candidate only; pc - delta in
    the reference only): sum over d of P(b + c = d) P(c <= limits[d] | d) ("below") or P(c > limits[d] | d)."""
    pc = np.atleast_1d(np.asarray(pc, dtype=float))
    s = np.clip(2 * pc - delta, 0.0, 1.0)  # a document is discordant with probability pb + pc
    q = np.clip(np.divide(pc, s, out=np.full_like(s, 0.5), where=s > 0), 0.0, 1.0)
    return tail_at(limits, n, delta, s, q, side)


def tail_at(limits: np.ndarray, n: int, delta: float, s: np.ndarray, q: np.ndarray, side: str) -> np.ndarray:
    """P(the tail) where a document is discordant with probability s, and right in the candidate only with
    probability q given that. Rows are computed in parallel threads (numpy and scipy release the GIL), each row
    alike wherever it runs."""
    half = int(np.ceil(SPREAD * np.sqrt(n * s * (1 - s)).max())) + 10
    width = min(n + 1, 2 * half + 1)
    start = np.clip(np.round(n * s).astype(int) - half, 0, n + 1 - width)
    parts = np.array_split(np.arange(len(s)), min(THREADS, max(1, len(s) * width // MIN_SHARE)))
    end = start + width - 1
    outside = (np.where(start > 0, bdtr(np.maximum(start - 1, 0), n, s), 0.0)
               + np.where(end < n, bdtrc(np.minimum(end, n), n, s), 0.0))
    rows = lambda i: tail_rows(limits, n, delta, s[i], q[i], start[i], width, side, outside[i])  # noqa: E731
    if len(parts) > 1:
        with ThreadPoolExecutor(len(parts)) as pool:
            return np.concatenate(list(pool.map(rows, parts)))
    return rows(parts[0])


def boundary(delta: float) -> tuple[float, float]:
    """The nuisance pc on the boundary pc - pb = delta: pb = pc - delta >= 0 and pb + pc <= 1."""
    return max(0.0, delta), (1.0 + delta) / 2


def nuisance_grid(n: int, delta: float, points: int = GRID, span: tuple[float, float] | None = None) -> np.ndarray:
    """Nuisance values across the boundary (or its part span), dense at both ends of the boundary, and at most
    STEP_FLIPS expected flips apart.

    The tail probability undulates with pc: measured over dense grids up to 20,000 documents, with a period of
    about 60 expected flips (of the rarer kind, or of concordant documents) near the ends and a little more
    across, its largest values within a few hundred flips of an end; near the ends it moves most per flip."""
    first, last = boundary(delta)
    low, high = span or (first, last)
    across = low + (high - low) * (1 - np.cos(np.pi * np.linspace(0.0, 1.0, points))) / 2
    steps = np.linspace(low, high, min(MAX_STEPS, int(np.ceil(n * (high - low) / STEP_FLIPS)) + 1))
    ends = np.concatenate([first + END_FLIPS / n, last - END_FLIPS / n])
    return np.unique(np.concatenate([across, steps, ends[(ends > low) & (ends < high)]]))


def plausible(n: int, discordant: int, given_change: bool) -> tuple[float, float]:
    """The exact (1 - GAMMA) confidence set (low, high) of the rate s = pb + pc of discordant documents from their
    observed count: Clopper-Pearson's, or given_change, that of the binomial given that some document changed
    (whose tails are the binomial's over 1 - P(none), and rise with s as the binomial's do).

    tail_p maximises the tail over the null's nuisance values whose s lies in this set, and adds GAMMA: Berger &
    Boos (1994, JASA 89:1012). The p-value is still valid at every n, since the set misses the true s with
    probability at most GAMMA, and the search covers a few hundred flips where the whole boundary holds tens of
    thousands (R's Exact package offers the same, as its gamma)."""
    half = GAMMA / 2
    if not given_change:
        low = float(betaincinv(discordant, n - discordant + 1, half)) if discordant > 0 else 0.0
        high = float(betaincinv(discordant + 1, n - discordant, 1 - half)) if discordant < n else 1.0
        return low, high
    from scipy.optimize import brentq  # imported here, as _limit's

    changed = lambda s: -np.expm1(n * np.log1p(-s))  # noqa: E731 (P(D >= 1), without cancellation)
    at_least = lambda s: bdtrc(discordant - 1, n, s) / changed(s) - half  # noqa: E731 (P(D >= d | D >= 1))
    at_most = lambda s: 1.0 - bdtrc(discordant, n, s) / changed(s) - half  # noqa: E731 (P(D <= d | D >= 1))
    ends = (1e-300, 1.0 - 1e-16)
    low = brentq(at_least, *ends, xtol=1e-300, rtol=1e-12) if discordant > 1 else 0.0
    high = brentq(at_most, *ends, xtol=1e-300, rtol=1e-12) if discordant < n else 1.0
    return float(low), float(high)


def peaks(values: np.ndarray, count: int) -> np.ndarray:
    """The indices of the count largest local maxima of values (plateaus count once, ends included)."""
    padded = np.concatenate([[-np.inf], values, [-np.inf]])
    local = np.flatnonzero((padded[1:-1] >= padded[:-2]) & (padded[1:-1] > padded[2:]))
    return local[np.argsort(values[local])[-count:]]


@lru_cache(maxsize=16)
def sweep(n: int, delta: float, score: float, side: str, span: tuple[float, float] | None = None,
          counts: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(thresholds, nuisance grid, tail probability on the grid) of an observed score: the costly part of tail_p,
    computed once for the p-value and the one given that some document changed."""
    limits = thresholds(n, delta, score, side, counts)
    grid = nuisance_grid(n, delta, span=span)
    tail = tail_probability(limits, n, delta, grid, side)
    for array in (grid, tail):
        array.flags.writeable = False
    return limits, grid, tail


def tail_p(n: int, delta: float, score: float, side: str, given_change: bool = False,
           discordant: int | None = None) -> float:
    """The exact unconditional p-value of an observed score: the largest tail probability over the nuisance.
    given_change: the tail's probability given that some document changed (b + c > 0), the largest over the
    nuisance of P(tail, b + c > 0) / P(b + c > 0): valid given that event, as verdict.decide's screen needs.

    Over the whole null, the largest lies on its boundary pc - pb = delta: for each rate s of discordant
    documents, the tail's chance falls as pc moves away from it. discordant: the observed b + c; from
    CONFINED_FROM documents, where the whole boundary costs seconds a test, the largest is taken over the null's
    values whose s is plausible (:func:`plausible`), plus GAMMA. Those are the boundary's where s >= |delta|,
    and where the set holds an s below |delta| whose documents cannot reach the boundary (the null holds every
    split of them), the split that favours the tail most: none right in the candidate only ("below", delta < 0),
    or all ("above", delta > 0)."""
    span, edge, counts = None, None, None
    confined = discordant is not None and n >= CONFINED_FROM
    if confined:
        s_low, s_high = plausible(n, discordant, given_change)
        first, last = boundary(delta)
        span = max(first, (s_low + delta) / 2), min(last, (s_high + delta) / 2)
        if (side == "below") == (delta < 0) and delta != 0 and s_low < abs(delta):
            edge = s_low, min(s_high, abs(delta))
        if span[0] > span[1] and edge is None:  # no null value is plausible: only the set's miss is left
            return GAMMA
        counts = counts_read(n, (s_low, s_high))
    limits = thresholds(n, delta, score, side, counts)

    def given(s: np.ndarray, tail: np.ndarray) -> np.ndarray:
        if not given_change:
            return tail
        unchanged = (1.0 - np.clip(s, 0.0, 1.0)) ** n  # P(b + c = 0)
        in_tail = limits[0] >= 0 if side == "below" else limits[0] < 0  # the table b = c = 0
        return (tail - unchanged * in_tail) / np.maximum(1.0 - unchanged, 1e-300)

    best = 0.0
    if edge is not None:  # the rates below the boundary, at their most favourable split
        s = np.unique(np.concatenate([np.linspace(*edge, GRID), np.clip(edge[1] - END_FLIPS / n, *edge)]))
        q = np.full_like(s, 0.0 if side == "below" else 1.0)
        best = float(given(s, tail_at(limits, n, delta, s, q, side)).max())
    if span is None or span[0] <= span[1]:
        best = max(best, boundary_p(n, delta, score, side, span, counts,
                                    lambda pc, tail: given(2 * pc - delta, tail)))
    return float(min(1.0, best + (GAMMA if confined else 0.0)))


def boundary_p(n: int, delta: float, score: float, side: str, span: tuple[float, float] | None,
               counts: tuple[int, int] | None, given: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> float:
    """The largest tail probability over the boundary (or its part span): on the nuisance grid, then refined
    between the neighbours of its highest peaks. given: the probability made of a tail's (given_change)."""
    limits, grid, swept = sweep(n, delta, score, side, span, counts)
    probability = lambda pc: given(pc, tail_probability(limits, n, delta, pc, side))  # noqa: E731
    values = given(grid, swept)
    spans = [(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]) for i in peaks(values, REFINED)]
    best = float(values.max())
    for a, b in spans:  # between the neighbours of each highest peak, finer and finer
        for _ in range(ZOOMS):
            local = np.linspace(a, b, ZOOM_POINTS)
            found = probability(local)
            best, j = max(best, float(found.max())), int(found.argmax())
            a, b = local[max(j - 1, 0)], local[min(j + 1, ZOOM_POINTS - 1)]
    return best


@lru_cache(maxsize=1 << 16)
def tango_p(b: int, c: int, n: int, bound: float, side: str, given_change: bool = False) -> float:
    """p-value for H1: p_cand - p_ref < bound (side "below") or > bound ("above"), from b, c of n documents;
    given_change (with b + c > 0): given that some document changed (tail_p)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    if n <= 0 or b < 0 or c < 0 or b + c > n:
        raise ValueError(f"no valid paired table: b={b}, c={c}, n={n}")
    if not -1.0 < bound < 1.0:
        return 1.0 if (side == "below") == (bound <= -1.0) else 0.0
    return tail_p(n, bound, float(tango_scores(bound, np.array([b]), np.array([c]), n)[0]), side,
                  given_change and b + c > 0, discordant=b + c)


def _limit(rejects: Callable[[float], bool], p: Callable[[float], float], alpha: float, points: Iterable[float],
           *, lower: bool, guess: float | None = None) -> float:
    """Where the one-sided test stops rejecting: the interval's lower limit (lower: rejected below it) or its
    upper one (rejected above it). Bracketed between the decision points (the bounds the verdicts test), so the
    limit lies on the same side of each of them as the test's verdict there; and, where a guess is given (the
    asymptotic limit), in the narrowest bracket about it that _near finds, which spares most of the p-values
    located between the points (each a sweep over the nuisance)."""
    ends = sorted({-1.0, 1.0, *(float(t) for t in points if -1.0 < t < 1.0)})
    shown = [rejects(t) for t in ends]  # lower: rejected at -1, not at 1; upper: the reverse
    i = shown.index(False) if lower else shown.index(True)
    a, b = ends[i - 1], ends[i]
    if b - a <= XTOL:
        root = b if lower else a
    else:
        from scipy.optimize import brentq  # imported here: a compare that inverts no Tango test spares its 0.07 s

        crossing = lambda t: p(t) - alpha  # noqa: E731
        root = brentq(crossing, *_near(crossing, a, b, guess, shown[i - 1]), xtol=XTOL, rtol=1e-4)
    if lower and a > -1.0:  # strictly above a bound the test rejects
        return max(root, float(np.nextafter(a, b)))
    if not lower and b < 1.0:  # strictly below one
        return min(root, float(np.nextafter(b, a)))
    return float(root)


def _near(crossing: Callable[[float], float], a: float, b: float, guess: float | None,
          rejected_at_a: bool) -> tuple[float, float]:
    """A bracket within [a, b] (where crossing changes sign; rejected_at_a: crossing(a) < 0, as _limit found it)
    about guess where it changes sign: first guess -+ a little under half the limit's own tolerance (a bracket
    brentq takes as found, with no other p-value), the bracket moved and widened 16-fold at each step toward the
    change, up to a or b; [a, b] where there is no guess inside it."""
    if guess is None or not a < guess < b:
        return a, b
    width = 0.45 * (XTOL + 1e-4 * abs(guess))
    low, high = max(a, guess - width), min(b, guess + width)
    while True:
        width *= 16
        if (crossing(low) < 0) != rejected_at_a:  # it changes sign below low
            low, high = max(a, low - width), low
        elif (crossing(high) < 0) == rejected_at_a:  # above high
            low, high = high, min(b, high + width)
        else:
            return low, high


def tango_limits(b: int, c: int, n: int, alpha: float, points: Iterable[float] = (0.0,),
                 guess: tuple[float, float] | None = None) -> tuple[float, float]:
    """The (1 - 2 alpha) interval the exact one-sided tests invert: (low, high) with p(diff > t) < alpha exactly
    for t < low and p(diff < t) < alpha exactly for t > high, at every decision point t given (the bounds the
    verdicts test: -tolerance, 0, +tolerance) and as closely as XTOL between them. guess: where each limit is
    looked for first (_limit's)."""
    points, (low_guess, high_guess) = tuple(points), guess or (None, None)
    above = lambda t: tango_p(b, c, n, t, "above")  # noqa: E731
    below = lambda t: tango_p(b, c, n, t, "below")  # noqa: E731
    low = _limit(lambda t: above(t) < alpha, above, alpha, points, lower=True, guess=low_guess)
    high = _limit(lambda t: below(t) < alpha, below, alpha, points, lower=False, guess=high_guess)
    return low, high


def bootstrap_p(statistics: np.ndarray, bound: float, side: str) -> float:
    """Percentile-bootstrap p-value for H1: statistic < bound ("below") or > bound ("above")."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    null = statistics >= bound if side == "below" else statistics <= bound
    return float((1 + np.count_nonzero(null)) / (1 + len(statistics)))


def bootstrap_limits(statistics: np.ndarray, alpha: float) -> tuple[float, float]:
    """The interval bootstrap_p inverts at alpha: bootstrap_p(t, "above") < alpha exactly when t < low, and
    bootstrap_p(t, "below") < alpha exactly when t > high. With k the most resamples a side may hold (fewer than
    alpha (B + 1) - 1), these are the (k + 1)-th smallest and largest resamples; infinite when the resamples
    are too few to reject anything at alpha (or NaN when a resample is)."""
    ordered = np.sort(np.asarray(statistics, dtype=float))
    if np.isnan(ordered).any() or not len(ordered):
        return float("nan"), float("nan")
    k = int(np.ceil(alpha * (len(ordered) + 1) - 1)) - 1
    if k < 0:
        return float("-inf"), float("inf")
    return float(ordered[k]), float(ordered[len(ordered) - 1 - k])
