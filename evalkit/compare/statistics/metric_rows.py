"""One row of the comparison: a metric's lm-eval aggregation and direction, its tolerance, its statistics; and
groups scored as lm-eval 0.4.13 scores them (lm_eval/api/group.py ``Group.aggregate``): for each metric in the
group's ``aggregate_metric_list``, ``aggregate_subtask_metrics`` over its leaf tasks, the leaves' scores
weighted by their documents (``weight_by_size: true``) or equally. results.json does not keep the group's
config, so which weighting lm-eval applied is read off the group score it recorded in each run.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Callable

import numpy as np

from evalkit.compare.statistics import bootstrap, corpus, ratio, stats
from evalkit.compare.statistics.means import MIN_UNBOUNDED, too_few_unbounded
from evalkit.compare.statistics.interval import relative_change
from evalkit.compare.statistics.verdict import Tolerance, Tolerances

AGGREGATE_ITERATIONS = 1_000  # bootstrap resamples at most for corpus-level aggregations (each re-aggregates)
Values = dict[str, dict[tuple[str, str], tuple[list, list]]]  # task -> (filter, metric) -> (reference, candidate)


def aggregation(results: dict[str, Any], task: str, metric: str) -> tuple[str, Callable[[list], float] | None]:
    """(name, function) of the aggregation the task's metric_list names in results.json, else lm-eval's
    default for the metric; the function is None when lm-eval's registry does not know the name."""
    from lm_eval.api.registry import get_aggregation, get_metric_aggregation

    entries = ((results.get("configs") or {}).get(task) or {}).get("metric_list") or []
    named = next((e.get("aggregation") for e in entries if isinstance(e, dict) and e.get("metric") == metric), None)
    if named is not None:
        return str(named), get_aggregation(named) if isinstance(named, str) else None
    default = get_metric_aggregation(metric)
    return getattr(default, "__name__", "none"), default


ARITHMETIC = {"mean": "a number", "nanmean": "a number", "median": "a number", "perplexity": "a number",
              "weighted_perplexity": "a pair of numbers", "bits_per_byte": "a pair of numbers"}
"""What each of lm-eval's arithmetic aggregations takes per document (a log-likelihood and its count of words or
bytes for the weighted ones)."""


def expected_value(results: dict[str, Any], task: str, metric: str) -> tuple[str, str] | None:
    """(aggregation, what it takes per document) where the metric's aggregation is one of lm-eval's arithmetic
    ones (ARITHMETIC); None for any other (BLEU's pairs of texts, a task's own function), whose values only the
    aggregation itself can judge."""
    from lm_eval.api.registry import get_aggregation

    name, agg = aggregation(results, task, metric)
    return (name, ARITHMETIC[name]) if name in ARITHMETIC and agg is get_aggregation(name) else None


def is_mean(results: dict[str, Any], task: str, metric: str) -> bool:
    from lm_eval.api.registry import get_aggregation

    return aggregation(results, task, metric)[1] is get_aggregation("mean")


def direction(results: dict[str, Any], task: str, metric: str) -> bool | None:
    """higher_is_better as results.json records it; None (unknown) when missing or null, never a guess."""
    value = ((results.get("higher_is_better") or {}).get(task) or {}).get(metric)
    return value if isinstance(value, bool) else None


def _score(aggregate: Callable[[list], float] | None, values: list[Any]) -> float:
    try:
        return float(aggregate(list(values))) if aggregate is not None else math.nan
    except (TypeError, ValueError, ZeroDivisionError, KeyError, IndexError):
        return math.nan


def compare_values(results: dict[str, Any], task: str, metric: str, ref: list[Any], cand: list[Any], *,
                   higher_is_better: bool | None, tolerances: Tolerances, settings: dict[str, Any],
                   row_name: str | None = None) -> dict[str, Any]:
    """One row's statistics (stats.compare_paired) with the aggregation the task gives the metric, the tolerance
    of the row (row_name: the group a row of pooled documents stands for) and the range declared for its values
    (declared_range; the values were checked against it, range_error)."""
    name, agg = aggregation(results, task, metric)
    tolerance, mean = tolerances.of(row_name or task, metric, _score(agg, ref)), is_mean(results, task, metric)
    bounds = declared_range(results, tolerances, row_name or task, metric) if mean else None
    row = asdict(stats.compare_paired(ref, cand, aggregate=agg, aggregate_name=name,
                                      by_mean=mean, higher_is_better=higher_is_better,
                                      tolerance=tolerance.value, relative=tolerance.relative,
                                      aggregate_iterations=AGGREGATE_ITERATIONS,
                                      analytic=analytic(results, task, metric), bounds=bounds, **settings))
    return {**row, "higher_is_better": higher_is_better, "tolerance": tolerance.value, "relative": tolerance.relative}


