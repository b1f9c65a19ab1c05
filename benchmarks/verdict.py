"""How often does ``python -m evalkit.compare`` fail a candidate that is no worse, and how often does it catch one
that is? Simulated MMLU-shaped comparisons, the gate's rule before and after Holm-adjusted two one-sided tests.

Each trial: 57 subtasks of 100 documents each and their group (5,700 documents pooled, MMLU's weight_by_size).
In every subtask each document is right in the reference only with probability pb and in the candidate only
with pc (the rest score the same in both runs): the counts b, c are a multinomial draw. Null: pb = pc = 0.05
(5 % of answers flip each way, true difference 0). Power: the candidate loses twice the tolerance on every
subtask (pb = 0.05 + 2 * tolerance, pc = 0.05).

* before: a row is `worse` when its 95 % Tango interval lies below 0 (the rule until this change), and any
  `worse` row fails the run;
* now: evalkit.compare's rule: the exact one-sided p-value of "worse than -tolerance" (evalkit/compare/statistics/tost.py),
  Holm-adjusted over the 58 rows (evalkit/compare/statistics/verdict.py), fails the run when any is below alpha.

The cases of issue 28 (each: the false-fail rate at no change, the power at a change of twice the tolerance):

* ``wikitext60``: MMLU's 57 subtasks (as above, nothing changing) and wikitext's three perplexity rows (62
  documents, or --documents, of 50-400 words, each document's log-likelihood per word spread 10 % around
  log(1/15), the candidate off the reference by --spread per document; perplexity rows are tested from 200
  documents, so at 62 they never fail, and --documents 200 measures the test): 60 rows. Power: word perplexity
  4 % higher. Before, the perplexity rows were bootstrapped with 1,000 resamples: their p-value at least 1/1001,
  times 60 by Holm, never below 0.05 (power 0 by construction); now the sign-flip test of per-document
  log-likelihood changes (evalkit/compare/statistics/ratio.py).
* ``sweep17``: a 17-point sweep of wikitext against one reference point (51 rows). Per point: Holm over each
  point's own 3 rows, as the sweep report did; one family: Holm over all 51, as ``python -m evalkit.compare REF
  P1 ... P17`` and now the sweep report do. Power: one point's word perplexity 4 % higher.
* ``bleu16``: a stratified group of 16 BLEU leaves averaged equally (flores_gl's shape) and its leaves, 17 rows,
  --segments per leaf: each run's hypothesis of a segment is its reference with each word dropped with
  probability q (q0 = 0.1 in the reference, q in the candidate: q0 at no change, the q that lowers BLEU by 4 %
  for power); the group row is evalkit.compare's (evalkit/compare/statistics/metric_rows.py). Also measured: what the group row
  costs at 1,012 segments per leaf, the resampling from summed counts (evalkit/compare/statistics/corpus.py) against
  lm-eval's bleu re-run on every resample (timed on a few resamples, then multiplied out).

Printed, not asserted. Run: python -m benchmarks.verdict [--case mmlu|wikitext60|sweep17|bleu16|all]
[--trials 10000] [--tolerance 0.02] [--seed 0] [--documents 62]
"""

from __future__ import annotations

import argparse
import time
from functools import lru_cache

import numpy as np

from benchmarks.common.verdict_families import WIKITEXT_DOCUMENTS, bleu16, sweep17, wikitext60
from benchmarks.common.verdict_trials import DOCUMENTS, FLIP, SUBTASKS, p_worse, trial_rows
from evalkit.compare.statistics.proportions import tango_interval
from evalkit.compare.statistics.verdict import holm


@lru_cache(maxsize=None)
def old_worse(b: int, c: int, n: int) -> bool:
    return tango_interval(b, c, n, confidence=0.95).high < 0


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


def mmlu(args: argparse.Namespace) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=["mmlu", "wikitext60", "sweep17", "bleu16", "all"], default="all")
    parser.add_argument("--trials", type=int, default=None, help="default: 10,000 (mmlu), 2,000, 100 (bleu16)")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--documents", type=int, default=WIKITEXT_DOCUMENTS,
                        help="wikitext's documents (62, lm-eval's; perplexity rows are tested from 200)")
    parser.add_argument("--spread", type=float, default=0.01, help="per-document log-likelihood spread between runs")
    parser.add_argument("--segments", type=int, default=60, help="bleu16: segments per leaf in the simulation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cases = {"mmlu": (mmlu, 10_000), "wikitext60": (wikitext60, 2_000), "sweep17": (sweep17, 2_000),
             "bleu16": (bleu16, 100)}
    for name, (case, trials) in cases.items():
        if args.case in (name, "all"):
            case(argparse.Namespace(**{**vars(args), "trials": args.trials or trials}))
            print()


if __name__ == "__main__":
    main()
