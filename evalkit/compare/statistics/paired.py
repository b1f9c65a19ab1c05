"""Decides whether a candidate run is as accurate as a reference run, document by document.

Both runs must have seen the same tasks at the same versions, the same documents, prompts and targets (lm-eval's
``versions`` and per-sample ``doc_hash``, ``prompt_hash`` and ``target_hash``); unlike-for-like input is refused.
For every task, filter and metric, and for every group score lm-eval recorded (scored as lm-eval scores it,
evalkit/compare/statistics/metric_rows.py), the difference gets an interval and the p-values of the one-sided tests against
the row's tolerance (absolute for 0-1 metrics, relative for unbounded ones): Tango's score and McNemar's exact
test for 0/1 metrics averaged over documents, betting or the sign-flip test for other averaged metrics
(evalkit/compare/statistics/means.py), the sign-flip test of per-document log-likelihood changes for lm-eval's
perplexity family (evalkit/compare/statistics/ratio.py), and for other corpus-level metrics (BLEU, F1, ...) a paired
bootstrap of the metric's own lm-eval aggregation, from 30 documents on. Verdicts are
Holm-adjusted over every row of every candidate (compare_family, evalkit/compare/statistics/verdict.py), with
resamples sized to that family, so the exit code is a family-wise test at --alpha. A metric whose direction
(``higher_is_better``) is unknown is compared unoriented. The sample-level view lists flipped documents, diverging
generations, finish-reason and length shifts, and log-probability drift on log-likelihood tasks.

The runs on disk and the like-for-like check: runs.py; the command line: cli.py.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import pandas as pd

from evalkit.compare.statistics import metric_rows, stats, verdict
from evalkit.compare.statistics.metric_rows import compare_values, group_rows
from evalkit.compare.runs import CompareError, Run, check_like_for_like, collector_paused, recorded_scores
from evalkit.compare.statistics.verdict import Tolerances
from evalkit.run.sample_index import each_choice_logprobs

@dataclass
class TaskDetail:
    """Sample-level differences for one task and filter."""

    task: str
    filter: str
    flips: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # metric -> direction -> doc ids
    generations: list[dict[str, Any]] = field(default_factory=list)  # differing generations
    generated: int = 0  # documents with a generation
    finish_reasons: dict[str, int] = field(default_factory=dict)  # "ref -> cand" -> documents, changes only
    output_tokens: dict[str, float] = field(default_factory=dict)  # reference/candidate means, mean shift
    length_shift: list[int] = field(default_factory=list)  # per document: candidate - reference tokens
    logprob: dict[str, float] = field(default_factory=dict)  # drift statistics over choices
    logprob_diffs: list[float] = field(default_factory=list)


def first_divergence(ref: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    """Where two generations first differ: token index (when output ids were recorded) and text."""
    a, b = ref.get("raw_output") or "", cand.get("raw_output") or ""
    char = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    ids = [s.get("requests", [{}])[0].get("output_ids") for s in (ref, cand)]
    token = None
    if ids[0] is not None and ids[1] is not None:
        token = next((i for i, (x, y) in enumerate(zip(*ids)) if x != y), min(len(ids[0]), len(ids[1])))
    return {"doc_id": ref["doc_id"], "token_index": token, "char_index": char,
            "common": a[max(0, char - 40):char], "reference": a[char:char + 80], "candidate": b[char:char + 80]}


def metric_values(pairs: list[tuple[dict, dict]], metric: str) -> tuple[list[Any], list[Any]]:
    """One metric's per-document values in both runs; JSON lists turned back into lm-eval's tuples."""
    get = operator.itemgetter(metric)
    ref, cand = (_as_tuples(list(map(get, map(side, pairs)))) for side in _SIDES)
    return ref, cand


def _as_tuples(values: list[Any]) -> list[Any]:
    """values with each list turned into a tuple (all at once, in C, where every value is one)."""
    types = set(map(type, values))
    if list not in types:
        return values
    return list(map(tuple, values)) if types == {list} else [tuple(v) if isinstance(v, list) else v for v in values]


def unusable(value: Any) -> bool:
    """Whether a per-document value is null, or holds a NaN or infinite number (anywhere in a tuple)."""
    if value is None:
        return True
    if isinstance(value, (list, tuple)):
        return any(map(unusable, value))
    return isinstance(value, float) and not math.isfinite(value)


def fits(value: Any, expected: str) -> bool:
    """Whether a per-document value is what an arithmetic aggregation takes (metric_rows.ARITHMETIC): a number
    (a bool too, which lm-eval's mean adds up), or a pair of them; text such as "0.5" is neither."""
    if expected == "a number":
        return isinstance(value, numbers.Real)
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, numbers.Real) for v in value)


