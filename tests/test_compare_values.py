"""`python -m evalkit.compare` on hand-made runs of any per-document values (not only 0/1): the verdict's direction
whatever the sign of the scores, values that are NaN, null, infinite or missing, comparisons with no row, the
tests that hold at small sizes, and `--require equivalent`. Each at several numbers of documents.
Run: pytest tests/test_compare_values.py
"""

import json
import math

import numpy as np
import pytest

from evalkit.compare import cli, paired
from evalkit.compare import runs as on_disk

MISSING = object()  # a sample without the metric


def value_run(folder, tasks):
    """A run folder by hand: tasks maps a task to {metric: (values, aggregation, higher_is_better)}; a value may
    be None, NaN, inf or MISSING (the metric left out of that document's sample)."""
    folder.mkdir(parents=True)
    results = {"results": {}, "configs": {}, "higher_is_better": {}, "n-shot": {}, "versions": {},
               "evalkit": {"files": {"samples": {}}, "engine": {"engine_args": {"dtype": "float32"}, "hardware": {}}}}
    for task, metrics in tasks.items():
        n = len(next(iter(metrics.values()))[0])
        lines = [{"doc_id": i, "filter": "none", "metrics": list(metrics), "doc_hash": f"d{i}", "prompt_hash": f"p{i}",
                  "target_hash": f"t{i}"} for i in range(n)]
        for metric, (values, _, _) in metrics.items():
            for line, value in zip(lines, values):
                if value is not MISSING:
                    line[metric] = value
        (folder / f"samples_{task}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        finite = lambda vs: [v for v in vs if isinstance(v, (int, float)) and math.isfinite(v)]  # noqa: E731
        results["results"][task] = {f"{m},none": float(np.mean(finite(v) or [0.0])) for m, (v, _, _) in metrics.items()}
        results["configs"][task] = {"metric_list": [{"metric": m, "aggregation": a} for m, (_, a, _) in metrics.items()]}
        results["higher_is_better"][task] = {m: h for m, (_, _, h) in metrics.items()}
        results["n-shot"][task], results["versions"][task] = 0, 1.0
        results["evalkit"]["files"]["samples"][task] = f"samples_{task}.jsonl"
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def value_pair(tmp_path, ref, cand, *, metric="m", aggregation="mean", higher_is_better=True, task="t"):
    return (value_run(tmp_path / "m" / "ref", {task: {metric: (list(ref), aggregation, higher_is_better)}}),
            value_run(tmp_path / "m" / "cand", {task: {metric: (list(cand), aggregation, higher_is_better)}}))


def row_of(ref, cand, **kwargs):
    table, _ = paired.compare_runs(on_disk.load_run(ref), on_disk.load_run(cand), **kwargs)
    return table.iloc[0]


def negative_scores(n, seed=0):
    """truthfulqa_gen's bleu_diff shape: mean-aggregated, higher is better, mostly negative (around -8)."""
    return -8.0 + np.random.default_rng(seed).normal(0.0, 2.0, n)


@pytest.mark.parametrize("n", [30, 100, 400])
@pytest.mark.parametrize("change, verdict, code", [(-0.2, "worse", 1), (+0.2, "better", 0)])
def test_a_relative_change_of_a_negative_score_keeps_its_direction(tmp_path, n, change, verdict, code):
    """A 20 % regression of a score around -8 (it falls to -9.6) is worse, a 20 % improvement (-6.4) better."""
    ref = negative_scores(n)
    cand = ref + change * np.abs(ref.mean())
    ref_dir, cand_dir = value_pair(tmp_path, ref, cand, metric="bleu_diff")
    row = row_of(ref_dir, cand_dir)
    assert row.relative and row["diff"] == pytest.approx(change) and row.verdict == verdict
    assert cli.main([str(ref_dir), str(cand_dir)]) == code


@pytest.mark.parametrize("n", [30, 200])
def test_a_relative_change_from_a_reference_near_zero_keeps_its_direction(tmp_path, n):
    """BLEU (relative by name) around 0.001 falling by about three quarters: worse however small the score."""
    rng = np.random.default_rng(n)
    ref = rng.uniform(0.0005, 0.0015, n)
    ref_dir, cand_dir = value_pair(tmp_path, ref, ref * rng.uniform(0.0, 0.5, n), metric="bleu", aggregation="mean")
    row = row_of(ref_dir, cand_dir)
    assert row.relative and row["diff"] < -0.5 and row.verdict == "worse"
    assert cli.main([str(ref_dir), str(cand_dir)]) == 1
