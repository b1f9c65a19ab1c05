"""Stage 5, compare: is a candidate run as accurate as a reference run, document by document?

Both runs must have seen the same documents with the same prompts (checked with lm-eval's per-sample
``doc_hash`` and ``prompt_hash``); unlike-for-like input is refused. For every task, filter and metric the
paired difference gets a bootstrap interval, 0/1 metrics get McNemar's exact test, and a verdict is read
against the tolerance (``stats.verdict``). The sample-level view lists flipped documents, diverging
generations, finish-reason and length shifts, and log-probability drift on log-likelihood tasks.

Usage: ``python -m evalkit.compare <reference run> <candidate run> [more candidates] [--tolerance 0.02]``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from evalkit import stats


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
    folder = Path(path)
    folder = folder.parent if folder.name == "results.json" else folder
    results_file = folder / "results.json"
    if not results_file.is_file():
        raise CompareError(f"{path}: not an evalkit run (no results.json)")
    results = json.loads(results_file.read_text())
    samples = {}
    for task in results.get("results", {}):
        file = folder / f"samples_{task}.jsonl"
        if file.is_file():
            lines = (json.loads(line) for line in file.read_text().splitlines() if line.strip())
            samples[task] = {(s["doc_id"], s.get("filter", "none")): s for s in lines}
    if not samples:
        raise CompareError(f"{path}: no samples_<task>.jsonl files; rerun with log_samples=true")
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


def paired_scores(pairs: list[tuple[dict, dict]], metric: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """(reference, candidate, both 0/1) values of one metric over the paired documents."""
    ref = np.array([float(r[metric]) for r, _ in pairs])
    cand = np.array([float(c[metric]) for _, c in pairs])
    return ref, cand, stats.is_binary(ref) and stats.is_binary(cand)


def task_detail(task: str, filt: str, pairs: list[tuple[dict, dict]],
                scores: dict[str, tuple[np.ndarray, np.ndarray, bool]]) -> TaskDetail:
    detail = TaskDetail(task=task, filter=filt)
    ids = [r["doc_id"] for r, _ in pairs]
    for metric, (ref, cand, binary) in scores.items():
        if binary:
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


def compare_runs(reference: Run, candidate: Run, *, tolerance: float = 0.02, confidence: float = 0.95,
                 iterations: int = 10_000, seed: int = 0) -> tuple[pd.DataFrame, list[TaskDetail]]:
    """One row per task, filter and metric (see ROW_COLUMNS), and the sample-level details."""
    check_like_for_like(reference, candidate)
    rows, details = [], []
    for task in sorted(reference.samples):
        ref_samples, cand_samples = reference.samples[task], candidate.samples[task]
        better_is = reference.results.get("higher_is_better", {}).get(task, {})
        for filt in sorted({f for _, f in ref_samples}):
            keys = sorted(k for k in ref_samples if k[1] == filt)
            pairs = [(ref_samples[k], cand_samples[k]) for k in keys]
            metrics = [m for m in pairs[0][0].get("metrics", []) if all(m in s for p in pairs for s in p)]
            scores = {metric: paired_scores(pairs, metric) for metric in metrics}
            for metric, (ref, cand, binary) in scores.items():
                interval = stats.paired_bootstrap(ref, cand, iterations=iterations, confidence=confidence,
                                                  seed=seed, higher_is_better=better_is.get(metric, True))
                b, c, p = stats.mcnemar_exact(ref, cand) if binary else (None, None, None)
                rows.append({"task": task, "filter": filt, "metric": metric, "n": len(pairs),
                             "reference": ref.mean(), "candidate": cand.mean(), "diff": interval.diff,
                             "ci_low": interval.low, "ci_high": interval.high, "mcnemar_b": b, "mcnemar_c": c,
                             "mcnemar_p": p, "verdict": stats.verdict(interval, tolerance)})
            details.append(task_detail(task, filt, pairs, scores))
    return pd.DataFrame(rows, columns=ROW_COLUMNS), details


ROW_COLUMNS = ["task", "filter", "metric", "n", "reference", "candidate", "diff", "ci_low", "ci_high",
               "mcnemar_b", "mcnemar_c", "mcnemar_p", "verdict"]


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from evalkit import report, results

    parser = argparse.ArgumentParser(prog="python -m evalkit.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="reference run folder (or its results.json)")
    parser.add_argument("candidates", nargs="+", help="candidate run folder(s), e.g. every point of a sweep")
    parser.add_argument("--tolerance", type=float, default=0.02, help="largest acceptable change, metric units")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--iterations", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--noise", nargs=2, metavar=("RUN_A", "RUN_B"),
                        help="two runs of one config (python -m evalkit.noise) to show the engine's own variation")
    args = parser.parse_args(argv)
    try:
        reference = load_run(args.reference)
        noise = None
        if args.noise:
            table, _ = compare_runs(load_run(args.noise[0]), load_run(args.noise[1]), tolerance=args.tolerance,
                                    iterations=args.iterations, seed=args.seed)
            noise = table[["task", "filter", "metric", "diff", "mcnemar_b", "mcnemar_c"]].rename(columns={
                "diff": "noise_diff", "mcnemar_b": "noise_b", "mcnemar_c": "noise_c"})
        worst = 0
        for path in args.candidates:
            candidate = load_run(path)
            table, details = compare_runs(reference, candidate, tolerance=args.tolerance,
                                          confidence=args.confidence, iterations=args.iterations, seed=args.seed)
            text = report.markdown(reference.name, candidate.name, table, details, tolerance=args.tolerance,
                                   confidence=args.confidence, noise=noise)
            page = report.html_page(text, report.with_noise(table, noise), report.plots(table, details, args.tolerance))
            stem = f"compare-vs-{reference.path.parent.name}-{reference.path.name}"
            written = results.write_beside(candidate.path, {f"{stem}.md": text, f"{stem}.html": page})
            print(text)
            print(f"\nwritten: {', '.join(map(str, written))}")
            worst = max(worst, 1 if (table["verdict"] == "worse").any() else 0)
        return worst
    except CompareError as error:
        print(f"evalkit.compare: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