def magnitude(value: Any) -> float:
    """The largest absolute number in a per-document value (through tuples; text counts 0), inf for an integer
    beyond a float's range."""
    if isinstance(value, (list, tuple)):
        return max(map(magnitude, value), default=0.0)
    try:
        return abs(float(value)) if isinstance(value, numbers.Real) else 0.0
    except OverflowError:
        return math.inf


def plain_numbers(pairs: list[tuple[dict, dict]], metric: str, expected: tuple[str, str] | None) -> bool:
    """Whether every value of metric in both runs is a finite float or int (a pair of them where the aggregation
    takes pairs) small enough to add up: what scored_pairs asks of each value, answered for every document at once
    (a value that is not plainly so goes through scored_pairs' own checks, which name the documents)."""
    kind = expected[1] if expected else None
    limit = sys.float_info.max / (2 * max(len(pairs), 1))
    for side in (0, 1):
        values = [pair[side][metric] for pair in pairs]
        if kind == "a pair of numbers":
            if set(map(type, values)) != {list} or set(map(len, values)) != {2}:
                return False
            values = list(itertools.chain.from_iterable(values))
        elif kind not in (None, "a number"):
            return False
        if not values or not set(map(type, values)) <= {float, int}:
            return False
        try:
            numbers_ = np.array(values, dtype=float)
        except OverflowError:  # an integer beyond a float's range
            return False
        if not (np.isfinite(numbers_).all() and (np.abs(numbers_) <= limit).all()):
            return False
    return True


def _docs(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:10])) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def scored_pairs(task: str, filt: str, pairs: list[tuple[dict, dict]], metric: str,
                 expected: tuple[str, str] | None = None) -> tuple[list[tuple[dict, dict]], str]:
    """The documents both runs scored on metric, and the one line that says which were left out: those neither
    run scored (lm-eval's own score of the metric leaves them out too). A document one run scored and the other
    did not, a value that is null, NaN or infinite (a log-likelihood that overflowed), one that is not what the
    metric's arithmetic aggregation takes (expected: metric_rows.expected_value; text where a number belongs), or
    one so large that a sum over the documents overflows (1e308) is unusable input: a CompareError naming the
    task, the metric and the documents, never a row quietly made of the rest or one left inconclusive."""
    if all(all(map(operator.contains, map(side, pairs), itertools.repeat(metric))) for side in _SIDES) and \
            plain_numbers(pairs, metric, expected):  # scored everywhere, plain numbers: checked at once, in C
        return list(pairs), ""
    has = [(metric in r, metric in c) for r, c in pairs]
    for side, name in ((0, "reference"), (1, "candidate")):
        only = [r["doc_id"] for (r, _), h in zip(pairs, has) if h[side] and not h[1 - side]]
        if only:
            raise CompareError(f"{task}/{metric} ({filt}): only the {name} scored documents {_docs(only)}; the runs "
                               "did not score the same documents")
    kept = [pair for pair, h in zip(pairs, has) if h[0]]
    for side, name in ((0, "reference"), (1, "candidate")):
        bad = [pair[side]["doc_id"] for pair in kept if unusable(pair[side][metric])]
        if bad:
            raise CompareError(f"{task}/{metric} ({filt}): the {name}'s value is null, NaN or infinite on documents "
                               f"{_docs(bad)}; a score that cannot be compared (rerun, or look at those documents)")
    for side, name in ((0, "reference"), (1, "candidate")) if expected else ():
        bad = [pair[side] for pair in kept if not fits(pair[side][metric], expected[1])]
        if bad:
            raise CompareError(f"{task}/{metric} ({filt}): the {name}'s value is not {expected[1]} on documents "
                               f"{_docs([s['doc_id'] for s in bad])} (first: {_shown(bad[0][metric])}); lm-eval's "
                               f"{expected[0]} takes {expected[1]} per document (rerun, or look at those documents)")
    limit = sys.float_info.max / (2 * max(len(kept), 1))  # a sum of differences over the documents stays finite
    for side, name in ((0, "reference"), (1, "candidate")):
        bad = [pair[side] for pair in kept if magnitude(pair[side][metric]) > limit]
        if bad:
            raise CompareError(f"{task}/{metric} ({filt}): the {name}'s value is too large to add up on documents "
                               f"{_docs([s['doc_id'] for s in bad])} (first: {_shown(bad[0][metric])}): over "
                               f"{len(kept)} documents a value must lie within ±{limit:.3g}, or their sums overflow; a "
                               "score that cannot be compared (rerun, or look at those documents)")
    left = len(pairs) - len(kept)
    note = (f"{left} of {len(pairs)} documents left out: neither run scored {metric} on them "
            f"({_docs([r['doc_id'] for (r, _), h in zip(pairs, has) if not h[0]])})") if left else ""
    return kept, note