def enclosing(results: dict[str, Any], name: str) -> list[str]:
    """The groups a task (or a group) lies in, through nested groups (mmlu_abstract_algebra -> mmlu_stem, mmlu)."""
    subtasks = results.get("group_subtasks") or {}
    parents = [group for group, members in subtasks.items() if name in (members or [])]
    return [*parents, *(g for parent in parents for g in enclosing(results, parent))]


def declared_range(results: dict[str, Any], tolerances: Tolerances, name: str, metric: str
                   ) -> tuple[float, float] | None:
    """The range [lo, hi] declared (--range-for) for metric's values on the documents of task or group name: its
    own, a group's it lies in, or every task's (*), all of them at once (Tolerances.range_of); None where none is."""
    return tolerances.range_of([name, *enclosing(results, name)], metric)


def range_error(results: dict[str, Any], task: str, filt: str, metric: str, ids: list[int],
                values: tuple[list, list], tolerances: Tolerances) -> str:
    """The one line that makes a declared range unusable for a task's metric ("" where none is, or it holds): a
    range named for a metric not averaged over documents (lm-eval's mean: a range says nothing of a corpus score or
    a perplexity), ranges that do not overlap, or a document whose value lies outside it, named with its run."""
    names = [task, *enclosing(results, task)]
    bounds = tolerances.range_of(names, metric)
    if bounds is None:
        return ""
    if not is_mean(results, task, metric):
        named = [f"{n}/{metric}" for n in [*names, "*"] if (n, metric) in tolerances.ranges]
        how = aggregation(results, task, metric)[0]
        return (f"--range-for {', '.join(named)}: {task}/{metric} is aggregated by {how}, not averaged over "
                "documents; a declared range applies to a metric lm-eval averages (mean)"
                if named else "")  # a range for every metric (*) leaves the others alone
    lo, hi = bounds
    if not lo < hi:
        return f"--range-for: the ranges declared for {task}/{metric} (its own, its groups', *) do not overlap"
    for side, run in zip(values, ("reference", "candidate")):
        outside = [(i, v) for i, v in zip(ids, side) if not lo <= float(v) <= hi]
        if outside:
            more = f" and {len(outside) - 1} more" if len(outside) > 1 else ""
            return (f"{task}/{metric} ({filt}): the {run}'s value on document {outside[0][0]} "
                    f"({outside[0][1]!r}){more} lies outside the range [{lo:g}, {hi:g}] declared by --range-for; "
                    "declare the range the metric's values can take, or none (the sign-flip test, from "
                    f"{MIN_UNBOUNDED} documents)")
    return ""


def leaf_tasks(group_subtasks: dict[str, list[str]], group: str) -> list[str]:
    """The tasks under a group, through nested groups (mmlu -> mmlu_stem -> mmlu_abstract_algebra)."""
    return [leaf for sub in group_subtasks.get(group, [])
            for leaf in (leaf_tasks(group_subtasks, sub) if sub in group_subtasks else [sub])]


def weight_by_size(runs: tuple[dict[str, Any], dict[str, Any]], group: str, key: str, tasks: list[str],
                   sizes: list[int]) -> tuple[bool | None, str]:
    """Whether lm-eval weighted the leaves by size for the group score it recorded under key ("acc,none") in
    both runs: the weighting whose mean of the leaves' recorded scores is that score in both. (None, why) when it
    recorded none, or one that neither weighting gives (not a mean of its leaves)."""
    fits: list[set[bool]] = []
    for results, name in zip(runs, ("reference", "candidate")):
        recorded = ((results.get("groups") or {}).get(group) or {}).get(key)
        scores = [((results.get("results") or {}).get(t) or {}).get(key) for t in tasks]
        if not all(isinstance(v, (int, float)) for v in [recorded, *scores]):
            return None, f"the {name}'s results.json has no score {key} of group {group} or of one of its tasks"
        means = {True: float(np.average(scores, weights=sizes)), False: float(np.mean(scores))}
        fits.append({w for w, value in means.items() if math.isclose(recorded, value, rel_tol=1e-9, abs_tol=1e-12)})
        if not fits[-1]:
            return None, (f"the {name}'s score of group {group} ({recorded:.6g}) is neither its {len(tasks)} "
                          f"tasks' mean by size ({means[True]:.6g}) nor their plain mean ({means[False]:.6g}), the "
                          "two ways lm-eval scores a group; its tasks' own rows are compared")
    if not fits[0] & fits[1]:
        mean = {True: "mean by size", False: "plain mean"}
        return None, (f"the reference's score of group {group} is its tasks' {mean[True in fits[0]]}, the "
                      f"candidate's their {mean[True in fits[1]]}: the runs weighted it differently; its tasks' own "
                      "rows are compared")
    return True in fits[0] & fits[1], ""  # both fit (equal sizes or scores): lm-eval's default, by size


