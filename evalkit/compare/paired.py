"""Stage 5, compare: is a candidate run as accurate as a reference run, document by document?

Both runs must have seen the same tasks at the same versions, the same documents, prompts and targets (lm-eval's
``versions`` and per-sample ``doc_hash``, ``prompt_hash`` and ``target_hash``); unlike-for-like input is refused.
For every task, filter and metric, and for every group score lm-eval recorded (scored as lm-eval scores it,
evalkit/compare/scoring.py), the difference gets an interval and the p-values of the one-sided tests against
the row's tolerance (absolute for 0-1 metrics, relative for unbounded ones): Tango's score and McNemar's exact
test for 0/1 metrics averaged over documents, a paired bootstrap of the mean difference for other averaged
metrics, and for corpus-level metrics (perplexity, BLEU, F1, ...) a paired bootstrap of the metric's own
lm-eval aggregation. Verdicts are Holm-adjusted over every row (evalkit/compare/verdict.py), so the exit code
is a family-wise test at --alpha. A metric whose direction (``higher_is_better``) is unknown is compared
unoriented. The sample-level view lists flipped documents, diverging generations, finish-reason and length
shifts, and log-probability drift on log-likelihood tasks.

Usage: ``python -m evalkit.compare <reference run> <candidate run> [more candidates] [--tolerance 0.02]
[--tolerance-for TASK/METRIC=VALUE] [--alpha 0.05] [--locate]`` (``--locate``: why each changed document
changed, evalkit/compare/locate.py).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from evalkit.compare import scoring, stats, verdict
from evalkit.compare.scoring import compare_values, group_rows
from evalkit.compare.verdict import FAILING, Tolerances  # noqa: F401 (FAILING: the verdicts that exit 1)

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
    """Same tasks at the same versions, documents, few-shot counts, prompts and targets; a CompareError if not."""
    if set(reference.samples) != set(candidate.samples):
        raise CompareError(f"different tasks: {sorted(reference.samples)} vs {sorted(candidate.samples)}")
    versions = [run.results.get("versions") or {} for run in (reference, candidate)]
    for name in sorted(set(versions[0]) | set(versions[1])):
        if versions[0].get(name) != versions[1].get(name):
            raise CompareError(f"{name}: task version {versions[0].get(name)} vs {versions[1].get(name)}; the runs "
                               "used different task definitions")
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
            for hash_key in ("doc_hash", "prompt_hash", "target_hash"):
                if sample.get(hash_key) != other.get(hash_key):
                    raise CompareError(f"{task}: document {key[0]} differs ({hash_key}); the runs did not "
                                       "see the same documents, prompts and answers")


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


def compare_runs(reference: Run, candidate: Run, *, tolerance: float | Tolerances = 0.02, confidence: float = 0.95,
                 iterations: int = 10_000, seed: int = 0) -> tuple[pd.DataFrame, list[TaskDetail]]:
    """One row per task (then group), filter and metric (see ROW_COLUMNS) with verdicts Holm-adjusted over its
    rows (verdict.decide; alpha = 1 - confidence), and the sample-level details. A float tolerance is the
    absolute one, relative metrics keeping their default."""
    check_like_for_like(reference, candidate)
    tolerances = tolerance if isinstance(tolerance, Tolerances) else Tolerances(absolute=tolerance)
    settings = dict(confidence=confidence, iterations=iterations, seed=seed)
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
                    results, task, metric, ref, cand, higher_is_better=scoring.direction(results, task, metric),
                    tolerances=tolerances, settings=settings)})
            details.append(task_detail(task, filt, pairs, {m: values[task][(filt, m)] for m in metrics}))
    rows += group_rows((results, candidate.results), values, tolerances=tolerances, settings=settings)
    unused = tolerances.unused({(r["task"], r["metric"]) for r in rows})
    if unused:
        raise CompareError(f"--tolerance-for {', '.join(unused)}: no such task/metric compared")
    (table,) = verdict.decide([pd.DataFrame(rows, columns=ROW_COLUMNS[:-3])], 1.0 - confidence)
    return table[ROW_COLUMNS], details


ROW_COLUMNS = ["task", "filter", "metric", "n", "reference", "candidate", "diff", "ci_low", "ci_high", "tolerance",
               "relative", "higher_is_better", "mcnemar_b", "mcnemar_c", "mcnemar_p", "method", "p_worse", "p_better",
               "p_equivalent", "p_lower", "p_higher", "note", "p_worse_holm", "p_equivalent_holm", "verdict"]


def tolerances_from(args: Any) -> Tolerances:
    try:
        overrides = dict(verdict.parse_override(text) for text in args.tolerance_for)
    except ValueError as error:
        raise CompareError(str(error)) from None
    return Tolerances(absolute=args.tolerance, relative=args.relative_tolerance, overrides=overrides)


def add_arguments(parser: Any) -> None:
    parser.add_argument("reference", help="reference run folder (or its results.json)")
    parser.add_argument("candidates", nargs="+", help="candidate run folder(s), e.g. every point of a sweep")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="largest acceptable change of a 0-1 metric (accuracy, exact match), absolute "
                             "(default 0.02)")
    parser.add_argument("--relative-tolerance", type=float, default=0.02, metavar="FRACTION",
                        help="largest acceptable change of an unbounded metric (perplexity, BLEU, bits_per_byte, any "
                             "score outside [-1, 1]) as a fraction of the reference's score (default 0.02: 2%%)")
    parser.add_argument("--tolerance-for", action="append", default=[], metavar="TASK/METRIC=VALUE",
                        help="the tolerance of one task (or group) and metric, either may be *: absolute "
                             "(mmlu/acc=0.01) or relative with %% (wikitext/word_perplexity=5%%); repeatable")
    parser.add_argument("--alpha", type=float, default=0.05,
                        help="family-wise false-alarm rate: the chance that a candidate with no change beyond the "
                             "tolerance anywhere fails (exit 1), Holm over every row compared (default 0.05)")
    parser.add_argument("--iterations", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--noise", nargs=2, metavar=("RUN_A", "RUN_B"),
                        help="two runs of one config (python -m evalkit.compare.noise) to show the engine's own variation")


def noise_columns(args: Any, tolerances: Tolerances) -> pd.DataFrame:
    table, _ = compare_runs(load_run(args.noise[0]), load_run(args.noise[1]), tolerance=tolerances,
                            iterations=args.iterations, seed=args.seed)
    return table[["task", "filter", "metric", "diff", "mcnemar_b", "mcnemar_c"]].rename(columns={
        "diff": "noise_diff", "mcnemar_b": "noise_b", "mcnemar_c": "noise_c"})


DESCRIPTION = """\
Are two runs' scores the same within a tolerance, and if not, why did they change?

