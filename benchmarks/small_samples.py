"""Does every method of ``python -m evalkit.compare`` keep its promise at every number of documents? The size (how
often a row is called `worse` when its true change is exactly -tolerance, the largest change that must pass) and
the power (how often when it is twice that) of one row, and how often an `equivalent` claim is false, simulated
through the code the command runs (evalkit/compare/statistics/stats.py's compare_paired, metric_rows.py's
stratified_reading) at n = 2, 3, 5, 10, 30, 100, 1,000 documents (a group: over all its leaves).

Methods and the documents each is given (tolerance 0.02, alpha 0.05, one row):

* ``tango`` (0/1 metrics): each document lost with probability tolerance (power: twice it), none gained.
* ``sign-flip`` (means of unbounded values): differences Normal(-tolerance, 0.05) (power: mean -2 tolerance);
  and ``sign-flip, skewed``: differences -tolerance + 0.05 (Exp(1) - 1), asymmetric about their mean, which the
  test's pseudo-document (evalkit/compare/statistics/means.py) is there for.
* ``betting`` (means of values in [0, 1], per-document F1 in [0.9, 1]): a document drops to 0 with probability
  tolerance / 0.95 (a true change of -tolerance), the rest move by Uniform(-0.005, 0.005) (power: twice the
  drops); `equivalent` when wrong: 10 % of documents drop to 0 (a true change of -0.095).
* ``bootstrap (percentile, for contrast)``: the paired percentile bootstrap of the mean, read at every size: as
  sign-flip, and for `equivalent` as betting. It is why bootstrap rows are read from 30 documents on.
* ``sign-flip word_perplexity`` (lm-eval's perplexity family, relative): per-document (log-likelihood, words),
  the candidate's log-likelihood per word off by the log of 1.02 (a 2 % rise in perplexity) plus
  Normal(0, 0.01) noise; power: 4 %.
* ``bootstrap bleu`` (corpus BLEU, relative, resampled from summed n-gram counts): documents drawn from 300
  segments of 8-20 words, the reference's hypothesis each reference with a fifth of its words replaced; the
  candidate's, on a share q of documents, with half replaced instead, q such that the corpus BLEU of the whole
  pool falls by exactly 2 % (power: 4 %).
* ``sign-flip word_perplexity, absolute``: the same documents, an absolute row whose tolerance is 0.3 (2 % of
  the perplexity of 15), read on the relative scale over the reference's score.
* ``sign-flip stratified word_perplexity`` (a group of perplexity leaves, relative): two leaves of a third and two
  thirds of the documents, perplexities 15 and 40, averaged equally, each 2 % higher (power: 4 %).
* ``sign-flip stratified`` (a group of mean leaves, evalkit/compare/statistics/metric_rows.py's mean_sums): two
  leaves of n / 2 documents averaged equally, differences as sign-flip in both; and ``sign-flip stratified, 3
  unequal leaves, skewed``: leaves of a sixth, a third and a half of the documents averaged equally (a document
  of the smallest weighs three times one of the largest), differences as sign-flip, skewed.
* ``bootstrap stratified bleu`` (a group of corpus leaves, relative): two BLEU leaves of a third and two thirds of
  the documents, averaged equally, drawn as bootstrap bleu; read from 30 documents in its smallest leaf on.

``--shapes`` measures instead the shapes LLM changes take, each at the bound of a relative tolerance of 2 % (the
default for values outside [-1, 1]; values about 2.5, so a change of -0.05), through compare_paired:

* ``zero-inflated``: 5 % of documents drop by 5 (a true change of -10 %): how often `equivalent`; and at the
  bound, 2 % of documents drop by 2.5 (`worse`);
* ``skewed, rare gain``: 98 % of documents at -0.153 and 2 % at +5 (a true change of -2 %): `worse`;
* ``heavy-tailed``: -0.05 + 0.05 (Lomax(2.5) - 2 / 3), a long right tail (rare large gains) whose variance is
  finite but not its third moment: `worse`; and, for contrast, beyond what any such test can promise, Lomax(1.5)
  (mean 2), whose variance is infinite;
* ``noisy reference``: truthfulqa's bleu_diff shape, per-document reference values -8 + Normal(0, 20), the
  differences -0.16 + Normal(0, 0.05), independent of them (a true change of -2 %): `worse`;
* ``% tolerance on 0/1``: a 0/1 metric (0.8 right in the reference) with --tolerance-for t/acc=2%, each right
  document lost with probability 0.02 (a true change of -2 %): `worse` and `equivalent`; and lost with
  probability 0.10: `equivalent`.

and the perplexity family's rows on zero-inflated and skewed changes of the documents' log-likelihoods (a word
perplexity row, relative, lower is better: documents of 50-400 words at a perplexity about 15, each document's
log-likelihood per word changed by the amount given), through compare_paired:

* ``word_perplexity, zero-inflated``: 5 % of documents fall by log(1.1) / 0.05 per word (a true 10 % rise),
  every document moving by Normal(0, 0.002) too: `equivalent`; and at the bound, 2 % of documents fall by
  log(1.02) / 0.02 per word, the rest unchanged: `worse`;
* ``word_perplexity, skewed, rare gain``: 98 % of documents a little less likely and 2 % far more (0.4 per
  word), a true rise of exactly 2 % (the bound): `worse`; ``rare loss``: 98 % of documents a little less likely
  (0.012 per word) and 2 % far less (0.4), the same rise: `equivalent` at the bound;
* ``word_perplexity, heavy-tailed``: -log(1.02) + 0.01 (Lomax(2.5) - 2 / 3) per word, rare large gains: `worse`
  at the bound; and its mirror, rare large falls: `equivalent` at the bound.

and a judge's score declared to lie in [1, 10] (``--range-for t/score=1:10``: betting at every size),
relative: ``betting, declared range 1-10, rare gain``, scores of 5, 98 % of documents a little lower and 2 %
4.5 higher, a true change of exactly -2 % (the bound): `worse`; ``zero-inflated``, scores about 8, 5 % of
documents dropping to 1 (a true change of about -4.4 %): `equivalent`; and 20 % of them (about -17.5 %): power.

``--bleu-leaves`` measures instead the size of BLEU groups whose smallest leaf has 30 documents (leaves of 30
and 60, 30 and 30, four of 30).

Printed, not asserted. Run: python -m benchmarks.small_samples [--trials 1000] [--seed 0] [--sizes 2,3,5,...]
[--only NAMES] [--bleu-leaves] [--shapes [--shape PREFIX]]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from evalkit.compare.statistics import stats

TOL, ALPHA = 0.02, 0.05


def row(ref, cand, *, by_mean=True, aggregate=None, name="mean", hib=True, relative=False, analytic=False,
        tolerance=TOL, bounds=None):
    from lm_eval.api.registry import get_aggregation

    aggregate = aggregate or get_aggregation(name)
    return stats.compare_paired(list(ref), list(cand), aggregate=aggregate, aggregate_name=name, by_mean=by_mean,
                                higher_is_better=hib, tolerance=tolerance, relative=relative, iterations=2_000,
                                analytic=analytic, bounds=bounds)


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


def ll_pairs(rng, n, rise, base=15.0):
    """Per-document (log-likelihood, words) in both runs: a perplexity of base, the candidate's rise times higher
    give or take Normal(0, 0.01) per word."""
    words = rng.integers(50, 400, n).astype(float)
    per_word = np.log(1 / base) * (1 + 0.1 * rng.normal(size=n))
    ref = [(float(w * p), float(w)) for w, p in zip(words, per_word)]
    cand = [(float(w * (p - math.log1p(rise) + 0.01 * rng.normal())), float(w)) for w, p in zip(words, per_word)]
    return ref, cand


def perplexity(rng, n, rise):
    return row(*ll_pairs(rng, n, rise), by_mean=False, name="weighted_perplexity", hib=False, relative=True,
               analytic=True)


def perplexity_absolute(rng, n, rise):
    """An absolute word-perplexity row, its tolerance 15 tolerance (the same 2 % of a perplexity of 15)."""
    return row(*ll_pairs(rng, n, rise), by_mean=False, name="weighted_perplexity", hib=False, relative=False,
               analytic=True, tolerance=15 * TOL)


class Segments:
    """The pool of segments the BLEU rows draw documents from, and the share of degraded documents that lowers
    the pool's corpus BLEU by a given fraction (corpus BLEU of summed counts: any corpus with the pool's mean
    counts scores the same)."""

    WORDS = "the a cat dog sat on mat river runs to sea birds sing in morning she reads book rain falls over hill"

    def __init__(self, seed: int = 0, size: int = 300):
        from evalkit.compare.statistics import corpus

        rng, words = np.random.default_rng(seed), self.WORDS.split()
        self.refs = [" ".join(rng.choice(words, size=rng.integers(8, 20))) for _ in range(size)]
        noisy = lambda r, p: " ".join(w if rng.random() > p else str(rng.choice(words)) for w in r.split())  # noqa
        self.good, self.bad = [noisy(r, 0.2) for r in self.refs], [noisy(r, 0.5) for r in self.refs]
        self.counts = [corpus._bleu_counts(list(zip(self.refs, h))).mean(axis=0) for h in (self.good, self.bad)]
        self.score = corpus.bleu_scores

    def share(self, fall: float) -> float:
        from scipy.optimize import brentq

        base = float(self.score(self.counts[0])[0])
        return brentq(lambda q: float(self.score((1 - q) * self.counts[0] + q * self.counts[1])[0]) / base - 1 + fall,
                      0.0, 1.0, xtol=1e-10)


SEGMENTS: list[Segments] = []


def bleu_documents(rng, n, fall):
    if not SEGMENTS:
        SEGMENTS.append(Segments())
    pool = SEGMENTS[0]
    docs, worse_docs = rng.integers(0, len(pool.refs), n), rng.random(n) < pool.share(fall)
    ref = [(pool.refs[i], pool.good[i]) for i in docs]
    cand = [(pool.refs[i], pool.bad[i] if d else pool.good[i]) for i, d in zip(docs, worse_docs)]
    return ref, cand


def bleu(rng, n, fall):
    return row(*bleu_documents(rng, n, fall), by_mean=False, name="bleu", relative=True)


def group(rng, pairs, metric, *, relative, hib=True, weights=None, tolerance=TOL):
    """A group of the leaves pairs averaged equally (weight_by_size: false), through metric_rows.stratified_reading
    with lm-eval's default aggregation of metric in each leaf."""
    from evalkit.compare.statistics import metric_rows
    from evalkit.compare.statistics.verdict import Tolerance

    names = [f"leaf{k}" for k in range(len(pairs))]
    aggregate = metric_rows.aggregation({}, names[0], metric)[1]
    each = [[float(aggregate(list(side))) for side in pair] for pair in pairs]
    w = np.full(len(pairs), 1 / len(pairs)) if weights is None else np.asarray(weights) / np.sum(weights)
    scores = (float(w @ [e[0] for e in each]), float(w @ [e[1] for e in each]))
    settings = {"confidence": 1 - ALPHA, "iterations": 2_000, "seed": int(rng.integers(1 << 30))}
    _, p, _, _, _ = metric_rows.stratified_reading({}, names, metric, pairs, w, scores, each, settings=settings,
                                                   tolerance=Tolerance(tolerance, relative=relative),
                                                   higher_is_better=hib)
    return type("Row", (), p)