def not_compared(results: dict[str, Any], task: str, filt: str, metric: str, why: str, *,
                 tolerances: Tolerances) -> dict[str, Any]:
    """The row of a score recorded but not compared: no scores and no test (every p-value 1, so it can only be
    inconclusive), its note saying why, so that nothing the runs recorded leaves the table unsaid."""
    tolerance, nan = tolerances.of(task, metric, math.nan), math.nan
    return {"task": task, "filter": filt, "metric": metric, "n": 0, "reference": nan, "candidate": nan, "diff": nan,
            "ci_low": nan, "ci_high": nan, "mcnemar_b": None, "mcnemar_c": None, "mcnemar_p": None, "method": None,
            **stats.NO_EVIDENCE, "higher_is_better": direction(results, task, metric), "tolerance": tolerance.value,
            "relative": tolerance.relative, "note": f"not compared: {why}", "p_floor": 1.0, "changed": 0}


def analytic(results: dict[str, Any], task: str, metric: str) -> bool:
    """Whether the metric's aggregation is lm-eval's own perplexity-family function (ratio.py tests it exactly)."""
    from lm_eval.api.registry import get_aggregation

    name, agg = aggregation(results, task, metric)
    return name in ratio.SCORE and agg is get_aggregation(name)


def resample_count(settings: dict[str, Any], *, slow: bool) -> int:
    """Resamples for a row: at least what its family needs (bootstrap.resamples_for); a row that re-aggregates every
    resample the slow way (corpus-level, not corpus.additive) at most AGGREGATE_ITERATIONS."""
    needed = bootstrap.resamples_for(settings.get("family", 1), 1.0 - settings["confidence"])
    count = max(settings["iterations"], needed)
    return min(count, AGGREGATE_ITERATIONS) if slow else count


def stratum_statistics(agg: Callable[[list], float], ref: list, cand: list, *, mean: bool, count: int, seed: int,
                       fast: tuple | None) -> np.ndarray:
    """(2, count): one leaf's aggregation of the reference's and the candidate's resamples of its documents."""
    parts = []
    for rows in bootstrap.resamples(len(ref), count, seed=seed):
        if mean:
            parts.append([np.asarray(side, dtype=float)[rows].mean(axis=1) for side in (ref, cand)])
        else:
            parts.append([corpus.resampled(agg, side, rows, quick) for side, quick in zip((ref, cand), fast)])
    return np.concatenate(parts, axis=1)


def widened(statistics: np.ndarray, scores: list[float], documents: int) -> np.ndarray:
    """One leaf's resampled scores (2, count) moved away from its own scores by sqrt(n / (n - 1)): resamples of n
    documents vary (n - 1) / n as much as the documents do (the plug-in variance; Efron & Tibshirani 1993, 5.3),
    which left the group's percentile bootstrap a little above its level at 30-50 documents a leaf."""
    centre = np.asarray(scores, dtype=float)[:, None]
    return centre + math.sqrt(documents / (documents - 1)) * (statistics - centre)