def _logprob_drift(detail: TaskDetail, pairs: list[tuple[dict, dict]]) -> np.ndarray:
    """The log-likelihood documents' drift (pairs: those whose reference has no generation): each choice's change
    in document order (logprob_diffs; returned as an array, empty where there is none), and the documents whose
    best choice moved (argmax_changed), counted for each number of choices at once; a document whose runs
    recorded different numbers of choices is left out."""
    if (found := _same_choices_drift(detail, pairs)) is not None:
        return found
    ref_flat: list[float] = []
    cand_flat: list[float] = []
    choices: dict[int, tuple[list[list[float]], list[list[float]]]] = {}  # number of choices -> both runs' lists
    for ref_lp, cand_lp in zip(*(each_choice_logprobs(list(map(side, pairs))) for side in _SIDES)):
        if ref_lp and cand_lp and len(ref_lp) == len(cand_lp):
            ref_flat += ref_lp
            cand_flat += cand_lp
            both = choices.setdefault(len(ref_lp), ([], []))
            both[0].append(ref_lp)
            both[1].append(cand_lp)
    if not choices:
        return np.zeros(0)
    drift = np.subtract(cand_flat, ref_flat)  # y - x of each choice
    detail.logprob_diffs = drift.tolist()  # as Python floats
    detail.logprob["argmax_changed"] = sum(int((np.argmax(ref, axis=1) != np.argmax(cand, axis=1)).sum())
                                           for ref, cand in choices.values())
    return drift


def _same_choices_drift(detail: TaskDetail, pairs: list[tuple[dict, dict]]) -> np.ndarray | None:
    """_logprob_drift at C speed where every document of both runs recorded as many choices (most tasks: a fixed
    number of options), each a number: all choices read in one pass per run. None where not so (nothing set)."""
    logprobs = [each_choice_logprobs(list(map(side, pairs))) for side in _SIDES]
    try:
        counts = [set(map(len, side)) for side in logprobs]
        if len(counts[0]) != 1 or counts[0] != counts[1] or not (choices := counts[0].pop()):
            return None
    except TypeError:  # a document without choices (None)
        return None
    ref, cand = (np.fromiter(itertools.chain.from_iterable(side), dtype=float, count=len(side) * choices
                             ).reshape(len(side), choices) for side in logprobs)
    drift = (cand - ref).ravel()  # y - x of each choice in document order
    detail.logprob_diffs = drift.tolist()  # as Python floats
    detail.logprob["argmax_changed"] = int((np.argmax(ref, axis=1) != np.argmax(cand, axis=1)).sum())
    return drift


