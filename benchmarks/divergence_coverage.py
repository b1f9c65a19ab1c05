"""How honest are the divergence intervals and the verdict against noise? A simulation with documents whose
positions are correlated, the case that makes per-position intervals (llama.cpp's) too narrow.

The process: a document has 1 + Poisson(MEAN_LENGTH - 1) positions; each position's difficulty is
g = a_d + e_t, a_d ~ N(0, SIGMA_DOC^2) shared by the document and e_t an AR(1) series (correlation PHI between
neighbours, unit variance); the position's KLD is exp(MU + TAU g + SIGMA_RUN eps), a heavy right tail; its top
tokens disagree where g > c (3 % of positions); Δp = DP_MEAN + DP_SCALE (a_d + e_t). The true Mean KLD, Same top p
and Mean Δp follow in closed form. For the verdict, a candidate run and a noise run share the positions and
their difficulty g and draw their own eps: same process (false alarms), or the candidate's KLD scaled up
by a factor (power).

Prints, per number of documents: the coverage of the 95 % intervals of Mean KLD (evalkit's studentized
document bootstrap of log R; for comparison a t interval on R, one on log R, and a 1,000-resample percentile
document bootstrap), Same top p and Mean Δp;
then the verdict's false-alarm rate (must be at or under alpha, ± its Monte Carlo standard error) and its power.
Run: .venv/bin/python -m benchmarks.divergence_coverage [--reps 600] [--sizes 10,40,200] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
from scipy.stats import norm

from evalkit.compare.divergence import Positions, noise_verdict, summarize
from evalkit.compare.divergence.stats import ratio_estimate

MEAN_LENGTH, SIGMA_DOC, PHI = 25, 0.7, 0.7
MU, TAU, SIGMA_RUN = math.log(1e-3), 1.0, 0.8
AGREE = 0.97
CUT = float(norm.ppf(AGREE)) * math.sqrt(1 + SIGMA_DOC ** 2)
DP_MEAN, DP_SCALE = -0.002, 0.01
TRUE_KLD = math.exp(MU + TAU ** 2 * (SIGMA_DOC ** 2 + 1) / 2 + SIGMA_RUN ** 2 / 2)
CONFIDENCE, ALPHA = 0.95, 0.01
FACTORS = (1.1, 1.25, 1.5)


def difficulty(rng: np.random.Generator, documents: int) -> tuple[np.ndarray, np.ndarray]:
    """Each position's document and its difficulty g (a document effect plus an AR(1) series)."""
    lengths = 1 + rng.poisson(MEAN_LENGTH - 1, documents)
    index = np.repeat(np.arange(documents), lengths)
    start = np.repeat(np.cumsum(lengths) - lengths, lengths)
    step = np.arange(len(index)) - start
    e = rng.standard_normal(len(index))
    for t in range(1, int(lengths.max())):
        at = step == t
        e[at] = PHI * e[np.flatnonzero(at) - 1] + math.sqrt(1 - PHI ** 2) * e[at]
    return index, rng.normal(0, SIGMA_DOC, documents)[index] + e


def kld(rng: np.random.Generator, g: np.ndarray, factor: float = 1.0) -> np.ndarray:
    return factor * np.exp(MU + TAU * g + SIGMA_RUN * rng.standard_normal(len(g)))


def one_run(rng: np.random.Generator, documents: int) -> tuple[Positions, np.ndarray]:
    index, g = difficulty(rng, documents)
    n = len(g)
    positions = Positions(kld=kld(rng, g), exact=np.ones(n, dtype=bool), captured=np.ones(n),
                          same_top=(g <= CUT).astype(float), delta_p=DP_MEAN + DP_SCALE * g, llr=np.zeros(n))
    return positions, index


def bootstrap_interval(rng: np.random.Generator, num: np.ndarray, den: np.ndarray) -> tuple[float, float]:
    weights = rng.multinomial(len(num), np.full(len(num), 1 / len(num)), size=1000)
    ratios = (weights @ num) / (weights @ den)
    return tuple(np.percentile(ratios, [100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2]))


