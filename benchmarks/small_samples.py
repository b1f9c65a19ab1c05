"""Does every method of ``python -m evalkit.compare`` keep its promise at every number of documents? The size (how
often a row is called `worse` when its true change is exactly -tolerance, the largest change that must pass) and
the power (how often when it is twice that) of one row, and how often an `equivalent` claim is false, simulated
through evalkit/compare/statistics/stats.py's compare_paired (the code the command runs) at n = 2, 3, 5, 10, 30, 100, 1,000.

Methods and the documents each is given (tolerance 0.02, alpha 0.05, one row):

* ``tango`` (0/1 metrics): each document lost with probability tolerance (power: twice it), none gained.
* ``sign-flip`` (means of unbounded values): differences Normal(-tolerance, 0.05) (power: mean -2 tolerance);
  and ``sign-flip, skewed``: differences -tolerance + 0.05 (Exp(1) - 1), asymmetric about their mean, the case
  its exactness does not cover.
* ``betting`` (means of values in [0, 1], per-document F1 in [0.9, 1]): a document drops to 0 with probability
  tolerance / 0.95 (a true change of -tolerance), the rest move by Uniform(-0.005, 0.005) (power: twice the
  drops); `equivalent` when wrong: 10 % of documents drop to 0 (a true change of -0.095).
* ``bootstrap`` (the paired bootstrap of the mean these rows used before; for contrast): as sign-flip, and for
  `equivalent` as betting.
* ``delta`` (perplexity-family): per-document (log-likelihood, words), the candidate's log-likelihood per word
  off by the log of 1.02 (a 2 % rise in perplexity) plus Normal(0, 0.01) noise; power: 4 %.

Printed, not asserted. Run: python -m benchmarks.small_samples [--trials 400] [--seed 0] [--sizes 2,3,5,...]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from evalkit.compare.statistics import stats

TOL, ALPHA = 0.02, 0.05


def row(ref, cand, *, by_mean=True, aggregate=None, name="mean", hib=True, relative=False, analytic=False):
    from lm_eval.api.registry import get_aggregation

    aggregate = aggregate or get_aggregation(name)
    return stats.compare_paired(list(ref), list(cand), aggregate=aggregate, aggregate_name=name, by_mean=by_mean,
                                higher_is_better=hib, tolerance=TOL, relative=relative, iterations=2_000,
                                analytic=analytic)


def worse(c) -> bool:
    return c.p_worse < ALPHA


def equivalent(c) -> bool:
    return c.p_equivalent < ALPHA


def tango(rng, n, drop):
    ref = np.ones(n)
    return row(ref, np.where(rng.random(n) < drop, 0.0, 1.0))


def normal(rng, n, mean):
    ref = rng.uniform(2.0, 3.0, n)  # outside [0, 1]: the sign-flip test
    return row(ref, ref + rng.normal(mean, 0.05, n))


def skewed(rng, n, mean):
    ref = rng.uniform(2.0, 3.0, n)
    return row(ref, ref + mean + 0.05 * (rng.exponential(1.0, n) - 1.0))


def f1_like(rng, n, drop):
    """Per-document F1 in [0.9, 1] in the reference; in the candidate a document drops to 0 with probability drop,
    the rest move by Uniform(-0.005, 0.005) (kept in [0, 1])."""
    ref = rng.uniform(0.9, 1.0, n)
    moved = np.clip(ref + rng.uniform(-0.005, 0.005, n), 0.0, 1.0)
    return ref, np.where(rng.random(n) < drop, 0.0, moved)


def betting(rng, n, drop):
    return row(*f1_like(rng, n, drop))


def bootstrap(rng, n, mean):
    return bootstrapped(rng.normal(mean, 0.05, n), rng)


def bootstrap_drop(rng, n, drop):
    ref, cand = f1_like(rng, n, drop)
    return bootstrapped(cand - ref, rng)


def bootstrapped(delta, rng):
    from evalkit.compare.statistics.bootstrap import bootstrap_means

    statistics = bootstrap_means(delta, iterations=2_000, seed=int(rng.integers(1 << 30)))
    _, p = stats.bootstrap_reading(float(delta.mean()), statistics, tolerance=TOL, confidence=1 - ALPHA,
                                   higher_is_better=True)
    return type("Row", (), p)


def delta(rng, n, rise):
    words = rng.integers(50, 400, n).astype(float)
    per_word = np.log(1 / 15) * (1 + 0.1 * rng.normal(size=n))
    ref = [(float(w * p), float(w)) for w, p in zip(words, per_word)]
    cand = [(float(w * (p - math.log1p(rise) + 0.01 * rng.normal())), float(w)) for w, p in zip(words, per_word)]
    return row(ref, cand, by_mean=False, name="weighted_perplexity", hib=False, relative=True, analytic=True)


CASES = [  # name, make, claim, value at the boundary (size), value for power
    ("tango", tango, worse, TOL, 2 * TOL),
    ("sign-flip", normal, worse, -TOL, -2 * TOL),
    ("sign-flip, skewed", skewed, worse, -TOL, -2 * TOL),
    ("betting", betting, worse, TOL / 0.95, 2 * TOL / 0.95),
    ("bootstrap (before)", bootstrap, worse, -TOL, -2 * TOL),
    ("delta", delta, worse, TOL, 2 * TOL),
]
EQUIVALENCE = [("betting", betting, 0.10), ("bootstrap (before)", bootstrap_drop, 0.10)]


def rate(make, claim, value, n, trials, rng) -> float:
    return sum(claim(make(rng, n, value)) for _ in range(trials)) / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="2,3,5,10,30,100,1000")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)
    se = math.sqrt(ALPHA * (1 - ALPHA) / args.trials)
    print(f"{args.trials} trials per cell (standard error about {se:.3f} at a rate of {ALPHA}); tolerance {TOL}, "
          f"alpha {ALPHA}\n")
    print("| method | | " + " | ".join(f"n={n}" for n in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for name, make, claim, boundary, power in CASES:
        started = time.perf_counter()
        for label, value in (("size", boundary), ("power", power)):
            cells = [f"{rate(make, claim, value, n, args.trials, rng):.3f}" for n in sizes]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - started:.0f} s -->", flush=True)
    for name, make, value in EQUIVALENCE:
        cells = [f"{rate(make, equivalent, value, n, args.trials, rng):.3f}" for n in sizes]
        print(f"| {name} | `equivalent` at a true change of -0.10 | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