def split(n, shares):
    """n documents in leaves of the given shares, at least one each."""
    sizes = [max(1, int(n * s)) for s in shares[:-1]]
    return sizes + [max(1, n - sum(sizes))]


def stratified(rng, n, mean):
    pairs = []
    for size in split(n, [0.5, 0.5]):
        ref = rng.uniform(2.0, 3.0, size)
        pairs.append((ref.tolist(), (ref + rng.normal(mean, 0.05, size)).tolist()))
    return group(rng, pairs, "acc", relative=False)


def stratified_skewed(rng, n, mean):
    """Three leaves of a sixth, a third and a half of the documents, averaged equally, skewed differences."""
    pairs = []
    for size in split(n, [1 / 6, 1 / 3, 1 / 2]):
        ref = rng.uniform(2.0, 3.0, size)
        pairs.append((ref.tolist(), (ref + mean + 0.05 * (rng.exponential(1.0, size) - 1.0)).tolist()))
    return group(rng, pairs, "acc", relative=False)


def perplexity_group(rng, n, rise):
    """Two leaves of a third and two thirds of the documents, perplexities 15 and 40, averaged equally."""
    pairs = [ll_pairs(rng, size, rise, base) for size, base in zip(split(n, [1 / 3, 2 / 3]), (15.0, 40.0))]
    return group(rng, pairs, "word_perplexity", relative=True, hib=False)