def task_detail(task: str, filt: str, pairs: list[tuple[dict, dict]],
                values: dict[str, tuple[list[Any], list[Any]]],
                scored: dict[str, list[int]] | None = None) -> TaskDetail:
    """scored: each metric's documents (doc ids) where not every pair scored it."""
    detail = TaskDetail(task=task, filter=filt)
    for metric, (ref, cand) in values.items():
        ids = (scored or {}).get(metric) or [r["doc_id"] for r, _ in pairs]
        if stats.all_binary(ref, cand):  # each document's doc_id where its 0/1 value went one way, at once
            x, y, doc_ids = np.asarray(ref, dtype=float), np.asarray(cand, dtype=float), np.asarray(ids)
            detail.flips[metric] = {"right_to_wrong": doc_ids[(x == 1) & (y == 0)].tolist(),
                                    "wrong_to_right": doc_ids[(x == 0) & (y == 1)].tolist()}
    reasons: Counter = Counter()
    outputs, ref_len = _each("raw_output", list(map(_FIRST, pairs))), []
    for (r, c), output in zip(pairs, outputs):
        if output is None:
            continue
        ref_len.append(float(r.get("output_tokens", 0)))
        if c.get("raw_output") is not None:
            detail.generated += 1
            if output != c["raw_output"]:
                detail.generations.append(first_divergence(r, c))
            if r.get("finish_reason") != c.get("finish_reason"):
                reasons[f"{r.get('finish_reason')} -> {c.get('finish_reason')}"] += 1
            detail.length_shift.append(int(c.get("output_tokens", 0)) - int(r.get("output_tokens", 0)))
    drift = _logprob_drift(detail, [pair for pair, output in zip(pairs, outputs) if output is None])
    detail.finish_reasons = dict(reasons)
    if detail.generated:
        detail.output_tokens = {"reference": float(np.mean(ref_len)),
                                "candidate": float(np.mean(ref_len) + np.mean(detail.length_shift)),
                                "mean_shift": float(np.mean(detail.length_shift))}
    if len(drift):
        size = np.abs(drift)
        detail.logprob.update({"choices": len(size), "max_abs": float(size.max()), "mean_abs": float(size.mean()),
                               "mean": float(drift.mean()),
                               **{f"q{q}_abs": float(found) for q, found in zip((50, 90, 99),
                                                                                np.quantile(size, [0.5, 0.9, 0.99]))}})
    return detail


# check_comparable's answer: metric_pairs' of each task and filter, each metric's scored_pairs in place of its name
Paired = list[tuple[str, str, list[tuple[dict, dict]], dict[str, tuple[list[tuple[dict, dict]], str]]]]


def metric_pairs(reference: Run, candidate: Run) -> Iterator[tuple[str, str, list[tuple[dict, dict]], list[str]]]:
    """(task, filter, paired samples, metrics either run scored on some document) of each task and filter."""
    for task in sorted(reference.samples):
        ref_samples, cand_samples = reference.samples[task], candidate.samples[task]
        filters = sorted({f for _, f in ref_samples})
        for filt in filters:
            # one filter: the keys in doc_id order (sorted on the integer alone, as fast as it gets)
            keys = (sorted(ref_samples, key=_FIRST) if len(filters) == 1
                    else sorted(k for k in ref_samples if k[1] == filt))
            refs, cands = list(map(ref_samples.__getitem__, keys)), list(map(cand_samples.__getitem__, keys))
            pairs = list(zip(refs, cands))
            named = [m for names in _metric_lists(refs, cands) for m in (names or []) if isinstance(m, str)]
            metrics = [m for m in dict.fromkeys(named) if any(m in s for p in pairs for s in p)]
            yield task, filt, pairs, metrics


