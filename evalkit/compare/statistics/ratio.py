"""lm-eval's perplexity-family aggregations, a task's or a group's (a weighted mean of leaves), as ratios of
per-document sums: the form means.sign_flip tests (paired_sums), from means.MIN_UNBOUNDED documents on, as a
log-likelihood change is unbounded and LLM changes are zero-inflated (stats.perplexity_reading). Pure functions.

lm-eval's ``perplexity`` (exp(-mean(ll))), ``weighted_perplexity`` (word_perplexity and byte_perplexity:
exp(-sum(ll) / sum(words or bytes))) and ``bits_per_byte`` (-sum(ll) / sum(bytes) / ln 2) are each a function of
one leaf's sum of log-likelihoods over the sum of its documents' denominators (1 each for ``perplexity``), which
are the same in both runs (words and bytes are the document's). A group (lm-eval's ``aggregate_subtask_metrics``)
weights its leaves' scores by w_k (sizes, or equally); a task is a group of one leaf. With g_i the candidate's
log-likelihood minus the reference's on document i of leaf k and D_k the leaf's denominator:

* ``bits_per_byte`` is linear in the log-likelihoods: the group's change is sum_i d_i with
  d_i = -w_k g_i / (D_k ln 2), and over units u_i = w_k den_i / D_k (summing to 1) that is the absolute change;
  over u_i = -w_k ll_i / (D_k ln 2), the reference's score, it is the relative one. Both exact.
* the perplexities: leaf k's log change is delta_k = -sum g / D_k. Over units u_i = v_k den_i / D_k, with v_k the
  leaf's share of the reference's group score (w_k P_k / sum_j w_j P_j), sum(d) / sum(u) = sum_k v_k delta_k,
  d_i = -v_k g_i / D_k. Every leaf's perplexity changing by one factor 1 + t (the null the test's per-document
  centring stands for, as a task's words do) makes it log(1 + t), the log of the group's change; leaves that
  change unequally make it smaller than that log (Jensen), so the test of `worse` (the group's perplexity rising
  beyond the tolerance) stays valid. One leaf: exactly the task's log change. An absolute row's bound b is the
  relative bound b / the reference's score (the row's scale is that score times the relative change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

LN2 = math.log(2)
SCORE: dict[str, Callable[[float], float]] = {  # aggregation -> its score as a function of sum(ll) / sum(den)
    "perplexity": lambda r: math.exp(-r),
    "weighted_perplexity": lambda r: math.exp(-r),
    "bits_per_byte": lambda r: -r / LN2,
}


@dataclass(frozen=True)
class Stratum:
    """One leaf's (or one task's) paired documents: numerators and denominators of the ratio in each run."""

    num: np.ndarray  # shape (2, n): reference, candidate
    den: np.ndarray

    @property
    def n(self) -> int:
        return self.num.shape[1]


def stratum(reference: Sequence[Any], candidate: Sequence[Any], aggregation: str) -> Stratum:
    """The ratio's parts from lm-eval's per-document values: ll (perplexity) or (ll, words or bytes) pairs."""
    if aggregation == "perplexity":
        num = np.array([reference, candidate], dtype=float)
        return Stratum(num=num, den=np.ones_like(num))
    pairs = np.array([[tuple(v) for v in reference], [tuple(v) for v in candidate]], dtype=float)
    if pairs.ndim != 3 or pairs.shape[2] != 2:
        raise ValueError(f"{aggregation}: expected (log-likelihood, count) pairs per document")
    return Stratum(num=pairs[..., 0], den=pairs[..., 1])


def scores(strata: list[Stratum], weights: Sequence[float], aggregation: str) -> tuple[float, float]:
    """The reference's and the candidate's score: the leaves' aggregations, weighted (weights need not sum to 1)."""
    w = np.asarray(weights, dtype=float) / float(np.sum(weights))
    each = [[SCORE[aggregation](s.num[i].sum() / s.den[i].sum()) for i in (0, 1)] for s in strata]
    return float(np.dot(w, [e[0] for e in each])), float(np.dot(w, [e[1] for e in each]))


Form = tuple[np.ndarray, np.ndarray, Callable[[float], float], Callable[[float], float]]


def paired_sums(strata: list[Stratum], weights: Sequence[float], aggregation: str, *, relative: bool
                ) -> Form | None:
    """(d, u, to_test, to_row): the row's change as sum(d) / sum(u) over every leaf's documents (the module's
    docstring), to_test mapping a bound on the row's scale (candidate / reference - 1, or candidate - reference)
    to that of sum(d) / sum(u), to_row back. None where a document's denominator differs between the runs or a
    unit is not positive: no such ratio."""
    if any(not np.array_equal(s.den[0], s.den[1]) for s in strata):
        return None
    w = np.asarray(weights, dtype=float) / float(np.sum(weights))
    ds, us = [], []
    if aggregation == "bits_per_byte":
        for wk, s in zip(w, strata):
            scale = wk / float(s.den[0].sum())
            ds.append(-(s.num[1] - s.num[0]) * scale / LN2)
            us.append(-s.num[0] * scale / LN2 if relative else s.den[0] * scale)
        to_test = to_row = (lambda x: x)
    else:
        reference = np.array([SCORE[aggregation](s.num[0].sum() / s.den[0].sum()) for s in strata])
        total = float(np.dot(w, reference))
        for vk, s in zip(w * reference / total, strata):
            scale = vk / float(s.den[0].sum())
            ds.append(-(s.num[1] - s.num[0]) * scale)
            us.append(s.den[0] * scale)
        base = 1.0 if relative else total
        to_test = (lambda x: math.log1p(x / base) if x > -base else -math.inf)
        to_row = (lambda x: base * float(np.expm1(min(x, 700.0))))
    d, u = np.concatenate(ds), np.concatenate(us)
    return (d, u, to_test, to_row) if (u > 0).all() else None