def mean_sums(pairs: list[tuple[list, list]], w: np.ndarray, reference: float, *, relative: bool
              ) -> ratio.Form | None:
    """A weighted mean of leaves' means as a ratio of per-document sums (ratio.Form): d_i = w_k (c_i - r_i) / n_k
    over units w_k / n_k (summing to 1), or, relative, over units s w_k r_i / n_k (s the sign of the reference's
    group score: the units sum to its absolute value), so that the reference's per-document values stay in the
    test rather than their mean taken as a known constant. None where relative and that score is 0."""
    if relative and not reference != 0:
        return None
    sign = 1.0 if reference > 0 else -1.0
    d = np.concatenate([wk * (np.asarray(c, dtype=float) - np.asarray(r, dtype=float)) / len(r)
                        for wk, (r, c) in zip(w, pairs)])
    u = np.concatenate([wk * (sign * np.asarray(r, dtype=float) if relative else np.ones(len(r))) / len(r)
                        for wk, (r, _) in zip(w, pairs)])
    return d, u, (lambda x: x), (lambda x: x)


def stratified_reading(results: dict[str, Any], tasks: list[str], metric: str, pairs: list[tuple[list, list]],
                       w: np.ndarray, scores: tuple[float, float], each: list[list[float]], *, tolerance: Tolerance,
                       higher_is_better: bool | None, settings: dict[str, Any]
                       ) -> tuple[Any, dict, str, float, str]:
    """(interval, p-values, method, p_floor, note) of a weighted mean of leaves' aggregations, the leaves strata:
    the sign-flip test of the documents' changes, each weighted by its leaf (ratio.paired_sums where every leaf is
    the same perplexity-family aggregation, mean_sums where every leaf is a mean of numbers), else a bootstrap
    with each leaf's documents resampled within it; relative like a task row where the tolerance is."""
    reading = dict(tolerance=tolerance.value, confidence=settings["confidence"], higher_is_better=higher_is_better)
    draws, seed = resample_count(settings, slow=False), settings["seed"]
    names = {aggregation(results, t, metric)[0] for t in tasks}
    if len(names) == 1 and all(analytic(results, t, metric) for t in tasks):
        name = names.pop()
        try:
            strata = [ratio.stratum(r, c, name) for r, c in pairs]
        except (TypeError, ValueError):  # not the values the ratio is made of: bootstrapped
            strata = None
        read = strata and stats.perplexity_reading(strata, w, name, scores, relative=tolerance.relative,
                                                   draws=draws, seed=seed, **reading)
        if read:
            interval, p, floor, note = read
            return interval, p, f"sign-flip stratified {name}", floor, note
    if all(is_mean(results, t, metric) and stats.all_scalar(*pair) for t, pair in zip(tasks, pairs)):
        form = mean_sums(pairs, w, scores[0], relative=tolerance.relative)
        n = sum(len(r) for r, _ in pairs)
        if form is not None and n < MIN_UNBOUNDED:  # weighted by leaf, even 0/1 changes are no longer bounded alike
            diff = relative_change(*scores) if tolerance.relative else scores[1] - scores[0]
            return (*stats.untested(diff, **reading), "sign-flip stratified", 1.0,
                    too_few_unbounded(n, "in leaves weighted unequally by document"))
        if form is not None:
            interval, p, floor = stats.ratio_reading(form, draws=draws, seed=seed, **reading)
            return interval, p, "sign-flip stratified", floor, ""
    diff = relative_change(*scores) if tolerance.relative else scores[1] - scores[0]
    short = bootstrap.too_few(min(len(ref) for ref, _ in pairs))  # the smallest leaf's resamples vary least
    if short:
        return (*stats.untested(diff, **reading), "bootstrap stratified", 1.0, short)
    means = [is_mean(results, t, metric) and stats.all_scalar(*pair) for t, pair in zip(tasks, pairs)]
    aggregates = [aggregation(results, t, metric)[1] for t in tasks]
    fast = [None if m else tuple(corpus.additive(agg, side, score) for side, score in zip(pair, leaf))
            for m, agg, pair, leaf in zip(means, aggregates, pairs, each)]
    count = resample_count(settings, slow=any(f is not None and None in f for f in fast))
    totals = sum(wt * widened(stratum_statistics(agg, *pair, mean=m, count=count, seed=settings["seed"] + k, fast=f),
                              leaf, len(pair[0]))
                 for k, (wt, agg, pair, m, f, leaf) in enumerate(zip(w, aggregates, pairs, means, fast, each)))
    statistics = relative_change(totals[0], totals[1]) if tolerance.relative else totals[1] - totals[0]
    return (*stats.bootstrap_reading(diff, statistics, **reading), "bootstrap stratified", 1.0 / (count + 1), "")