def _metric_lists(refs: list[dict], cands: list[dict]) -> Iterable[Any]:
    """Each distinct list of metric names the documents hold, in the order documents and runs come. Runs read from
    disk share one list among the documents that name the same metrics (runs.held), so that few are walked: most
    often one, found at once in C (list.count compares by identity first)."""
    sides = [_each("metrics", samples) for samples in (refs, cands)]
    if refs and all(side.count(sides[0][0]) == len(side) for side in sides):
        return sides[0][:1]
    return {id(names): names for names in itertools.chain.from_iterable(zip(*sides))}.values()


def _each(key: str, samples: list[dict]) -> list[Any]:
    """Each sample's value under key (None where it has none), read at once in C."""
    try:
        return list(map(operator.itemgetter(key), samples))
    except KeyError:
        return list(map(operator.methodcaller("get", key), samples))


_FIRST = operator.itemgetter(0)
_SIDES = (_FIRST, operator.itemgetter(1))


def recorded_only(reference: Run, candidate: Run, paired: Paired | None = None) -> list[tuple[str, str, str, str]]:
    """(task, filter, metric, why) of each score a run's results.json records for a task that no row compares:
    the samples hold no per-document values of the metric, or the runs no samples file of the task. Each is a row
    not compared (metric_rows.not_compared) whose note says so, never a score left out unsaid."""
    compared = {(task, filt, metric) for task, filt, _, metrics in (metric_pairs(reference, candidate)
                                                                     if paired is None else paired)
                for metric in metrics}
    scores = [recorded_scores(run) for run in (reference, candidate)]
    found = []
    for task, filt, metric in sorted((set(scores[0]) | set(scores[1])) - compared):
        shown = ", ".join(f"{name} {s[(task, filt, metric)]:.6g}" if (task, filt, metric) in s else f"{name} none"
                          for name, s in zip(("reference", "candidate"), scores))
        where = (f"the samples hold no per-document values of {metric} ({filt})" if task in reference.samples
                 else f"the runs have no samples file of task {task}")
        found.append((task, filt, metric, f"results.json records it ({shown}), but {where}, which the comparison is "
                                          "made of"))
    return found


@collector_paused()
def check_comparable(reference: Run, candidate: Run) -> Paired:
    """Like for like (runs.check_like_for_like), every metric scored on the same documents in both runs, and no
    value null, NaN, infinite, not what its aggregation takes or too large to add up (scored_pairs): a
    CompareError before any statistic is computed. Returns the runs' metric_pairs, each metric's name mapped to its
    scored_pairs (compare_runs' paired)."""
    check_like_for_like(reference, candidate)
    return [(task, filt, pairs, {metric: scored_pairs(task, filt, pairs, metric,
                                                      metric_rows.expected_value(reference.results, task, metric))
                                 for metric in metrics})
            for task, filt, pairs, metrics in metric_pairs(reference, candidate)]


def planned_rows(reference: Run, candidate: Run, paired: Paired | None = None) -> int:
    """The rows compare_runs gives: what sizes the resamples. paired: the runs' metric_pairs, where known."""
    paired = list(metric_pairs(reference, candidate)) if paired is None else paired
    return (sum(len(metrics) for *_, metrics in paired)
            + len(metric_rows.group_keys(reference.results)) + len(recorded_only(reference, candidate, paired)))


