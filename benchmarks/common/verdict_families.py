"""The families of benchmarks.verdict beside MMLU: a perplexity row among 60 rows, a 17-point sweep of wikitext,
a stratified group of 16 BLEU leaves. Each runs evalkit.compare's own statistics (evalkit/compare/statistics/stats.py,
metric_rows.py) on simulated per-document values and Holm over the family (verdict.holm). Run them through
``python -m benchmarks.verdict``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
from lm_eval.api.registry import get_aggregation

from benchmarks.common.verdict_trials import FLIP, p_worse, trial_rows
from evalkit.compare.statistics import corpus, metric_rows
from evalkit.compare.statistics.stats import compare_paired
from evalkit.compare.statistics.verdict import Tolerances, holm

WIKITEXT_DOCUMENTS = 62  # wikitext-2's test documents, as lm-eval's wikitext task scores them (--documents)
ROWS = {"word_perplexity": ("weighted_perplexity", 1), "byte_perplexity": ("weighted_perplexity", 5),
        "bits_per_byte": ("bits_per_byte", 5)}  # metric -> (aggregation, units per word)


def wikitext_reference(rng: np.random.Generator, documents: int = WIKITEXT_DOCUMENTS
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(words, log-likelihood per word) of each document of the reference run. Perplexity rows of fewer than 200
    documents (wikitext's 62) are untested (inconclusive): --documents 200 or more measures the test itself."""
    words = rng.integers(50, 400, size=documents).astype(float)
    return words, -math.log(15.0) * (1 + rng.normal(0.0, 0.1, size=documents))


def wikitext_p_worse(rng: np.random.Generator, reference: tuple[np.ndarray, np.ndarray], ratio: float, *,
                     spread: float, tolerance: float, family: int) -> list[float]:
    """p_worse of wikitext's three rows for a candidate whose perplexity is `ratio` times the reference's."""
    words, per_word = reference
    candidate = per_word * (1 + rng.normal(0.0, spread, size=len(words))) - math.log(ratio)
    out = []
    for name, units in ROWS.values():
        ref, cand = (list(zip(ll * words, units * words)) for ll in (per_word, candidate))
        row = compare_paired(ref, cand, aggregate=get_aggregation(name), aggregate_name=name, by_mean=False,
                             higher_is_better=False, tolerance=tolerance, relative=True, analytic=True, family=family)
        out.append(row.p_worse)
    return out