def stratified_row(results: dict[str, Any], group: str, tasks: list[str], metric: str,
                   pairs: list[tuple[list, list]], weights: list[float], *, tolerances: Tolerances,
                   higher_is_better: bool | None, settings: dict[str, Any]) -> dict[str, Any]:
    """A group whose score is a weighted mean of its leaves' aggregations, read as a task row of the metric is:
    oriented by its direction, relative where the metric or the group's reference score calls for it."""
    w = np.asarray(weights, dtype=float) / float(np.sum(weights))
    aggregates = [aggregation(results, t, metric)[1] for t in tasks]
    each = [[_score(agg, side) for side in pair] for agg, pair in zip(aggregates, pairs)]
    scores = (float(np.dot(w, [s[0] for s in each])), float(np.dot(w, [s[1] for s in each])))
    tolerance = tolerances.of(group, metric, scores[0])
    interval, p, method, floor, note = stratified_reading(results, tasks, metric, pairs, w, scores, each,
                                                          tolerance=tolerance, higher_is_better=higher_is_better,
                                                          settings=settings)
    return {"reference": scores[0], "candidate": scores[1], "diff": interval.diff, "ci_low": interval.low,
            "ci_high": interval.high, "mcnemar_b": None, "mcnemar_c": None, "mcnemar_p": None, "method": method,
            **p, "higher_is_better": higher_is_better, "tolerance": tolerance.value, "relative": tolerance.relative,
            "note": note, "p_floor": floor,
            "changed": sum(r != c for ref, cand in pairs for r, c in zip(ref, cand))}


def group_row(runs: tuple[dict[str, Any], dict[str, Any]], values: Values, group: str, key: str, *,
              tolerances: Tolerances, settings: dict[str, Any]) -> dict[str, Any]:
    """The row of one group score lm-eval recorded (key "metric,filter"); one not compared, saying why, where it
    cannot be scored as lm-eval scored it."""
    results, metric, filt = runs[0], *key.split(",", 1)
    tasks = [t for t in leaf_tasks(results.get("group_subtasks") or {}, group) if (filt, metric) in values.get(t, {})]
    pairs = [values[t][(filt, metric)] for t in tasks]
    weighted, why = (weight_by_size(runs, group, key, tasks, [len(ref) for ref, _ in pairs]) if tasks else
                     (None, f"none of its tasks has per-document values of {metric} ({filt})"))
    if weighted is None:
        return not_compared(results, group, filt, metric, why, tolerances=tolerances)
    own, leaves = direction(results, group, metric), {direction(results, t, metric) for t in tasks}
    known = own if own is not None else leaves.pop() if len(leaves) == 1 else None
    n = sum(len(ref) for ref, _ in pairs)
    if weighted and all(is_mean(results, t, metric) for t in tasks):
        ref, cand = [v for pair in pairs for v in pair[0]], [v for pair in pairs for v in pair[1]]
        row = compare_values(results, tasks[0], metric, ref, cand, higher_is_better=known, tolerances=tolerances,
                             settings=settings, row_name=group)
        how = f"{n} documents of {len(tasks)} tasks pooled (weight_by_size: lm-eval's size-weighted mean)"
    else:
        weights = [len(r) for r, _ in pairs] if weighted else [1] * len(tasks)
        row = stratified_row(results, group, tasks, metric, pairs, weights, tolerances=tolerances,
                             higher_is_better=known, settings=settings)
        how = f"{len(tasks)} tasks' scores averaged " + ("by size" if weighted else "equally (weight_by_size: false)")
    return {"task": group, "filter": filt, "metric": metric, "n": n, **row,
            "note": "; ".join(filter(None, [f"group: {how}", row["note"]]))}


def group_rows(runs: tuple[dict[str, Any], dict[str, Any]], values: Values, *, tolerances: Tolerances,
               settings: dict[str, Any]) -> list[dict[str, Any]]:
    """A row per group score lm-eval recorded in the reference's results.json ("groups"), as it computed it."""
    return [group_row(runs, values, group, key, tolerances=tolerances, settings=settings)
            for group, key in group_keys(runs[0])]


def group_keys(results: dict[str, Any]) -> list[tuple[str, str]]:
    """(group, "metric,filter") of every group score lm-eval recorded in results.json ("groups")."""
    recorded = results.get("groups") or {}
    return [(group, key) for group in sorted(recorded) for key in sorted(recorded[group])
            if "," in key and "_stderr," not in key and isinstance(recorded[group][key], (int, float))]