def bleu_group(rng, n, fall):
    """Two BLEU leaves of a third and two thirds of the documents, averaged equally."""
    pairs = []
    for size in split(n, [1 / 3, 2 / 3]):
        ref, cand = bleu_documents(rng, size, fall)
        pairs.append((ref, cand))
    return group(rng, pairs, "bleu", relative=True)


CASES = [  # name, make, claim, value at the boundary (size), value for power
    ("tango", tango, worse, TOL, 2 * TOL),
    ("sign-flip", normal, worse, -TOL, -2 * TOL),
    ("sign-flip, skewed", skewed, worse, -TOL, -2 * TOL),
    ("betting", betting, worse, TOL / 0.95, 2 * TOL / 0.95),
    ("bootstrap (percentile, for contrast)", bootstrap, worse, -TOL, -2 * TOL),
    ("sign-flip word_perplexity", perplexity, worse, TOL, 2 * TOL),
    ("bootstrap bleu", bleu, worse, TOL, 2 * TOL),
    ("sign-flip word_perplexity, absolute", perplexity_absolute, worse, TOL, 2 * TOL),
    ("sign-flip stratified word_perplexity", perplexity_group, worse, TOL, 2 * TOL),
    ("sign-flip stratified", stratified, worse, -TOL, -2 * TOL),
    ("sign-flip stratified, 3 unequal leaves, skewed", stratified_skewed, worse, -TOL, -2 * TOL),
    ("bootstrap stratified bleu", bleu_group, worse, TOL, 2 * TOL),
]
LEAVES = [("1/3, 2/3", [1 / 3, 2 / 3], 90), ("1/2, 1/2", [0.5, 0.5], 60), ("4 x 1/4", [0.25] * 4, 120)]


