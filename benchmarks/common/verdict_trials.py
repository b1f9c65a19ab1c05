"""One simulated MMLU-shaped comparison (benchmarks.verdict): 57 subtasks of 100 documents and their group, the
documents that flip each way drawn at random, and the p-value of "worse than -tolerance" that evalkit.compare
gives each row (evalkit/compare/statistics/tost.py)."""

from __future__ import annotations

import numpy as np

from evalkit.compare.statistics import tost

SUBTASKS, DOCUMENTS, FLIP = 57, 100, 0.05


def p_worse(b: int, c: int, n: int, tolerance: float) -> float:
    return tost.tango_p(b, c, n, -tolerance, "below")


def trial_rows(rng: np.random.Generator, pb: float, pc: float) -> list[tuple[int, int, int]]:
    """(b, c, n) of the 57 subtasks, then of the group pooling them."""
    counts = rng.multinomial(DOCUMENTS, [pb, pc, 1 - pb - pc], size=SUBTASKS)[:, :2]
    rows = [(int(b), int(c), DOCUMENTS) for b, c in counts]
    return rows + [(int(counts[:, 0].sum()), int(counts[:, 1].sum()), SUBTASKS * DOCUMENTS)]