Compares a candidate run (or several: every point of a sweep) with a reference run of the same tasks,
documents and prompts, document by document. For every task, filter and metric it gives both scores, the
difference with its interval, and a verdict, family-wise at --alpha over every row: worse, changed, better,
lower, higher, equivalent or inconclusive. Below the table: the documents that flipped, where generations
diverge, log-probability drift; --locate finds the first token where each changed generation parted and why
(near-tie, logit drift, other). The report is printed and written next to each candidate run
(compare-vs-<reference model>-<reference run id>.md and .html)."""

EPILOG = """\
examples:
  python -m evalkit.compare result/qwen2-7b/20261201-101500 result/qwen2-7b/20261202-093000
  python -m evalkit.compare REF CAND --tolerance 0.01 --tolerance-for mmlu/acc=0.005
  python -m evalkit.compare REF SWEEP_POINT_1 SWEEP_POINT_2 --locate

exit codes:
  0  no row of any candidate is worse or changed (inconclusive rows exit 0 too: read the verdicts)
  1  a row is worse (shown below -tolerance) or changed (shown beyond it, direction unknown), at --alpha
  2  unusable input: a run missing or unreadable, runs not like-for-like (other tasks, versions, documents,
     prompts or targets), a bad option, or an engine --locate cannot start

more: docs/compare.md and docs/locate.md"""


def main(argv: list[str] | None = None) -> int:
    """Exit 0, or 1 when a row of any candidate is worse (or changed) family-wise at --alpha, or 2 on bad input."""
    import argparse
    import sys

    from evalkit.compare import locate, report
    from evalkit.run import results

    parser = argparse.ArgumentParser(prog="python -m evalkit.compare", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    locate.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        if not 0 < args.alpha < 0.5:
            raise CompareError(f"--alpha {args.alpha}: must lie in (0, 0.5)")
        tolerances, confidence = tolerances_from(args), 1.0 - args.alpha
        reference, candidates = load_run(args.reference), [load_run(path) for path in args.candidates]
        noise = noise_columns(args, tolerances) if args.noise else None
        why = locate.from_args(args, reference, candidates) if args.locate else {}
        compared = [compare_runs(reference, candidate, tolerance=tolerances, confidence=confidence,
                                 iterations=args.iterations, seed=args.seed) for candidate in candidates]
        tables = verdict.decide([table for table, _ in compared], args.alpha)  # one family: every candidate's rows
        for candidate, table, (_, details) in zip(candidates, tables, compared):
            text = report.markdown(reference.name, candidate.name, table, details, tolerance=args.tolerance,
                                   confidence=confidence, noise=noise, why=why.get(candidate.path),
                                   family=sum(map(len, tables)), comparisons=len(tables))
            images = {**report.plots(table, details, args.tolerance), **report.why_plots(why.get(candidate.path))}
            page = report.html_page(text, report.with_noise(table, noise), images)
            stem = f"compare-vs-{reference.path.parent.name}-{reference.path.name}"
            written = results.write_beside(candidate.path, {f"{stem}.md": text, f"{stem}.html": page})
            print(text)
            print(f"\nwritten: {', '.join(map(str, written))}")
        return verdict.gate(tables)
    except CompareError as error:
        print(f"evalkit.compare: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
