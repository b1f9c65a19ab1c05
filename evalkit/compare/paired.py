"""Stage 5, compare: is a candidate run as accurate as a reference run, document by document?

Both runs must have seen the same documents with the same prompts (checked with lm-eval's per-sample
``doc_hash`` and ``prompt_hash``); unlike-for-like input is refused. For every task, filter and metric, and for
every group (its subtasks' documents pooled), the difference gets an interval and a verdict against the
tolerance (``stats.verdict``): Tango's score interval and McNemar's exact test for 0/1 metrics averaged over
documents, a paired bootstrap of the mean difference for other averaged metrics, and for corpus-level
metrics (perplexity, BLEU, F1, ...) a paired bootstrap of the metric's own lm-eval aggregation, named in
results.json. A metric whose direction (``higher_is_better``) is unknown is compared unoriented. The
sample-level view lists flipped documents, diverging generations, finish-reason and length shifts, and
log-probability drift on log-likelihood tasks.

Usage: ``python -m evalkit.compare <reference run> <candidate run> [more candidates] [--tolerance 0.02]
[--locate]`` (``--locate``: why each changed document changed, evalkit/compare/locate.py).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from evalkit.compare import stats

AGGREGATE_ITERATIONS = 1_000  # bootstrap resamples at most for corpus-level aggregations (each re-aggregates)


class CompareError(ValueError):
    """The two runs cannot be compared (missing files, different tasks, documents or prompts)."""


@dataclass
class Run:
    path: Path  # the run folder
    results: dict[str, Any]
    samples: dict[str, dict[tuple[int, str], dict[str, Any]]]  # task -> (doc_id, filter) -> sample line

    @property
    def name(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}"


def load_run(path: str | Path) -> Run:
    """A run folder written by ``python -m evalkit``, or its results.json."""
    from evalkit.run.results import sample_files

    folder = Path(path)
    folder = folder.parent if folder.name == "results.json" else folder
    results_file = folder / "results.json"
    if not results_file.is_file():
        raise CompareError(f"{path}: not an evalkit run (no results.json)")
    results = json.loads(results_file.read_text())
    samples = {}
    for task, file in sample_files(folder, results).items():
        if file.is_file():
            lines = (json.loads(line) for line in file.read_text().splitlines() if line.strip())
            samples[task] = {(s["doc_id"], s.get("filter", "none")): s for s in lines}
    if not samples:
        raise CompareError(f"{path}: no samples_<task>_<date>.jsonl files; rerun with log_samples=true")
    return Run(path=folder.resolve(), results=results, samples=samples)


def check_like_for_like(reference: Run, candidate: Run) -> None:
    if set(reference.samples) != set(candidate.samples):
        raise CompareError(f"different tasks: {sorted(reference.samples)} vs {sorted(candidate.samples)}")
    for task, ref in reference.samples.items():
        cand = candidate.samples[task]
        if set(ref) != set(cand):
            raise CompareError(f"{task}: different documents ({len(ref)} vs {len(cand)} samples); "
                               "use the same limit and task data")
        shots = [run.results.get("n-shot", {}).get(task) for run in (reference, candidate)]
        if shots[0] != shots[1]:
            raise CompareError(f"{task}: different few-shot counts {shots[0]} vs {shots[1]}")
        for key, sample in ref.items():
            other = cand[key]
            for hash_key in ("doc_hash", "prompt_hash"):
                if sample.get(hash_key) != other.get(hash_key):
                    raise CompareError(f"{task}: document {key[0]} differs ({hash_key}); the runs did not "
                                       "see the same documents and prompts")


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


def _choice_logprobs(sample: dict[str, Any]) -> list[float] | None:
    resps = sample.get("resps") or []
    try:
        return [float(r[0][0]) for r in resps]
    except (TypeError, ValueError, IndexError):
        return None


def metric_values(pairs: list[tuple[dict, dict]], metric: str) -> tuple[list[Any], list[Any]]:
    """One metric's per-document values in both runs; JSON lists turned back into lm-eval's tuples."""
    def value(sample: dict[str, Any]) -> Any:
        return tuple(sample[metric]) if isinstance(sample[metric], list) else sample[metric]

    return [value(r) for r, _ in pairs], [value(c) for _, c in pairs]


def task_detail(task: str, filt: str, pairs: list[tuple[dict, dict]],
                values: dict[str, tuple[list[Any], list[Any]]]) -> TaskDetail:
    detail = TaskDetail(task=task, filter=filt)
    ids = [r["doc_id"] for r, _ in pairs]
    for metric, (ref, cand) in values.items():
        if stats.all_binary(ref, cand):
            detail.flips[metric] = {
                "right_to_wrong": [d for d, x, y in zip(ids, ref, cand) if x == 1 and y == 0],
                "wrong_to_right": [d for d, x, y in zip(ids, ref, cand) if x == 0 and y == 1]}
    reasons: Counter = Counter()
    for r, c in pairs:
        if r.get("raw_output") is not None and c.get("raw_output") is not None:
            detail.generated += 1
            if r["raw_output"] != c["raw_output"]:
                detail.generations.append(first_divergence(r, c))
            if r.get("finish_reason") != c.get("finish_reason"):
                reasons[f"{r.get('finish_reason')} -> {c.get('finish_reason')}"] += 1
            detail.length_shift.append(int(c.get("output_tokens", 0)) - int(r.get("output_tokens", 0)))
        ref_lp, cand_lp = _choice_logprobs(r), _choice_logprobs(c)
        if r.get("raw_output") is None and ref_lp and cand_lp and len(ref_lp) == len(cand_lp):
            detail.logprob_diffs.extend(np.subtract(cand_lp, ref_lp).tolist())
            detail.logprob["argmax_changed"] = detail.logprob.get("argmax_changed", 0) + int(
                np.argmax(ref_lp) != np.argmax(cand_lp))
    detail.finish_reasons = dict(reasons)
    if detail.generated:
        ref_len = [float(r.get("output_tokens", 0)) for r, c in pairs if r.get("raw_output") is not None]
        detail.output_tokens = {"reference": float(np.mean(ref_len)),
                                "candidate": float(np.mean(ref_len) + np.mean(detail.length_shift)),
                                "mean_shift": float(np.mean(detail.length_shift))}
    if detail.logprob_diffs:
        drift = np.abs(detail.logprob_diffs)
        detail.logprob.update({"choices": len(drift), "max_abs": float(drift.max()), "mean_abs": float(drift.mean()),
                               "mean": float(np.mean(detail.logprob_diffs)),
                               **{f"q{q}_abs": float(np.quantile(drift, q / 100)) for q in (50, 90, 99)}})
    return detail


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


def direction(results: dict[str, Any], task: str, metric: str) -> bool | None:
    """higher_is_better as results.json records it; None (unknown) when missing or null, never a guess."""
    value = ((results.get("higher_is_better") or {}).get(task) or {}).get(metric)
    return value if isinstance(value, bool) else None


def compare_values(results: dict[str, Any], task: str, metric: str, ref: list[Any], cand: list[Any], *,
                   higher_is_better: bool | None, settings: dict[str, Any]) -> dict[str, Any]:
    """One row's statistics (stats.compare_paired) with the aggregation the task gives the metric."""
    from lm_eval.api.registry import get_aggregation

    name, agg = aggregation(results, task, metric)
    return asdict(stats.compare_paired(ref, cand, aggregate=agg, aggregate_name=name,
                                       by_mean=agg is get_aggregation("mean"), higher_is_better=higher_is_better,
                                       aggregate_iterations=AGGREGATE_ITERATIONS, **settings))