def bleu_leaves(trials: int, rng) -> None:
    """--bleu-leaves: the size of BLEU groups whose smallest leaf has 30 documents, the fewest read."""
    for label, shares, n in LEAVES:
        def make(rng, n, fall, shares=shares):
            return group(rng, [bleu_documents(rng, size, fall) for size in split(n, shares)], "bleu", relative=True)

        r = rate(make, worse, TOL, n, trials, rng)
        print(f"{label} n={n} leaves {split(n, shares)}: size {r:.3f} ({trials} rows, se "
              f"{math.sqrt(r * (1 - r) / trials + 1e-12):.3f})", flush=True)


def zero_inflated(rng, n, drop, size=5.0):
    """A share drop / size of documents drop by size (values about 2.5), the rest unchanged: relative."""
    ref = rng.uniform(2.0, 3.0, n)
    return row(ref, ref - np.where(rng.random(n) < drop / size, size, 0.0), relative=True)


def rare_gain(rng, n, mean):
    """98 % of documents move by x and 2 % gain 5, x such that the mean change is mean (values 2.5): relative."""
    ref = np.full(n, 2.5)
    return row(ref, ref + np.where(rng.random(n) < 0.02, 5.0, (mean - 0.1) / 0.98), relative=True)


def heavy_tailed(rng, n, mean, shape=2.5):
    """mean + 0.05 (Lomax(shape) - its mean): a long right tail, values about 2.5: relative."""
    ref = rng.uniform(2.0, 3.0, n)
    return row(ref, ref + mean + 0.05 * (rng.pareto(shape, n) - 1.0 / (shape - 1.0)), relative=True)


def infinite_variance(rng, n, mean):
    return heavy_tailed(rng, n, mean, shape=1.5)


def noisy_reference(rng, n, change):
    """truthfulqa's bleu_diff: reference values -8 + Normal(0, 20), differences 8 change + Normal(0, 0.05)."""
    ref = -8.0 + rng.normal(0.0, 20.0, n)
    return row(ref, ref + 8.0 * change + rng.normal(0.0, 0.05, n), relative=True)


