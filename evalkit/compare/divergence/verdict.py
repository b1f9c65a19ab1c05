"""Did the candidate move beyond the engine's own noise? A paired one-sided test over documents.

Inputs: per document, the candidate's divergence from the reference and a noise run's (a second reference run:
same configuration, other order or batch), on the same documents, computed the same way (both exact, or both
bounds at the same k). Under "the candidate is one more run of the reference's process", the two divergences
of a document are exchangeable, so each difference is as likely positive as negative and the sign-flip
distribution is exact. The test is Wilcoxon's signed-rank test (Wilcoxon 1945) of H1: the candidate's
divergence tends to be larger: ranks, not values, because per-document KLD is heavy-tailed and one document
must not decide alone. Zero differences (a document the two runs leave equally far) are dropped, which keeps
the conditional test exact; tied magnitudes get midranks. The p-value is exact (the null distribution of the
doubled midranks by convolution) up to EXACT_MAX differing documents and the normal approximation with the tie
correction above, where its error is far below any level in use. So it resolves any α; its floor is 2^-D.

Labels and exit codes, as compare's: "beyond noise" (1) when p <= α; "within noise" (0) otherwise; "unusable"
(2) when the runs share no document, when a divergence is NaN, or when they share fewer documents than
the test needs to ever reach α (2^-N > α: 7 at α = 0.01) — said in one line instead of a silent "within".
Without a noise run there is no verdict: show the figures only. Several candidates against one noise run are one
family: ``family`` adjusts their p-values by Holm's step-down, as compare adjusts its rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Hashable, Mapping

import numpy as np

from evalkit.compare.statistics.verdict import holm

ALPHA = 0.01
EXACT_MAX = 400  # differing documents up to which the p-value is exact (a convolution over 400 * 401 sums)
EXIT = {"within noise": 0, "beyond noise": 1, "unusable": 2}


@dataclass(frozen=True)
class NoiseVerdict:
    label: str  # "beyond noise", "within noise" or "unusable"
    p_value: float  # one-sided, NaN where unusable
    alpha: float
    documents: int  # documents both runs have
    differing: int  # of those, documents whose two divergences differ: the test's sample
    candidate: float  # mean over the common documents of the candidate's per-document divergence
    noise: float  # the same for the noise run
    reason: str  # one line: the test and its figures, or why there is no verdict

    @property
    def exit_code(self) -> int:
        return EXIT[self.label]


def min_documents(alpha: float) -> int:
    """Fewest documents whose signed-rank p-value can reach alpha: its floor is 2^-N."""
    return max(1, math.ceil(math.log2(1.0 / alpha) - 1e-12))


@lru_cache(maxsize=64)
def _null_tail(ranks: tuple[int, ...]) -> np.ndarray:
    """P(W >= w) for w = 0..sum(ranks), W the sum of the ranks given a random sign each."""
    total = sum(ranks)
    pmf = np.zeros(total + 1)
    pmf[0] = 1.0
    reach = 0
    for r in ranks:
        # each rank joins the positive sum or not, with probability one half
        pmf[r:reach + r + 1] += pmf[:reach + 1].copy()
        pmf[:reach + r + 1] *= 0.5
        reach += r
    return np.cumsum(pmf[::-1])[::-1]


def signed_rank_p(differences: np.ndarray) -> float:
    """One-sided p-value of Wilcoxon's signed-rank test for H1: the differences tend to be positive; zeros
    dropped, midranks for ties; exact up to EXACT_MAX nonzero differences."""
    from scipy.stats import norm, rankdata  # imported here: it costs every compare 0.3 s to import

    x = np.asarray(differences, dtype=float)
    x = x[x != 0]
    if len(x) == 0:
        return 1.0
    doubled = np.rint(2 * rankdata(np.abs(x))).astype(np.int64)  # midranks are halves: twice them are integers
    observed = int(doubled[x > 0].sum())
    if len(x) <= EXACT_MAX:
        distinct = len(np.unique(doubled)) == len(doubled)
        ranks = tuple(range(1, len(x) + 1)) if distinct else tuple(sorted(int(r) for r in doubled))
        w = observed // 2 if distinct else observed
        return float(min(1.0, _null_tail(ranks)[w]))
    mean = doubled.sum() / 2.0
    sd = math.sqrt(float((doubled.astype(float) ** 2).sum()) / 4.0)
    return float(norm.sf((observed - 1 - mean) / sd))  # continuity: half a rank (1 in doubled ranks)


def noise_verdict(candidate: Mapping[Hashable, float], noise: Mapping[Hashable, float], *,
                  alpha: float = ALPHA) -> NoiseVerdict:
    """The verdict from per-document divergences (document -> mean KLD) of the candidate and of a noise run."""
    common = [d for d in candidate if d in noise]
    cand = np.array([candidate[d] for d in common], dtype=float)
    base = np.array([noise[d] for d in common], dtype=float)
    means = (float(cand.mean()), float(base.mean())) if common else (math.nan, math.nan)

    def unusable(reason: str) -> NoiseVerdict:
        return NoiseVerdict("unusable", math.nan, alpha, len(common), 0, *means, reason)

    if not common:
        return unusable("the candidate and the noise run have no document in common")
    if np.isnan(cand).any() or np.isnan(base).any():
        return unusable(f"{int(np.isnan(cand).sum() + np.isnan(base).sum())} per-document divergences are NaN")
    need = min_documents(alpha)
    if len(common) < need:
        return unusable(f"{len(common)} documents in common: a paired test over documents cannot reach "
                        f"alpha={alpha:g} with fewer than {need}")
    with np.errstate(invalid="ignore"):
        diff = cand - base
    diff[np.isnan(diff)] = 0.0  # both +inf: neither run is further
    p = signed_rank_p(diff)
    label = "beyond noise" if p <= alpha else "within noise"
    differing = int((diff != 0).sum())
    return NoiseVerdict(label, p, alpha, len(common), differing, *means,
                        f"signed-rank test over {differing} of {len(common)} documents: p={p:.3g}, "
                        f"alpha={alpha:g}")


def family(verdicts: list[NoiseVerdict], *, alpha: float = ALPHA) -> list[NoiseVerdict]:
    """Several candidates' verdicts as one family: each usable one's label from its Holm-adjusted p-value, so
    the chance that any candidate of one process is called beyond noise stays at most alpha. A candidate whose
    documents could not reach alpha after the adjustment (fewer than min_documents(alpha / m) for m candidates
    tested) is unusable, as one alone is below min_documents(alpha)."""
    tested = [i for i, v in enumerate(verdicts) if v.label != "unusable"]
    if len(tested) < 2:
        return list(verdicts)
    out = list(verdicts)
    needed = min_documents(alpha / len(tested))  # Holm's smallest adjusted p is m 2^-N: it must reach alpha
    for i in tested:
        if verdicts[i].documents < needed:
            out[i] = replace(verdicts[i], label="unusable", p_value=math.nan,
                             reason=f"{verdicts[i].documents} documents in common, fewer than the {needed} that "
                                    f"{len(tested)} candidates against one noise run need to ever reach "
                                    f"alpha={alpha:g} after Holm's adjustment (2^-N x {len(tested)}); compare "
                                    "more documents or fewer candidates")
    adjusted = holm(np.array([verdicts[i].p_value for i in tested]))
    for i, p in zip(tested, adjusted):
        if out[i].label == "unusable":
            continue
        out[i] = replace(verdicts[i], label="beyond noise" if p <= alpha else "within noise",
                         reason=f"{verdicts[i].reason}; Holm-adjusted over {len(tested)} candidates: p={p:.3g}")
    return out