def table(title: str, columns: list[str], null: list[float], power: list[float], change: str) -> None:
    print(title)
    print("| | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    print("| false-fail rate (no change) | " + " | ".join(f"{v:.4f}" for v in null) + " |")
    print(f"| power ({change}) | " + " | ".join(f"{v:.4f}" for v in power) + " |")


def wikitext60(args: argparse.Namespace) -> None:
    rng, start = np.random.default_rng(args.seed), time.perf_counter()
    rates = {}
    for ratio in (1.0, 1 + 2 * args.tolerance):
        fails = 0
        for _ in range(args.trials):
            subtasks = [p_worse(*row, args.tolerance) for row in trial_rows(rng, FLIP, FLIP)[:-1]]
            wikitext = wikitext_p_worse(rng, wikitext_reference(rng, args.documents), ratio, spread=args.spread,
                                        tolerance=args.tolerance, family=60)
            fails += bool((holm(np.array(subtasks + wikitext)) < args.alpha).any())
        rates[ratio] = fails / args.trials
    floor = 60 / 1001
    table(f"57 subtasks x 100 documents (5 % flipping each way) + wikitext's 3 rows ({args.documents} documents, "
          f"spread {args.spread:g}): 60 rows, {args.trials} trials, tolerance ±{args.tolerance} (relative for "
          "perplexity)",
          ["before: 1,000-resample bootstrap", "now: delta method"],
          [0.0, rates[1.0]], [0.0, rates[1 + 2 * args.tolerance]],
          f"word perplexity {2 * args.tolerance:.0%} higher")
    print(f"(before: the perplexity rows' Holm-adjusted p-value is at least 60/1001 = {floor:.3f} > "
          f"{args.alpha}: never worse; {time.perf_counter() - start:.0f} s)")


def sweep17(args: argparse.Namespace) -> None:
    """No change; every point exactly at the tolerance (the largest rise that must pass: where per-point families
    multiply the false-fail rate); one point at twice the tolerance."""
    rng, start, points, edge = np.random.default_rng(args.seed), time.perf_counter(), 17, 1 + args.tolerance
    rates = {}
    for case in ("none", "edge", "one"):
        per_point = family = 0
        for _ in range(args.trials):
            reference = wikitext_reference(rng, args.documents)
            ratios = {"none": [1.0] * points, "edge": [edge] * points,
                      "one": [1 + 2 * args.tolerance] + [1.0] * (points - 1)}[case]
            p = np.array([wikitext_p_worse(rng, reference, ratio, spread=args.spread, tolerance=args.tolerance,
                                           family=3 * points) for ratio in ratios])
            per_point += bool(any((holm(row) < args.alpha).any() for row in p))
            family += bool((holm(p.ravel()) < args.alpha).any())
        rates[case] = (per_point / args.trials, family / args.trials)
    table(f"17 sweep points of wikitext against one reference ({args.documents} documents, spread {args.spread:g}): "
          f"51 rows, "
          f"{args.trials} trials, tolerance ±{args.tolerance} relative",
          ["before: Holm within each point (the sweep report)", "now: one family (compare REF P1 ... P17)"],
          list(rates["none"]), list(rates["one"]), f"one point's word perplexity {2 * args.tolerance:.0%} higher")
    print(f"| false-fail rate (every point's perplexity exactly {args.tolerance:.0%} higher: the largest rise that "
          f"must pass) | " + " | ".join(f"{v:.4f}" for v in rates["edge"]) + " |")
    print(f"({time.perf_counter() - start:.0f} s)")


VOCABULARY = [f"w{i}" for i in range(300)]


def segments(rng: np.random.Generator, count: int) -> list[str]:
    return [" ".join(rng.choice(VOCABULARY, size=rng.integers(15, 30))) for _ in range(count)]


def hypotheses(rng: np.random.Generator, references: list[str], drop: float) -> list[str]:
    """Each reference with each word dropped with probability `drop` (one word kept at least)."""
    out = []
    for ref in references:
        words = ref.split()
        kept = [w for w in words if rng.random() >= drop]
        out.append(" ".join(kept or words[:1]))
    return out


def expected_bleu(drop: float, *, count: int = 4000, seed: int = 99) -> float:
    rng = np.random.default_rng(seed)
    refs = segments(rng, count)
    items = list(zip(refs, hypotheses(rng, refs, drop)))
    fast = corpus.additive(get_aggregation("bleu"), items)
    return float(corpus.bleu_scores(fast[0].sum(axis=0))[0])


def drop_for(target: float, low: float = 0.1, high: float = 0.6) -> float:
    """The drop probability whose BLEU is target (bisection; BLEU falls as more words drop)."""
    for _ in range(25):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_bleu(middle) > target else (low, middle)
    return (low + high) / 2


def bleu_rows(rng: np.random.Generator, drops: tuple[float, float], args: argparse.Namespace, *, leaves: int = 16,
              seed: int = 0) -> list[float]:
    """p_worse of the 16 leaves and of their group, as evalkit.compare computes them (family 17)."""
    tasks = [f"flores_{k}" for k in range(leaves)]
    results = {"configs": {t: {"metric_list": [{"metric": "bleu", "aggregation": "bleu"}]} for t in tasks}}
    pairs = []
    for _ in tasks:
        refs = segments(rng, args.segments)
        pairs.append(tuple([(r, h) for r, h in zip(refs, hypotheses(rng, refs, d))] for d in drops))
    settings = dict(confidence=1 - args.alpha, iterations=1_000, seed=seed, family=leaves + 1)
    tolerances = Tolerances(absolute=args.tolerance, relative=args.tolerance)
    rows = [metric_rows.compare_values(results, t, "bleu", *pair, higher_is_better=True, tolerances=tolerances,
                                   settings=settings)["p_worse"] for t, pair in zip(tasks, pairs)]
    group = metric_rows.stratified_row(results, "flores", tasks, "bleu", pairs, [1] * leaves, tolerances=tolerances,
                                   higher_is_better=True, settings=settings)
    return rows + [group["p_worse"]]


def bleu_cost(drop: float, args: argparse.Namespace, *, leaves: int = 16, documents: int = 1012) -> None:
    """What the group row costs at flores' 1,012 segments per leaf: measured with summed counts; lm-eval's bleu
    re-run on every resample timed on 3 resamples of one leaf and multiplied out."""
    rng = np.random.default_rng(args.seed)
    tasks = [f"flores_{k}" for k in range(leaves)]
    results = {"configs": {t: {"metric_list": [{"metric": "bleu", "aggregation": "bleu"}]} for t in tasks}}
    pairs = []
    for _ in tasks:
        refs = segments(rng, documents)
        pairs.append(tuple([(r, h) for r, h in zip(refs, hypotheses(rng, refs, drop))] for _ in range(2)))
    settings = dict(confidence=1 - args.alpha, iterations=10_000, seed=0, family=leaves + 1)
    start = time.perf_counter()
    metric_rows.stratified_row(results, "flores", tasks, "bleu", pairs, [1] * leaves, tolerances=Tolerances(),
                           higher_is_better=True, settings=settings)
    fast = time.perf_counter() - start
    bleu = get_aggregation("bleu")
    start = time.perf_counter()
    for row in np.random.default_rng(0).integers(0, documents, size=(3, documents)):
        bleu([pairs[0][0][i] for i in row])
    per_call = (time.perf_counter() - start) / 3
    print(f"cost of one group row of {leaves} BLEU leaves x {documents} segments: {fast:.1f} s measured "
          f"(10,000 resamples from summed counts); lm-eval's bleu re-run per resample: {per_call:.3f} s a call, "
          f"so {2 * leaves * per_call * 1000 / 60:.0f} min at 1,000 resamples (the corpus bound), "
          f"{2 * leaves * per_call * 10_000 / 3600:.1f} h at --iterations 10,000 (before)")


def bleu16(args: argparse.Namespace) -> None:
    start, base = time.perf_counter(), 0.1
    worse = drop_for(expected_bleu(base) * (1 - 2 * args.tolerance))
    rates = []
    for k, drops in enumerate(((base, base), (base, worse))):
        rng = np.random.default_rng(args.seed + k)
        rates.append(np.mean([(holm(np.array(bleu_rows(rng, drops, args, seed=t))) < args.alpha).any()
                              for t in range(args.trials)]))
    table(f"a group of 16 BLEU leaves averaged equally (flores_gl's shape) and its leaves: 17 rows, {args.segments} "
          f"segments per leaf, {args.trials} trials, tolerance ±{args.tolerance} relative; words dropped with "
          f"probability {base} (reference), {worse:.3f} for BLEU {2 * args.tolerance:.0%} lower",
          ["now: stratified bootstrap, relative, resamples from summed counts"], [rates[0]], [rates[1]],
          f"BLEU {2 * args.tolerance:.0%} lower on every leaf")
    print(f"({time.perf_counter() - start:.0f} s)")
    bleu_cost(base, args)
