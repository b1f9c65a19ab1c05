"""Does the gate hold its family-wise level when rows that cannot be worse are left out of the count? The chance
that any of m rows is called `worse` when every row's true change is exactly -tolerance (the largest change that
must pass) and every changed document was lost, none gained (the case where the smallest p-value a row could
reach given its changed documents is the one it got), simulated through the p-values and the adjustments of
evalkit/compare/statistics/verdict.py:

* ``holm``: Holm over every row (no screen);
* ``screen``: the command's: rows where no document changed cannot be worse and do not count (tarone_holm),
  the others' p-values given that some document changed (tost.tango_p(..., given_change=True));
* ``tarone, all worse``: Tarone's count with each row's smallest p-value given which documents changed taken
  as the one with every changed document lost, for contrast: it equals the row's own p-value here, and the
  count shrinks to the rows that reached alpha.

Run: python -m benchmarks.family_padding [--trials 2000]
"""

from __future__ import annotations

import argparse
from functools import lru_cache

import numpy as np

from evalkit.compare.statistics import tost
from evalkit.compare.statistics.verdict import holm, tarone_holm

TOLERANCE, ALPHA = 0.02, 0.05


@lru_cache(maxsize=None)
def p_worse(b: int, n: int, given_change: bool) -> float:
    return tost.tango_p(b, 0, n, -TOLERANCE, "below", given_change)


def rates(n: int, m: int, trials: int, rng: np.random.Generator) -> dict[str, float]:
    failed = {"holm": 0, "screen": 0, "tarone, all worse": 0}
    for _ in range(trials):
        lost = rng.binomial(n, TOLERANCE, size=m)
        plain = np.array([p_worse(int(b), n, False) for b in lost])
        given = np.array([p_worse(int(b), n, True) for b in lost])
        failed["holm"] += bool((holm(plain) < ALPHA).any())
        failed["screen"] += bool((tarone_holm(given, np.where(lost == 0, 1.0, 0.0), ALPHA) < ALPHA).any())
        failed["tarone, all worse"] += bool((tarone_holm(plain, plain, ALPHA) < ALPHA).any())
    return {name: count / trials for name, count in failed.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| documents | rows | holm | screen | tarone, all worse |\n|---|---|---|---|---|")
    for n in (10, 30, 100, 1000):
        for m in (2, 20):
            r = rates(n, m, args.trials, rng)
            print(f"| {n} | {m} | {r['holm']:.4f} | {r['screen']:.4f} | {r['tarone, all worse']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