def coverage(rng: np.random.Generator, documents: int, reps: int) -> dict[str, float]:
    hits = dict.fromkeys(["Mean KLD", "t on R", "t on log R", "percentile bootstrap", "Same top p", "Mean Δp"], 0)
    for _ in range(reps):
        positions, index = one_run(rng, documents)
        s = summarize(positions, index, confidence=CONFIDENCE)
        num = np.bincount(index, weights=positions.kld, minlength=documents)
        den = np.bincount(index, minlength=documents).astype(float)
        plain = ratio_estimate(num, den, confidence=CONFIDENCE)
        low, high = bootstrap_interval(rng, num, den)
        hits["Mean KLD"] += s.mean_kld.low <= TRUE_KLD <= s.mean_kld.high
        hits["t on R"] += plain.low <= TRUE_KLD <= plain.high
        half = (plain.high - plain.value) / plain.value
        hits["t on log R"] += plain.value * math.exp(-half) <= TRUE_KLD <= plain.value * math.exp(half)
        hits["percentile bootstrap"] += low <= TRUE_KLD <= high
        hits["Same top p"] += s.same_top.low <= AGREE <= s.same_top.high
        hits["Mean Δp"] += s.mean_dp.low <= DP_MEAN <= s.mean_dp.high
    return {name: count / reps for name, count in hits.items()}


def verdict_rate(rng: np.random.Generator, documents: int, reps: int, factor: float) -> tuple[float, int]:
    """Share of reps called "beyond noise" when the candidate's KLD is factor times the noise run's process;
    and how many were unusable."""
    beyond = unusable = 0
    for _ in range(reps):
        index, g = difficulty(rng, documents)
        lengths = np.bincount(index, minlength=documents)
        cand = np.bincount(index, weights=kld(rng, g, factor), minlength=documents) / lengths
        noise = np.bincount(index, weights=kld(rng, g), minlength=documents) / lengths
        v = noise_verdict(dict(enumerate(cand)), dict(enumerate(noise)), alpha=ALPHA)
        beyond += v.label == "beyond noise"
        unusable += v.label == "unusable"
    return beyond / reps, unusable


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=600, help="simulated comparisons per cell (false alarms: 10x)")
    parser.add_argument("--sizes", default="10,40,200", help="numbers of documents")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    rng = np.random.default_rng(options.seed)
    sizes = [int(s) for s in options.sizes.split(",")]
    began = time.perf_counter()
    print(f"true Mean KLD {TRUE_KLD:.6f}, Same top p {AGREE}, Mean Δp {DP_MEAN}; {options.reps} reps per cell, "
          f"{CONFIDENCE:.0%} intervals\n")
    rows = {d: coverage(rng, d, options.reps) for d in sizes}
    names = list(next(iter(rows.values())))
    print("| documents | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for d, row in rows.items():
        print(f"| {d} | " + " | ".join(f"{row[name]:.3f}" for name in names) + " |")
    print(f"\nverdict against noise at alpha={ALPHA} (signed-rank over documents); false alarms over "
          f"{10 * options.reps} reps, power over {options.reps}\n")
    print("| documents | false alarm (same process) | " + " | ".join(f"power, KLD x{f}" for f in FACTORS) + " |")
    print("|---|---|" + "---|" * len(FACTORS))
    for d in [5] + sizes:
        alarm, unusable = verdict_rate(rng, d, 10 * options.reps, 1.0)
        if unusable:
            print(f"| {d} | unusable ({unusable} of {10 * options.reps}: fewer than the test needs) |"
                  + " |" * len(FACTORS))
            continue
        power = [verdict_rate(rng, d, options.reps, f)[0] for f in FACTORS]
        se = math.sqrt(alarm * (1 - alarm) / (10 * options.reps))
        print(f"| {d} | {alarm:.4f} ± {se:.4f} | " + " | ".join(f"{p:.3f}" for p in power) + " |")
    print(f"\n{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