def percent_on_binary(rng, n, loss):
    """0/1 values, 0.8 right in the reference (one at least), each right one lost with probability loss."""
    ref = (rng.random(n) < 0.8).astype(float)
    ref[0] = 1.0
    return row(ref, np.where(rng.random(n) < loss, 0.0, ref), relative=True)


def perplexity_shape(rng, n, per_word_change):
    """A word-perplexity row (relative, lower is better) of n documents, each document's log-likelihood per word
    changed by per_word_change (an array of n)."""
    words = rng.integers(50, 400, n).astype(float)
    per_word = np.log(1 / 15.0) * (1 + 0.1 * rng.normal(size=n))
    ref = [(float(w * p), float(w)) for w, p in zip(words, per_word)]
    cand = [(float(w * (p + c)), float(w)) for w, p, c in zip(words, per_word, per_word_change)]
    return row(ref, cand, by_mean=False, name="weighted_perplexity", hib=False, relative=True, analytic=True)


def perplexity_zero_inflated(rng, n, rise, share=0.05, noise=0.002):
    """A share of documents fall by log(1 + rise) / share per word, every document moving by Normal(0, noise)."""
    fall = np.where(rng.random(n) < share, -math.log1p(rise) / share, 0.0)
    return perplexity_shape(rng, n, fall + (rng.normal(0.0, noise, n) if noise else 0.0))


def perplexity_sparse_bound(rng, n, rise):
    return perplexity_zero_inflated(rng, n, rise, share=0.02, noise=0.0)


def perplexity_rare(rng, n, rise, gain=0.4):
    """2 % of documents move by gain per word (a gain: more likely), the rest by x, x such that the rise is rise."""
    rest = (math.log1p(rise) + 0.02 * gain) / 0.98
    return perplexity_shape(rng, n, np.where(rng.random(n) < 0.02, gain, -rest))


def perplexity_rare_loss(rng, n, rise):
    return perplexity_rare(rng, n, rise, gain=-0.4)


def perplexity_heavy(rng, n, rise, sign=1.0, shape=2.5):
    """-log(1 + rise) + sign 0.01 (Lomax(shape) - its mean) per word: rare large gains (sign 1) or falls (-1)."""
    return perplexity_shape(rng, n, -math.log1p(rise) + sign * 0.01 * (rng.pareto(shape, n) - 1.0 / (shape - 1.0)))


def perplexity_heavy_loss(rng, n, rise):
    return perplexity_heavy(rng, n, rise, sign=-1.0)


def judge_rare_gain(rng, n, change):
    """A judge's score in [1, 10], declared so (--range-for), at 5: 98 % of documents lower by x and 2 % higher by
    4.5, x such that the relative change is change: relative."""
    fall = (-change * 5.0 + 0.02 * 4.5) / 0.98
    ref = np.full(n, 5.0)
    return row(ref, ref + np.where(rng.random(n) < 0.02, 4.5, -fall), relative=True, bounds=(1.0, 10.0))


def judge_drops(rng, n, share):
    """A judge's score about 8 in [1, 10], declared so: a share of documents drop to 1, the rest move by
    Uniform(-0.05, 0.05): relative."""
    ref = rng.uniform(7.5, 8.5, n)
    cand = np.where(rng.random(n) < share, 1.0, ref + rng.uniform(-0.05, 0.05, n))
    return row(ref, cand, relative=True, bounds=(1.0, 10.0))


