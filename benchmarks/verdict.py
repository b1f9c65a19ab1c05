"""How often does ``python -m evalkit.compare`` fail a candidate that is no worse, and how often does it catch one
that is? Simulated MMLU-shaped comparisons, the gate's rule before and after Holm-adjusted two one-sided tests.

Each trial: 57 subtasks of 100 documents each and their group (5,700 documents pooled, MMLU's weight_by_size).
In every subtask each document is right in the reference only with probability pb and in the candidate only
with pc (the rest score the same in both runs): the counts b, c are a multinomial draw. Null: pb = pc = 0.05
(5 % of answers flip each way, true difference 0). Power: the candidate loses twice the tolerance on every
subtask (pb = 0.05 + 2 * tolerance, pc = 0.05).

* before: a row is `worse` when its 95 % Tango interval lies below 0 (the rule until this change), and any
  `worse` row fails the run;
* now: evalkit.compare's rule: the exact one-sided p-value of "worse than -tolerance" (evalkit/compare/tost.py),
  Holm-adjusted over the 58 rows (evalkit/compare/verdict.py), fails the run when any is below alpha.

Printed, not asserted. Run: python benchmarks/verdict.py [--trials 10000] [--tolerance 0.02] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from functools import lru_cache

import numpy as np

from evalkit.compare import tost
from evalkit.compare.stats import tango_interval
from evalkit.compare.verdict import holm

SUBTASKS, DOCUMENTS, FLIP = 57, 100, 0.05


@lru_cache(maxsize=None)
def old_worse(b: int, c: int, n: int) -> bool:
    return tango_interval(b, c, n, confidence=0.95).high < 0


def p_worse(b: int, c: int, n: int, tolerance: float) -> float:
    return tost.tango_p(b, c, n, -tolerance, "below")


def trial_rows(rng: np.random.Generator, pb: float, pc: float) -> list[tuple[int, int, int]]:
    """(b, c, n) of the 57 subtasks, then of the group pooling them."""
    counts = rng.multinomial(DOCUMENTS, [pb, pc, 1 - pb - pc], size=SUBTASKS)[:, :2]
    rows = [(int(b), int(c), DOCUMENTS) for b, c in counts]
    return rows + [(int(counts[:, 0].sum()), int(counts[:, 1].sum()), SUBTASKS * DOCUMENTS)]


def fail_rates(pb: float, pc: float, *, trials: int, tolerance: float, alpha: float, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    old = new = subtask_only = 0
    for _ in range(trials):
        rows = trial_rows(rng, pb, pc)
        old += any(old_worse(*row) for row in rows)
        rejected = holm(np.array([p_worse(*row, tolerance) for row in rows])) < alpha
        new += bool(rejected.any())
        subtask_only += bool(rejected[:-1].any())
    return {"before": old / trials, "now": new / trials, "now, subtask rows": subtask_only / trials}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = dict(trials=args.trials, tolerance=args.tolerance, alpha=args.alpha)
    start = time.perf_counter()
    null = fail_rates(FLIP, FLIP, seed=args.seed, **settings)
    drop = fail_rates(FLIP + 2 * args.tolerance, FLIP, seed=args.seed + 1, **settings)
    print(f"{SUBTASKS} subtasks x {DOCUMENTS} documents + their group, {args.trials} trials, tolerance "
          f"±{args.tolerance}, alpha {args.alpha}")
    print("| | before: any 95 % interval below 0 | now: Holm-adjusted one-sided tests | now, from subtask rows |")
    print("|---|---|---|---|")
    print(f"| false-fail rate (true difference 0, {FLIP:.0%} of answers flipping each way) | {null['before']:.4f} | "
          f"{null['now']:.4f} | {null['now, subtask rows']:.4f} |")
    print(f"| power (true drop {2 * args.tolerance:g} on every subtask) | {drop['before']:.4f} | {drop['now']:.4f} | "
          f"{drop['now, subtask rows']:.4f} |")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