@collector_paused()
def compare_runs(reference: Run, candidate: Run, *, tolerance: float | Tolerances = 0.02, confidence: float = 0.95,
                 iterations: int = 10_000, seed: int = 0, family: int | None = None, paired: Paired | None = None
                 ) -> tuple[pd.DataFrame, list[TaskDetail]]:
    """One row per task (then group), filter and metric (see ROW_COLUMNS) with verdicts Holm-adjusted over its
    rows (verdict.decide; alpha = 1 - confidence), and the sample-level details. A float tolerance is the
    absolute one, relative metrics keeping their default. family: the rows the verdicts will be adjusted over
    (compare_family's; default this comparison's), which sizes the bootstrap resamples. paired: check_comparable's
    answer for these runs (compare_family's), so that they are not paired and checked again."""
    if paired is None:
        paired = check_comparable(reference, candidate)
    tolerances = tolerance if isinstance(tolerance, Tolerances) else Tolerances(absolute=tolerance)
    family = planned_rows(reference, candidate, paired) if family is None else family
    settings = dict(confidence=confidence, iterations=iterations, seed=seed, family=family)
    results, rows, details = reference.results, [], []
    values: dict[str, dict[tuple[str, str], tuple[list, list]]] = {}
    for task, filt, pairs, metrics in paired:
        scored, ids = values.setdefault(task, {}), {}
        for metric, (kept, left_out) in metrics.items():
            ref, cand = scored[(filt, metric)] = metric_values(kept, metric)
            ids[metric] = [r["doc_id"] for r, _ in kept]
            if tolerances.ranges and (why := metric_rows.range_error(results, task, filt, metric, ids[metric],
                                                                     (ref, cand), tolerances)):
                raise CompareError(why)
            row = compare_values(results, task, metric, ref, cand, tolerances=tolerances, settings=settings,
                                 higher_is_better=metric_rows.direction(results, task, metric))
            rows.append({"task": task, "filter": filt, "metric": metric, "n": len(kept), **row,
                         "note": "; ".join(filter(None, [left_out, row["note"]]))})
        details.append(task_detail(task, filt, pairs, {m: scored[(filt, m)] for m in metrics}, ids))
    rows += group_rows((results, candidate.results), values, tolerances=tolerances, settings=settings)
    rows += [metric_rows.not_compared(results, task, filt, metric, why, tolerances=tolerances)
             for task, filt, metric, why in recorded_only(reference, candidate, paired)]
    unused = tolerances.unused({(r["task"], r["metric"]) for r in rows})
    if unused:
        raise CompareError(f"--tolerance-for {', '.join(unused)}: no such task/metric compared")
    if unused := tolerances.unused({(r["task"], r["metric"]) for r in rows}, tolerances.ranges):
        raise CompareError(f"--range-for {', '.join(unused)}: no such task/metric compared")
    if not any(row["method"] for row in rows):
        raise CompareError(f"{candidate.name}: no metric could be compared with {reference.name} ("
                           + ("; ".join(f"{r['task']}/{r['metric']}: {r['note']}" for r in rows[:3]) or "no metric scored")
                           + "); a comparison of no row shows nothing")
    (table,) = verdict.decide([pd.DataFrame(rows, columns=ROW_COLUMNS[:-4])], 1.0 - confidence)
    return table[ROW_COLUMNS], details


@collector_paused()
def compare_family(reference: Run, candidates: list[Run], *, tolerance: float | Tolerances = 0.02,
                   confidence: float = 0.95, iterations: int = 10_000, seed: int = 0
                   ) -> list[tuple[pd.DataFrame, list[TaskDetail]]]:
    """Every candidate against the reference, all their rows one family: resamples sized to it and verdicts
    Holm-adjusted over it (verdict.decide), so that a row's verdict is the same wherever it is shown (the command
    line, the sweep report)."""
    paired = [check_comparable(reference, candidate) for candidate in candidates]
    family = sum(planned_rows(reference, candidate, found) for candidate, found in zip(candidates, paired))
    compared = [compare_runs(reference, candidate, tolerance=tolerance, confidence=confidence, iterations=iterations,
                             seed=seed, family=family, paired=found) for candidate, found in zip(candidates, paired)]
    tables = verdict.decide([table for table, _ in compared], 1.0 - confidence)
    return [(table, details) for table, (_, details) in zip(tables, compared)]


ROW_COLUMNS = ["task", "filter", "metric", "n", "reference", "candidate", "diff", "ci_low", "ci_high", "tolerance",
               "relative", "higher_is_better", "mcnemar_b", "mcnemar_c", "mcnemar_p", "method", "p_worse", "p_better",
               "p_equivalent", "p_lower", "p_higher", "p_floor", "changed", "note", "p_worse_holm", "p_equivalent_holm",
               "mde", "verdict"]