SHAPES = [  # name, make, claim, its label, value
    ("sign-flip, zero-inflated", zero_inflated, equivalent, "`equivalent` at -10 %", 0.25),
    ("sign-flip, zero-inflated", zero_inflated, worse, "`worse` at the bound", 0.05),
    ("sign-flip, skewed, rare gain", rare_gain, worse, "`worse` at the bound", -0.05),
    ("sign-flip, heavy-tailed", heavy_tailed, worse, "`worse` at the bound", -0.05),
    ("sign-flip, infinite variance (for contrast)", infinite_variance, worse, "`worse` at the bound", -0.05),
    ("sign-flip, noisy reference", noisy_reference, worse, "`worse` at the bound", -TOL),
    ("sign-flip, noisy reference", noisy_reference, worse, "power: `worse` at -4 %", -2 * TOL),
    ("betting, % tolerance on 0/1", percent_on_binary, worse, "`worse` at the bound", TOL),
    ("betting, % tolerance on 0/1", percent_on_binary, equivalent, "`equivalent` at the bound", TOL),
    ("betting, % tolerance on 0/1", percent_on_binary, equivalent, "`equivalent` at -10 %", 0.10),
    ("betting, % tolerance on 0/1", percent_on_binary, worse, "power: `worse` at -10 %", 0.10),
    ("sign-flip word_perplexity, zero-inflated", perplexity_zero_inflated, equivalent, "`equivalent` at +10 %", 0.10),
    ("sign-flip word_perplexity, zero-inflated", perplexity_sparse_bound, worse, "`worse` at the bound", TOL),
    ("sign-flip word_perplexity, skewed, rare gain", perplexity_rare, worse, "`worse` at the bound", TOL),
    ("sign-flip word_perplexity, skewed, rare loss", perplexity_rare_loss, equivalent, "`equivalent` at the bound",
     TOL),
    ("sign-flip word_perplexity, heavy-tailed", perplexity_heavy, worse, "`worse` at the bound", TOL),
    ("sign-flip word_perplexity, heavy-tailed", perplexity_heavy_loss, equivalent, "`equivalent` at the bound", TOL),
    ("sign-flip word_perplexity, zero-inflated", perplexity_zero_inflated, worse, "power: `worse` at +10 %", 0.10),
    ("betting, declared range 1-10, rare gain", judge_rare_gain, worse, "`worse` at the bound", -TOL),
    ("betting, declared range 1-10, zero-inflated", judge_drops, equivalent, "`equivalent` at -4.4 %", 0.05),
    ("betting, declared range 1-10, zero-inflated", judge_drops, worse, "power: `worse` at -17.5 %", 0.2),
]


def shapes(trials: int, sizes: list[int], rng, prefix: str = "") -> None:
    """--shapes: the level on the shapes LLM changes take (the module's docstring); prefix: only those named so."""
    print("| shape | claim | " + " | ".join(f"n={n}" for n in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for name, make, claim, label, value in SHAPES:
        if not name.startswith(prefix):
            continue
        cells = [f"{rate(make, claim, value, n, trials, rng):.3f}" for n in sizes]
        print(f"| {name} | {label} | " + " | ".join(cells) + " |", flush=True)


EQUIVALENCE = [("betting", betting, 0.10), ("bootstrap (percentile, for contrast)", bootstrap_drop, 0.10)]


def rate(make, claim, value, n, trials, rng) -> float:
    return sum(claim(make(rng, n, value)) for _ in range(trials)) / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="2,3,5,10,30,100,1000")
    parser.add_argument("--only", default="", help="method names to run, separated by ';' (default: all)")
    parser.add_argument("--bleu-leaves", action="store_true", help="only the BLEU groups of 30-document leaves")
    parser.add_argument("--shapes", action="store_true", help="only the shapes LLM changes take, relative rows")
    parser.add_argument("--shape", default="", help="with --shapes: only the shapes whose name starts so")
    args = parser.parse_args()
    if args.bleu_leaves:
        return bleu_leaves(args.trials, np.random.default_rng(args.seed))
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.shapes:
        return shapes(args.trials, sizes, np.random.default_rng(args.seed), args.shape)
    rng = np.random.default_rng(args.seed)
    se = math.sqrt(ALPHA * (1 - ALPHA) / args.trials)
    print(f"{args.trials} trials per cell (standard error about {se:.3f} at a rate of {ALPHA}); tolerance {TOL}, "
          f"alpha {ALPHA}\n")
    print("| method | | " + " | ".join(f"n={n}" for n in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    only = set(filter(None, args.only.split(";")))
    for name, make, claim, boundary, power in CASES:
        if only and name not in only:
            continue
        started = time.perf_counter()
        for label, value in (("size", boundary), ("power", power)):
            cells = [f"{rate(make, claim, value, n, args.trials, rng):.3f}" for n in sizes]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - started:.0f} s -->", flush=True)
    for name, make, value in EQUIVALENCE:
        if only and name not in only:
            continue
        cells = [f"{rate(make, equivalent, value, n, args.trials, rng):.3f}" for n in sizes]
        print(f"| {name} | `equivalent` at a true change of -0.10 | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