def leaf_tasks(group_subtasks: dict[str, list[str]], group: str) -> list[str]:
    """The tasks under a group, through nested groups (mmlu -> mmlu_stem -> mmlu_abstract_algebra)."""
    return [leaf for sub in group_subtasks.get(group, [])
            for leaf in (leaf_tasks(group_subtasks, sub) if sub in group_subtasks else [sub])]


def group_rows(results: dict[str, Any], values: dict[str, dict[tuple[str, str], tuple[list, list]]],
               settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Per group, filter and metric shared by all its tasks: their documents pooled, so each counts once
    (lm-eval's size-weighted group mean). Only mean-aggregated metrics pool; lm-eval groups average scores."""
    from lm_eval.api.registry import get_aggregation

    subtasks, rows = results.get("group_subtasks") or {}, []
    for group in sorted(subtasks):
        tasks = leaf_tasks(subtasks, group)
        if not tasks or any(t not in values for t in tasks):
            continue
        for filt, metric in sorted(set.intersection(*(set(values[t]) for t in tasks))):
            if any(aggregation(results, t, metric)[1] is not get_aggregation("mean") for t in tasks):
                continue
            ref = [v for t in tasks for v in values[t][(filt, metric)][0]]
            cand = [v for t in tasks for v in values[t][(filt, metric)][1]]
            own, leaves = direction(results, group, metric), {direction(results, t, metric) for t in tasks}
            known = own if own is not None else leaves.pop() if len(leaves) == 1 else None
            row = compare_values(results, tasks[0], metric, ref, cand, higher_is_better=known, settings=settings)
            pooled = f"group: {len(ref)} documents of {len(tasks)} tasks pooled (size-weighted)"
            rows.append({"task": group, "filter": filt, "metric": metric, "n": len(ref), **row,
                         "note": "; ".join(filter(None, [pooled, row["note"]]))})
    return rows


def compare_runs(reference: Run, candidate: Run, *, tolerance: float = 0.02, confidence: float = 0.95,
                 iterations: int = 10_000, seed: int = 0) -> tuple[pd.DataFrame, list[TaskDetail]]:
    """One row per task (then group), filter and metric (see ROW_COLUMNS), and the sample-level details."""
    check_like_for_like(reference, candidate)
    settings = dict(tolerance=tolerance, confidence=confidence, iterations=iterations, seed=seed)
    results, rows, details = reference.results, [], []
    values: dict[str, dict[tuple[str, str], tuple[list, list]]] = {}
    for task in sorted(reference.samples):
        ref_samples, cand_samples, values[task] = reference.samples[task], candidate.samples[task], {}
        for filt in sorted({f for _, f in ref_samples}):
            pairs = [(ref_samples[k], cand_samples[k]) for k in sorted(k for k in ref_samples if k[1] == filt)]
            metrics = [m for m in pairs[0][0].get("metrics", []) if all(m in s for p in pairs for s in p)]
            for metric in metrics:
                ref, cand = values[task][(filt, metric)] = metric_values(pairs, metric)
                rows.append({"task": task, "filter": filt, "metric": metric, "n": len(pairs), **compare_values(
                    results, task, metric, ref, cand, higher_is_better=direction(results, task, metric),
                    settings=settings)})
            details.append(task_detail(task, filt, pairs, {m: values[task][(filt, m)] for m in metrics}))
    rows += group_rows(results, values, settings)
    return pd.DataFrame(rows, columns=ROW_COLUMNS), details


ROW_COLUMNS = ["task", "filter", "metric", "n", "reference", "candidate", "diff", "ci_low", "ci_high",
               "mcnemar_b", "mcnemar_c", "mcnemar_p", "method", "verdict", "note"]
FAILING = ("worse", "changed")  # verdicts that make the command exit 1


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from evalkit.compare import locate, report
    from evalkit.run import results

    parser = argparse.ArgumentParser(prog="python -m evalkit.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="reference run folder (or its results.json)")
    parser.add_argument("candidates", nargs="+", help="candidate run folder(s), e.g. every point of a sweep")
    parser.add_argument("--tolerance", type=float, default=0.02, help="largest acceptable change, metric units")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--iterations", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--noise", nargs=2, metavar=("RUN_A", "RUN_B"),
                        help="two runs of one config (python -m evalkit.compare.noise) to show the engine's own variation")
    locate.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        reference = load_run(args.reference)
        noise = None
        if args.noise:
            table, _ = compare_runs(load_run(args.noise[0]), load_run(args.noise[1]), tolerance=args.tolerance,
                                    iterations=args.iterations, seed=args.seed)
            noise = table[["task", "filter", "metric", "diff", "mcnemar_b", "mcnemar_c"]].rename(columns={
                "diff": "noise_diff", "mcnemar_b": "noise_b", "mcnemar_c": "noise_c"})
        worst, candidates = 0, [load_run(path) for path in args.candidates]
        why = locate.from_args(args, reference, candidates) if args.locate else {}
        for candidate in candidates:
            table, details = compare_runs(reference, candidate, tolerance=args.tolerance,
                                          confidence=args.confidence, iterations=args.iterations, seed=args.seed)
            text = report.markdown(reference.name, candidate.name, table, details, tolerance=args.tolerance,
                                   confidence=args.confidence, noise=noise, why=why.get(candidate.path))
            images = {**report.plots(table, details, args.tolerance), **report.why_plots(why.get(candidate.path))}
            page = report.html_page(text, report.with_noise(table, noise), images)
            stem = f"compare-vs-{reference.path.parent.name}-{reference.path.name}"
            written = results.write_beside(candidate.path, {f"{stem}.md": text, f"{stem}.html": page})
            print(text)
            print(f"\nwritten: {', '.join(map(str, written))}")
            worst = max(worst, 1 if table["verdict"].isin(FAILING).any() else 0)
        return worst
    except CompareError as error:
        print(f"evalkit.compare: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
