"""The measures at each scored position, between a reference run and a candidate run: KL(P_ref || P_cand) (exact
or its sound lower bound, evalkit/compare/divergence/bound.py), top-1 agreement, and the change in the text
token's probability (Δp) and log-probability (its log-likelihood ratio, whose mean over a span is the log of
the PPL ratio), with llama.cpp's signs: Δp = p_cand - p_ref, positive where the candidate gives the text more.

Top-1 agreement, with ties: a side's top tokens are its known entries within ``tie_tol`` (in log-probability) of
its most likely one; the two sides agree when some token is a top token on both. So an exact tie (frequent with
bfloat16 logits) never counts as a disagreement because argmax broke it the other way; llama.cpp compares the
two argmax indices instead, which is the same rule wherever neither side has a tie. A side's most likely token
is known when it is full, when its entries include its own top-k (``own_top``), or when the largest known
probability exceeds the mass it leaves unknown (no unknown token can then beat it). Where one side's top token is
unknown, the position still counts as a disagreement when every top token of the other side is known on it and
below its known maximum (so none can be its top); otherwise the agreement is unknown (NaN) and left out of
"Same top p", counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from evalkit.compare.divergence.bound import MASS_TOL, ROWS, align, coarse_kl, exact_kl
from evalkit.compare.divergence.sides import Side

TIE_TOL = 1e-6  # nats: log-probabilities this close are a tie (about ten float32 steps near ln p = -1)


@dataclass(frozen=True)
class Positions:
    """The measures at n positions, one array each (n,), in the order the sides gave them."""

    kld: np.ndarray  # KL(P_ref || P_cand), or its lower bound where exact is False
    exact: np.ndarray  # bool: both sides gave the full distribution
    captured: np.ndarray  # reference mass on the tokens known on both sides (1 where exact)
    same_top: np.ndarray  # 1.0 the top tokens agree, 0.0 they differ, NaN unknown
    delta_p: np.ndarray  # p_cand - p_ref of the text token
    llr: np.ndarray  # ln p_cand - ln p_ref of the text token

    @property
    def n(self) -> int:
        return len(self.kld)

    @staticmethod
    def concat(parts: list["Positions"]) -> "Positions":
        return Positions(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Positions)})


def _tied(values: np.ndarray, tie_tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Which known entries are top tokens (within tie_tol of the row's known maximum), and that maximum."""
    top = np.nanmax(values, axis=1)
    with np.errstate(invalid="ignore"):
        return values >= (top - tie_tol)[:, None], top


def _top_known(side: Side, values: np.ndarray, top: np.ndarray, tie_tol: float) -> np.ndarray:
    """Whether the side's most likely token is among its known entries (see the module docstring)."""
    if side.full is not None or side.own_top:
        return np.ones(len(top), dtype=bool)
    unknown = 1.0 - np.nansum(np.exp(values), axis=1)
    with np.errstate(divide="ignore"):
        return top > np.log(np.maximum(unknown, 0.0)) + tie_tol


def _excluded(tied_other: np.ndarray, values: np.ndarray, top: np.ndarray, tie_tol: float) -> np.ndarray:
    """Every top token of the other side is known here and clearly below this side's known maximum."""
    below = ~np.isnan(values) & (values < (top - tie_tol)[:, None])
    return (~tied_other | below).all(axis=1)


def same_top(ref: Side, cand: Side, ref_values: np.ndarray, cand_values: np.ndarray,
             *, tie_tol: float = TIE_TOL) -> np.ndarray:
    """Top-1 agreement from both sides' values over the same ids (NaN unknown): 1.0, 0.0 or NaN per position."""
    tied_r, top_r = _tied(ref_values, tie_tol)
    tied_c, top_c = _tied(cand_values, tie_tol)
    known_r = _top_known(ref, ref_values, top_r, tie_tol)
    known_c = _top_known(cand, cand_values, top_c, tie_tol)
    agree = (tied_r & tied_c).any(axis=1).astype(float)
    out = np.where(known_r & known_c, agree, np.nan)
    out[known_r & ~known_c & _excluded(tied_r, cand_values, top_c, tie_tol)] = 0.0
    out[~known_r & known_c & _excluded(tied_c, ref_values, top_r, tie_tol)] = 0.0
    return out


def _full_same_top(ref: np.ndarray, cand: np.ndarray, tie_tol: float) -> np.ndarray:
    out = np.empty(ref.shape[0])
    for start in range(0, ref.shape[0], ROWS):
        tied_r, _ = _tied(ref[start:start + ROWS], tie_tol)
        tied_c, _ = _tied(cand[start:start + ROWS], tie_tol)
        out[start:start + ROWS] = (tied_r & tied_c).any(axis=1)
    return out


def measure(ref: Side, cand: Side, *, mass_tol: float = MASS_TOL, tie_tol: float = TIE_TOL) -> Positions:
    """Every measure at every position of two sides that score the same text tokens."""
    if ref.full is not None and cand.full is not None:
        if ref.full.shape != cand.full.shape or not np.array_equal(ref.text_ids, cand.text_ids):
            raise ValueError("the two runs do not score the same text tokens over the same vocabulary")
        kld = exact_kl(ref.full, cand.full)
        exact = np.ones(ref.n, dtype=bool)
        captured = np.ones(ref.n)
        top = _full_same_top(ref.full, cand.full, tie_tol)
    else:
        aligned = align(ref, cand)
        bound = coarse_kl(aligned, mass_tol=mass_tol)
        kld, captured, exact = bound.kld, bound.captured, np.zeros(ref.n, dtype=bool)
        top = same_top(ref, cand, aligned.ref, aligned.cand, tie_tol=tie_tol)
    return Positions(kld=kld, exact=exact, captured=captured, same_top=top,
                     delta_p=np.exp(cand.text_logprobs) - np.exp(ref.text_logprobs),
                     llr=cand.text_logprobs - ref.text_logprobs)
