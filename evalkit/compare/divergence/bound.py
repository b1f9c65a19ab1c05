"""KL(P_ref || P_cand) at each position: exact from two full distributions, otherwise a lower bound that is sound.

Where a run gives only some entries, both distributions are coarsened to the tokens whose probabilities are known
on both sides, S, plus one "rest" bucket holding everything else: p_rest = 1 - sum_S p, q_rest = 1 - sum_S q.
A token known on one side only falls in the rest. The coarsened divergence

    sum_{i in S} p_i log(p_i / q_i) + p_rest log(p_rest / q_rest)

is the KL of a function of the token (its bucket), so by the data-processing inequality (the log-sum inequality,
Cover & Thomas, Elements of Information Theory, 2nd ed., 2.7.1 and 2.8.1) it is never above the true KL, whatever
S is; it equals it when S covers the vocabulary. ``captured`` is sum_S p, the reference mass the bound sees.

Float error: the rest masses are 1 minus sums of rounded probabilities, so a rest can come out slightly negative
(clamped to 0; p_rest = 0 contributes 0) or 0 on the candidate while the reference's is not (the candidate put,
up to rounding, all its mass on S). The candidate's rest is floored at ``mass_tol`` before the logarithm: the
term falls as q_rest grows, so the floor only lowers the bound (it stays sound) and a tiny rounded value never
turns into +inf. Without the floor, a q_rest of 1e-9 that rounding made 0 would report an infinite divergence.
The default 1e-6 is ten times the resolution of a float32 mass near 1; inputs rounded more coarsely (bfloat16
log-probabilities) need a larger one. Where a log-probability itself is -inf on the candidate and not on the
reference, the divergence is +inf, as it truly is.

Stored values: a record keeps float32 log-probabilities, each within half a float32 step of the engine's, about
|ln q| 2^-24 relative in q, and a distribution's stored values sum to 1 only within that. Where the candidate's
rest is tiny, 1 - sum_S q is dominated by that rounding, and a rest read too small makes the rest term too
large (up to 0.04 nats above the exact KL at 12.6 in a stress case: q_rest 1.4e-6, p_rest 0.95). So the
candidate's rest is read with the largest error the stored values allow added, ``rounding_margin``: the bound
is then at most the exact KL of the stored values (each row normalised, as :func:`exact_kl` reads them), up to
float64 arithmetic (tests/test_divergence.py's stress case).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp

from evalkit.compare.divergence.sides import PAD, Side

MASS_TOL = 1e-6
FULL_TOP = 8  # a full side adds its 8 most likely ids to the ids compared (its top token and any tie with it)
ROWS = 64  # positions per block when a full vocabulary is read (64 x 49,152 float64: 25 MiB a temporary)


@dataclass(frozen=True)
class Aligned:
    """Both sides' log-probabilities over one set of ids per position: the union of what either side knows
    (with the text token), PAD-padded; NaN where a side does not know an id or the slot is empty."""

    ids: np.ndarray  # (n, m)
    ref: np.ndarray  # (n, m)
    cand: np.ndarray  # (n, m)


@dataclass(frozen=True)
class Bound:
    """Per position: the divergence (exact, or its lower bound) and the reference mass it saw."""

    kld: np.ndarray  # (n,)
    captured: np.ndarray  # (n,)


def _known_ids(side: Side) -> np.ndarray:
    """The ids a side contributes to the comparison: its entries and the text token, or a full side's top ids."""
    if side.full is None:
        return np.concatenate([side.ids, side.text_ids[:, None]], axis=1)
    top = min(FULL_TOP, side.full.shape[1])
    return np.concatenate([np.argpartition(-side.full, top - 1, axis=1)[:, :top], side.text_ids[:, None]], axis=1)


