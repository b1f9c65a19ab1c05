"""How many documents the in-run gate (``gate.reference=``) needs to decide, and how often it is wrong, simulated
through the code the run uses (evalkit/run/sequence.py) on one 0/1 row of a 1,000-document task: tolerance 0.02,
alpha 0.05, a look after every chunk of 50 documents (and, for the size, after every document).

Each candidate is a fixed set of 1,000 paired differences (-1: a document the reference got right and the
candidate wrong, +1 the reverse, 0 otherwise) drawn in a fresh random order per run, as the gate draws them:

* ``-5 points``: 50 documents lost, none gained; ``-5 points, churn``: 70 lost, 20 gained.
* ``boundary``: 20 lost (a true change of exactly -tolerance, the largest that must pass); ``boundary, churn``:
  40 lost, 20 gained. A `worse` here is a false one: its rate at every look is the gate's size.
* ``no change``: nothing differs; ``no change, churn``: 15 lost, 15 gained (gate.require=equivalent: documents
  needed to stop `equivalent`).

The fixed-n gate (``evalkit compare`` after the whole run) reads all 1,000 documents in every case.
Printed, not asserted. Run: python -m benchmarks.sequential_gate [--runs 1000] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from evalkit.run.sequence import rules_out_above, rules_out_below, targets_for

TOTAL, TOLERANCE, ALPHA, CHUNK = 1000, 0.02, 0.05, 50
CASES = [("-5 points", 50, 0, "worse"), ("-5 points, churn", 70, 20, "worse"), ("boundary", 20, 0, "worse"),
         ("boundary, churn", 40, 20, "worse"), ("no change", 0, 0, "equivalent"),
         ("no change, churn", 15, 15, "equivalent")]


def orders(lost: int, gained: int, runs: int, rng: np.random.Generator) -> np.ndarray:
    d = np.array([-1.0] * lost + [1.0] * gained + [0.0] * (TOTAL - lost - gained))
    return np.stack([d[rng.permutation(TOTAL)] for _ in range(runs)])


def shown(d: np.ndarray, claim: str) -> np.ndarray:
    """Whether the claim is shown at each document (runs x documents)."""
    below, above = targets_for(TOLERANCE, claim == "equivalent")
    if claim == "worse":
        return rules_out_above(d, TOTAL, -TOLERANCE, ALPHA, above)
    return rules_out_below(d, TOTAL, -TOLERANCE, ALPHA, below) & rules_out_above(d, TOTAL, TOLERANCE, ALPHA, above)


def stopping(claim_at: np.ndarray) -> np.ndarray:
    """Documents evaluated when the gate stops, looking after every CHUNK documents (TOTAL where it never does)."""
    looks = claim_at[:, CHUNK - 1::CHUNK]
    first = np.where(looks.any(axis=1), looks.argmax(axis=1), looks.shape[1] - 1)
    return (first + 1) * CHUNK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"{TOTAL} documents, tolerance {TOLERANCE}, alpha {ALPHA}, looks every {CHUNK}, {args.runs} runs per case")
    print("| case | claim | shown before the end | documents to stop: median | 90th percentile | fixed-n gate |")
    print("|---|---|---|---|---|---|")
    started = time.perf_counter()
    for name, lost, gained, claim in CASES:
        d = orders(lost, gained, args.runs, rng)
        at = shown(d, claim)
        stops = stopping(at)
        decided = at[:, CHUNK - 1:-1:CHUNK].any(axis=1).mean()
        print(f"| {name} | {claim} | {decided:.1%} | {np.median(stops):.0f} ({np.median(stops) / TOTAL:.0%}) "
              f"| {np.percentile(stops, 90):.0f} | {TOTAL} |")
        if name.startswith("boundary"):
            every = np.maximum.accumulate(at[:, :-1], axis=1).mean(axis=0)
            chunks = every[CHUNK - 1::CHUNK]
            print(f"|  | false `worse` by look (every {CHUNK}): {', '.join(f'{x:.3f}' for x in chunks)}; "
                  f"looking after every document, by the last: {every[-1]:.3f} | | | |")
    print(f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