def lookup(side: Side, ids: np.ndarray) -> np.ndarray:
    """The side's log-probabilities at ids (n, m); NaN where it does not know one or the slot is PAD."""
    n = side.n
    if side.full is not None:
        values = side.full[np.arange(n)[:, None], np.maximum(ids, 0)]
        return np.where(ids == PAD, np.nan, values)
    own = np.concatenate([side.ids, side.text_ids[:, None]], axis=1)
    values = np.concatenate([side.logprobs, side.text_logprobs[:, None]], axis=1)
    rows = np.arange(n, dtype=np.int64)[:, None] << 32  # one sorted key space: (row, id) -> row * 2^32 + id
    keep = own != PAD
    keys, values = (rows + own)[keep], values[keep]
    order = np.argsort(keys, kind="stable")
    keys, values = keys[order], values[order]
    wanted = rows + ids
    if len(keys) == 0:
        return np.full(ids.shape, np.nan)
    at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    found = (keys[at] == wanted) & (ids != PAD)
    return np.where(found, values[at], np.nan)


def align(ref: Side, cand: Side) -> Aligned:
    """Both sides over the union of their known ids at each position. The two must score the same text."""
    if ref.n != cand.n or not np.array_equal(ref.text_ids, cand.text_ids):
        raise ValueError("the two runs do not score the same text tokens at the same positions")
    ids = np.sort(np.concatenate([_known_ids(ref), _known_ids(cand)], axis=1), axis=1)
    repeated = np.zeros(ids.shape, dtype=bool)
    repeated[:, 1:] = ids[:, 1:] == ids[:, :-1]
    ids = np.where(repeated, PAD, ids)
    return Aligned(ids=ids, ref=lookup(ref, ids), cand=lookup(cand, ids))


def rounding_margin(lc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Per row, how far the stored float32 values may put sum_S q above its true value, or the normaliser of
    the stored row away from 1: half a float32 step of each log-probability on S (|ln q| 2^-24 relative in q,
    doubled), and 2^-20 for the rows' other values (an entropy up to 16 nats at 2^-24)."""
    with np.errstate(invalid="ignore"):
        scaled = np.where(q > 0, q * (np.abs(lc) + 1.0), 0.0)
    return scaled.sum(axis=1) * 2.0 ** -23 + 2.0 ** -20


def coarse_kl(aligned: Aligned, *, mass_tol: float = MASS_TOL) -> Bound:
    """The coarsened KL (module docstring) over the ids known on both sides, with its captured mass."""
    both = ~np.isnan(aligned.ref) & ~np.isnan(aligned.cand)
    lr = np.where(both, aligned.ref, -np.inf)
    lc = np.where(both, aligned.cand, -np.inf)
    p, q = np.exp(lr), np.exp(lc)
    with np.errstate(invalid="ignore"):
        # p * (lr - lc): 0 where p is 0 (an unknown slot, or an underflowed probability), +inf where only q is 0
        terms = np.where(p > 0, p * (lr - lc), 0.0)
    captured = p.sum(axis=1)
    p_rest = np.clip(1.0 - captured, 0.0, 1.0)
    q_rest = np.maximum(np.clip(1.0 - q.sum(axis=1), 0.0, 1.0) + rounding_margin(lc, q), mass_tol)
    rest = np.where(p_rest > 0, p_rest * (np.log(np.where(p_rest > 0, p_rest, 1.0)) - np.log(q_rest)), 0.0)
    # a divergence is never below 0: a sum that rounding took below it (two runs that agree to the last bit but
    # one, -1e-10) is 0, which stays under the true value, so the bound stays sound
    return Bound(kld=np.maximum(terms.sum(axis=1) + rest, 0.0), captured=captured)


def exact_kl(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """KL(P_ref || P_cand) at each position from two (n, V) arrays of log-probabilities (or logits: each row
    is normalised in float64 first), in blocks of ROWS positions."""
    out = np.empty(ref.shape[0])
    for start in range(0, ref.shape[0], ROWS):
        lr = np.asarray(ref[start:start + ROWS], dtype=np.float64)
        lc = np.asarray(cand[start:start + ROWS], dtype=np.float64)
        lr = lr - logsumexp(lr, axis=1, keepdims=True)
        lc = lc - logsumexp(lc, axis=1, keepdims=True)
        p = np.exp(lr)
        with np.errstate(invalid="ignore"):
            out[start:start + ROWS] = np.where(p > 0, p * (lr - lc), 0.0).sum(axis=1)
    return out
