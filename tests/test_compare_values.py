"""`python -m evalkit.compare` on hand-made runs of any per-document values (not only 0/1): the verdict's direction
whatever the sign of the scores, values that are NaN, null, infinite or missing, comparisons with no row, the
tests that hold at small sizes, and `--require equivalent`. Each at several numbers of documents.
Run: pytest tests/test_compare_values.py
"""

import json
import subprocess
import sys
import math

import numpy as np
import pandas as pd
import pytest

from evalkit.compare import cli
from evalkit.compare.statistics import paired
from evalkit.compare import runs as on_disk
from evalkit.compare.statistics.verdict import Tolerances

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


@pytest.mark.parametrize("n", [200, 400])
@pytest.mark.parametrize("change, verdict, code", [(-0.2, "worse", 1), (+0.2, "better", 0)])
def test_a_relative_change_of_a_negative_score_keeps_its_direction(tmp_path, n, change, verdict, code):
    """A 20 % regression of a score around -8 (it falls to -9.6) is worse, a 20 % improvement (-6.4) better."""
    ref = negative_scores(n)
    cand = ref + change * np.abs(ref.mean())
    ref_dir, cand_dir = value_pair(tmp_path, ref, cand, metric="bleu_diff")
    row = row_of(ref_dir, cand_dir)
    assert row.relative and row["diff"] == pytest.approx(change) and row.verdict == verdict
    assert cli.main([str(ref_dir), str(cand_dir)]) == code


def test_a_relative_change_from_a_reference_near_zero_keeps_its_direction(tmp_path):
    """BLEU (relative by name) around 0.001 falling by about three quarters: values in [0, 1], so betting on
    c_i - (1 + t) r_i, which cannot tell a fall of 0.00075 a document on 30 documents from one that a few unseen
    documents could undo (inconclusive), and shows it worse on 20,000, however small the score."""
    from lm_eval.api.registry import get_aggregation

    from evalkit.compare.statistics.stats import compare_paired

    rng = np.random.default_rng(30)
    ref = rng.uniform(0.0005, 0.0015, 30)
    ref_dir, cand_dir = value_pair(tmp_path, ref, ref * rng.uniform(0.0, 0.5, 30), metric="bleu", aggregation="mean")
    row = row_of(ref_dir, cand_dir)
    assert row.relative and row.method == "betting" and row["diff"] < -0.5 and row.verdict == "inconclusive"
    assert cli.main([str(ref_dir), str(cand_dir)]) == 0
    ref = rng.uniform(0.0005, 0.0015, 20_000)
    row = compare_paired(ref.tolist(), (ref * rng.uniform(0.0, 0.5, 20_000)).tolist(), aggregate=get_aggregation("mean"),
                         aggregate_name="mean", by_mean=True, higher_is_better=True, tolerance=0.02, relative=True)
    assert row.method == "betting" and row.diff < -0.5 and row.p_worse < 0.001 and row.ci_high < -0.5


def accuracy_pair(tmp_path, n, *, damage, where="cand"):
    """0/1 scores falling from 0.80 to 0.50 over n documents, one value of one run replaced by damage."""
    ref = [1.0] * int(0.8 * n) + [0.0] * (n - int(0.8 * n))
    cand = [1.0] * int(0.5 * n) + [0.0] * (n - int(0.5 * n))
    (ref if where == "ref" else cand)[n // 2] = damage
    return value_pair(tmp_path, ref, cand, metric="acc")


@pytest.mark.parametrize("n", [10, 60, 400])
@pytest.mark.parametrize("damage", [math.nan, None, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["ref", "cand"])
def test_a_nan_null_or_infinite_value_is_unusable_input_naming_the_documents(tmp_path, capsys, n, damage, where):
    """Accuracy falls from 0.80 to 0.50: one bad value used to make the row inconclusive or 'not compared' (exit
    0); it is one line naming the task, the metric, the run and the document, exit 2."""
    ref, cand = accuracy_pair(tmp_path, n, damage=damage, where=where)
    assert cli.main([str(ref), str(cand)]) == 2
    err = capsys.readouterr().err
    side = "reference" if where == "ref" else "candidate"
    assert err.count("\n") == 1 and f"t/acc (none): the {side}'s value is null, NaN or infinite on documents " \
        f"{n // 2};" in err, err


@pytest.mark.parametrize("n", [10, 60, 400])
def test_a_log_likelihood_that_overflowed_is_unusable_input(tmp_path, capsys, n):
    """word_perplexity's (log-likelihood, words) with the candidate's log-likelihood -inf on one document."""
    ref = [(-40.0 - i % 7, 10 + i % 5) for i in range(n)]
    cand = [(ll * 1.5, w) for ll, w in ref]
    cand[3] = (-math.inf, cand[3][1])
    ref_dir, cand_dir = value_pair(tmp_path, ref, cand, metric="word_perplexity", aggregation="weighted_perplexity",
                                   higher_is_better=False)
    assert cli.main([str(ref_dir), str(cand_dir)]) == 2
    assert "t/word_perplexity (none): the candidate's value is null, NaN or infinite on documents 3;" in \
        capsys.readouterr().err


@pytest.mark.parametrize("metric, aggregation, damage, expected", [
    ("acc", "mean", "0.5", "a number"), ("acc", "mean", "abc", "a number"),
    ("word_perplexity", "weighted_perplexity", ["-40.0", 10], "a pair of numbers")])
@pytest.mark.parametrize("where", ["ref", "cand"])
def test_text_where_a_number_belongs_is_unusable_input_naming_the_documents(tmp_path, capsys, metric, aggregation,
                                                                             damage, expected, where):
    """One document's value written as text beside a sound task u: the damaged row was 'not compared' (or
    inconclusive) and the command exited 0 on u alone; it is one line naming the task, metric, run and document."""
    n = 60
    values = [(-40.0 - i % 7, 10 + i % 5) for i in range(n)] if aggregation != "mean" else [1.0] * 48 + [0.0] * 12
    damaged = list(values)
    damaged[7] = damage
    ref, cand = (damaged, values) if where == "ref" else (values, damaged)
    higher = aggregation == "mean"
    runs = [value_run(tmp_path / "m" / side, {"t": {metric: (vs, aggregation, higher)},
                                              "u": {"acc": ([1.0] * n, "mean", True)}})
            for side, vs in (("ref", ref), ("cand", cand))]
    assert cli.main(list(map(str, runs))) == 2
    err = capsys.readouterr().err
    side = "reference" if where == "ref" else "candidate"
    assert err.count("\n") == 1 and f"t/{metric} (none): the {side}'s value is not {expected} on documents 7 " \
        f"(first: {damage!r}); lm-eval's {aggregation} takes {expected} per document" in err, err


@pytest.mark.parametrize("n", [10, 60, 400])
@pytest.mark.parametrize("metric, aggregation, value", [
    ("m", "mean", 1e308), ("m", "mean", -1e308),
    ("word_perplexity", "weighted_perplexity", [-1e308, 10])])
def test_values_whose_sum_overflows_are_unusable_input(tmp_path, capsys, n, metric, aggregation, value):
    """Every candidate value 1e308 (or a log-likelihood of -1e308): finite each, but their sum is inf, so the row
    was inconclusive and the command exited 0. One line naming the task, metric, run and documents."""
    ref = [(-40.0 - i % 7, 10 + i % 5) for i in range(n)] if aggregation != "mean" else [0.5] * n
    ref_dir, cand_dir = value_pair(tmp_path, ref, [value] * n, metric=metric, aggregation=aggregation,
                                   higher_is_better=aggregation == "mean")
    assert cli.main([str(ref_dir), str(cand_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"t/{metric} (none): the candidate's value is too large to add up on " \
        f"documents 0, 1, 2" in err and f"over {n} documents a value must lie within" in err, err


@pytest.mark.parametrize("n", [10, 60, 400])
def test_a_metric_neither_run_scored_on_some_documents_leaves_them_out_and_says_so(tmp_path, capsys, n):
    """Accuracy 0.80 -> 0.50 with the metric missing from the same two documents of both runs: the row is made
    of the rest, says how many were left out, and is worse (it used to vanish, exit 0)."""
    ref = [1.0] * int(0.8 * n) + [0.0] * (n - int(0.8 * n))
    cand = [1.0] * int(0.5 * n) + [0.0] * (n - int(0.5 * n))
    ref[1] = cand[1] = ref[-1] = cand[-1] = MISSING
    ref_dir, cand_dir = value_pair(tmp_path, ref, cand, metric="acc")
    row = row_of(ref_dir, cand_dir)
    assert row.n == n - 2 and f"2 of {n} documents left out: neither run scored acc on them (1, {n - 1})" in row.note
    code = cli.main([str(ref_dir), str(cand_dir)])
    assert code == (1 if n >= 60 else 0) and row.verdict == ("worse" if n >= 60 else "inconclusive")
    assert f"2 of {n} documents left out" in capsys.readouterr().out


@pytest.mark.parametrize("n", [10, 60, 400])
def test_a_metric_only_one_run_scored_on_a_document_is_unusable_input(tmp_path, capsys, n):
    ref = [1.0] * n
    cand = [1.0] * (n // 2) + [0.0] * (n - n // 2)
    cand[4] = MISSING
    assert cli.main(list(map(str, value_pair(tmp_path, ref, cand, metric="acc")))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "t/acc (none): only the reference scored documents 4;" in err


@pytest.mark.parametrize("task, why", [
    ("t", "the samples hold no per-document values of f1 (none)"),
    ("v", "the runs have no samples file of task v")])
def test_a_score_only_results_json_records_is_a_row_not_compared_saying_why(tmp_path, capsys, task, why):
    """results.json records f1 for task t, whose samples hold only acc (or for a task v no samples file is named
    for): the score was ignored unsaid. Its row says it was not compared and why; acc's row is compared as ever."""
    n = 60
    ref_dir, cand_dir = value_pair(tmp_path, [1.0] * 48 + [0.0] * 12, [1.0] * 30 + [0.0] * 30, metric="acc")
    for folder, score in ((ref_dir, 0.7), (cand_dir, 0.65)):
        results = json.loads((folder / "results.json").read_text())
        results["results"].setdefault(task, {}).update({"f1,none": score, "f1_stderr,none": 0.01})
        (folder / "results.json").write_text(json.dumps(results))
    table, _ = paired.compare_runs(on_disk.load_run(ref_dir), on_disk.load_run(cand_dir))
    compared, recorded = table.iloc[0], table.iloc[1]
    assert len(table) == 2 and (compared.metric, compared.n, compared.verdict) == ("acc", n, "worse")
    assert (recorded.task, recorded.metric, recorded.n, recorded.verdict) == (task, "f1", 0, "inconclusive")
    note = f"not compared: results.json records it (reference 0.7, candidate 0.65), but {why}, which the " \
        "comparison is made of"
    assert recorded.note == note and pd.isna(recorded.method)
    assert cli.main([str(ref_dir), str(cand_dir)]) == 1 and f"- {task} / f1 (none): {note}" in capsys.readouterr().out


def test_a_comparison_of_no_row_is_unusable_input(tmp_path, capsys):
    """Every document lacks the metric in both runs: no row at all (it printed an empty table, exit 0)."""
    ref_dir, cand_dir = value_pair(tmp_path, [MISSING] * 20, [MISSING] * 20, metric="acc")
    assert cli.main([str(ref_dir), str(cand_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metric could be compared" in err


def test_the_sweep_report_calls_a_point_with_a_nan_value_not_comparable(tmp_path):
    """The sweep report shares compare_family: a point whose value is NaN is 'not comparable' with the line
    compare gives, the other points compared as before."""
    from evalkit.sweep.points import PointRecord
    from evalkit.sweep.report import compare_points

    n = 60
    ref = [1.0] * 48 + [0.0] * 12
    bad = [1.0] * 30 + [0.0] * 30
    bad[7] = math.nan
    runs = [value_run(tmp_path / "m" / name, {"t": {"acc": (values, "mean", True)}})
            for name, values in (("ref", ref), ("p1", bad), ("p2", [1.0] * 30 + [0.0] * 30))]
    points = [PointRecord(num=i, overrides=[], status="ok", run_dir=str(r), error=None, wall_seconds=None,
                          devices=None, host="test", started="2026-01-01T10:00:00+00:00") for i, r in enumerate(runs)]
    verdicts, _, _ = compare_points(points, 0, tolerance=0.02)
    assert verdicts[1].startswith("not comparable: t/acc (none): the candidate's value is null, NaN or infinite "
                                  "on documents 7;")
    assert list(verdicts[2].verdict) == ["worse"] and len(ref) == n


@pytest.mark.parametrize("n, verdict", [(2, "inconclusive"), (5, "inconclusive"), (30, "inconclusive"),
                                        (199, "inconclusive"), (200, "worse")])
def test_a_mean_of_unbounded_values_is_tested_only_from_200_documents(tmp_path, n, verdict):
    """Every document 0.03 lower (scores around -0.5: absolute, not in [0, 1]): the sign-flip test called 5 such
    documents worse, though no test of a mean of unbounded values holds its level for every shape of change; it
    is read from means.MIN_UNBOUNDED documents on, where it holds on the shapes benchmarks/small_samples.py
    measures, and below that the row is untested and its note says why."""
    ref = -0.5 + np.random.default_rng(n).uniform(-0.3, 0.3, n)
    row = row_of(*value_pair(tmp_path, ref, ref - 0.03))
    assert row.method == "sign-flip" and row.verdict == verdict
    if n < 200:
        assert row.p_floor == 1.0 and row.note.startswith(f"{n} documents of values outside [0, 1]: no test of a mean")
        assert row.ci_low == -math.inf and row.ci_high == math.inf
    else:
        assert row.p_floor == pytest.approx(1 / 10_001) and row.p_worse == pytest.approx(1 / 10_001)


@pytest.mark.parametrize("n", [3, 10, 30, 100])
def test_a_bounded_mean_is_not_equivalent_on_documents_that_could_hide_a_drop(tmp_path, n):
    """Per-document F1 in [0.9, 1] moving by at most 0.005: the bootstrap showed 10 such documents equivalent
    within 0.02, though 10 % of documents dropping to 0 would go unseen a third of the time. Betting shows
    equivalence only from about 200 documents (a 0/1 row: 149); nothing is ever worse here."""
    rng = np.random.default_rng(n)
    ref = rng.uniform(0.9, 1.0, n)
    row = row_of(*value_pair(tmp_path, ref, np.clip(ref + rng.uniform(-0.005, 0.005, n), 0, 1)))
    assert row.method == "betting" and row.verdict == "inconclusive" and row.ci_low < -0.02


@pytest.mark.parametrize("n", [400, 1000])
def test_a_bounded_mean_of_enough_documents_is_equivalent_or_worse(tmp_path, n):
    rng = np.random.default_rng(n)
    ref = rng.uniform(0.9, 1.0, n)
    same = row_of(*value_pair(tmp_path / "same", ref, np.clip(ref + rng.uniform(-0.005, 0.005, n), 0, 1)))
    assert same.method == "betting" and same.verdict == "equivalent" and -0.02 < same.ci_low < same.ci_high < 0.02
    drop = row_of(*value_pair(tmp_path / "drop", ref, np.where(rng.random(n) < 0.1, 0.0, ref)))
    assert drop.verdict == "worse" and drop.ci_high < -0.02


@pytest.mark.parametrize("n", [200])
def test_a_mean_of_skewed_differences_holds_its_level(n):
    """Differences -0.02 + 0.05 (Exp(1) - 1) (true change exactly -tolerance, asymmetric about it) of values
    around 2.5: `worse` at most alpha of the time (400 seeded rows, within 2.5 standard errors). The plain
    sign-flip test, exact only for symmetric differences, was at 0.115-0.155 at 5-30 documents."""
    from lm_eval.api.registry import get_aggregation

    from evalkit.compare.statistics.stats import compare_paired

    rng, mean = np.random.default_rng(n), get_aggregation("mean")

    def worse():
        ref = rng.uniform(2.0, 3.0, n)
        row = compare_paired(ref.tolist(), (ref - 0.02 + 0.05 * (rng.exponential(1.0, n) - 1.0)).tolist(),
                             aggregate=mean, aggregate_name="mean", by_mean=True, higher_is_better=True,
                             tolerance=0.02, iterations=2_000)
        assert row.method == "sign-flip"
        return row.p_worse < 0.05

    assert np.mean([worse() for _ in range(400)]) <= 0.05 + 2.5 * math.sqrt(0.05 * 0.95 / 400)


def perplexity_leaf(rng, n, base):
    """n documents' (log-likelihood, words) in both runs: a word perplexity about base, the candidate's higher by a
    factor exp(log(1.02) + 0.05 (1 - Exp(1))) per document: 2 % in the log on average, now and then a large fall."""
    words = rng.integers(50, 400, n).astype(float)
    per_word = math.log(1 / base) * (1 + 0.1 * rng.normal(size=n))
    rise = math.log1p(0.02) + 0.05 * (1.0 - rng.exponential(1.0, n))
    return ([(float(w * p), float(w)) for w, p in zip(words, per_word)],
            [(float(w * (p - r)), float(w)) for w, p, r in zip(words, per_word, rise)])


@pytest.mark.parametrize("n", [100])
@pytest.mark.parametrize("shape", ["group", "absolute"])
def test_perplexity_rows_a_t_test_read_hold_their_level(n, shape):
    """A group of two word-perplexity leaves of n documents (perplexities about 15 and 40, averaged equally,
    relative) and an absolute word-perplexity row of 2 n documents (tolerance 0.3: 2 % of 15), each exactly at
    its bound with skewed per-document changes: `worse` at most alpha of the time (400 seeded rows, within 2.5
    standard errors), by the sign-flip test weighted by words (and leaves), read from 200 documents on. The
    delta method's t test called them worse 0.115-0.16 of the time at 3-10 documents a leaf."""
    from lm_eval.api.registry import get_aggregation

    from evalkit.compare.statistics import metric_rows, stats
    from evalkit.compare.statistics.verdict import Tolerance

    rng, aggregate = np.random.default_rng(n), get_aggregation("weighted_perplexity")

    def worse() -> bool:
        if shape == "absolute":
            row = stats.compare_paired(*perplexity_leaf(rng, 2 * n, 15.0), aggregate=aggregate,
                                       aggregate_name="weighted_perplexity", by_mean=False, higher_is_better=False,
                                       tolerance=0.3, relative=False, analytic=True, iterations=2_000)
            assert row.method == "sign-flip weighted_perplexity"
            return row.p_worse < 0.05
        pairs = [perplexity_leaf(rng, n, base) for base in (15.0, 40.0)]
        each = [[aggregate(list(side)) for side in pair] for pair in pairs]
        scores = tuple(float(np.mean([e[i] for e in each])) for i in (0, 1))
        _, p, method, _, _ = metric_rows.stratified_reading(
            {}, ["a", "b"], "word_perplexity", pairs, np.array([0.5, 0.5]), scores, each,
            tolerance=Tolerance(0.02, relative=True), higher_is_better=False,
            settings={"confidence": 0.95, "iterations": 2_000, "seed": 0})
        assert method == "sign-flip stratified weighted_perplexity"
        return p["p_worse"] < 0.05

    assert np.mean([worse() for _ in range(400)]) <= 0.05 + 2.5 * math.sqrt(0.05 * 0.95 / 400)


@pytest.mark.parametrize("sizes", [(2, 4, 6), (5, 10, 15), (30, 60, 90)])
def test_a_group_of_mean_leaves_holds_its_level_at_every_size(sizes):
    """Three leaves of unequal sizes averaged equally (weight_by_size: false), differences -0.02 + 0.05 (Exp(1) - 1)
    in each (the group's true change exactly -tolerance): read by the sign-flip test with each document weighted
    by its leaf, `worse` at most alpha of the time (400 seeded rows, within 2.5 standard errors) from 2 documents
    a leaf on (a percentile bootstrap is untested below 30 a leaf, and measured 0.051-0.065 at 50 a leaf)."""
    from evalkit.compare.statistics import metric_rows
    from evalkit.compare.statistics.verdict import Tolerance

    rng = np.random.default_rng(sum(sizes))

    def worse() -> bool:
        pairs = []
        for n in sizes:
            ref = rng.uniform(2.0, 3.0, n)
            pairs.append((ref.tolist(), (ref - 0.02 + 0.05 * (rng.exponential(1.0, n) - 1.0)).tolist()))
        each = [[float(np.mean(side)) for side in pair] for pair in pairs]
        scores = tuple(float(np.mean([e[i] for e in each])) for i in (0, 1))
        _, p, method, _, _ = metric_rows.stratified_reading(
            {}, ["a", "b", "c"], "acc", pairs, np.full(3, 1 / 3), scores, each,
            tolerance=Tolerance(0.02, relative=False), higher_is_better=True,
            settings={"confidence": 0.95, "iterations": 2_000, "seed": 0})
        assert method == "sign-flip stratified"
        return p["p_worse"] < 0.05

    assert np.mean([worse() for _ in range(400)]) <= 0.05 + 2.5 * math.sqrt(0.05 * 0.95 / 400)


@pytest.mark.parametrize("n", [5, 12, 40])
def test_the_sign_flip_p_values_are_scipys(n):
    from scipy.stats import permutation_test

    from evalkit.compare.statistics import means

    d = np.random.default_rng(n).normal(-0.01, 0.05, n)
    test = means.sign_flip(d, draws=20_000, seed=0)
    pseudo = d.max() - d.min()  # the pseudo-document, against the claim
    for bound in (-0.02, 0.0, 0.02):
        for side, alternative, sign in (("below", "less", 1), ("above", "greater", -1)):
            theirs = permutation_test((np.append(d - bound, sign * pseudo),), np.mean, permutation_type="samples",
                                      alternative=alternative, n_resamples=np.inf if n <= 15 else 20_000,
                                      random_state=0).pvalue
            assert test.p(bound, side) == pytest.approx(theirs, abs=1e-12 if n <= 15 else 0.01)
    low, high = test.limits(0.05)  # the interval the tests invert, exactly
    assert test.p(low - 1e-9, "above") < 0.05 <= test.p(low, "above")
    assert test.p(high + 1e-9, "below") < 0.05 <= test.p(high, "below")


@pytest.mark.parametrize("n", [60, 400])
def test_a_tolerance_for_every_task_and_metric_is_honoured(tmp_path, n):
    """--tolerance-for '*/*=0.5' was accepted and ignored: a 30-point drop stayed worse."""
    ref = [1.0] * n
    cand = [1.0] * (n - int(0.3 * n)) + [0.0] * int(0.3 * n)
    ref_dir, cand_dir = value_pair(tmp_path, ref, cand, metric="acc")
    assert cli.main([str(ref_dir), str(cand_dir)]) == 1
    assert cli.main([str(ref_dir), str(cand_dir), "--tolerance-for", "*/*=0.5"]) == 0
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref_dir, cand_dir)), tolerance=cli.tolerances_from(
        type("Args", (), {"tolerance": 0.02, "relative_tolerance": 0.02, "tolerance_for": ["*/*=0.5"]})))
    assert list(table.tolerance) == [0.5] and table.verdict[0] in ("lower", "inconclusive")


def judge_scores(n, seed=0):
    """A judge's score per document, 1 to 10 (mean-aggregated, higher is better), about 8."""
    return np.round(np.random.default_rng(seed).uniform(7.0, 9.0, n), 1)


def test_a_declared_range_tests_a_judge_score_on_few_documents(tmp_path, capsys):
    """40 documents of a judge's score falling by 2 (about -25 %): undeclared, a mean of values outside [0, 1] on
    fewer than 200 documents is untested (exit 0, inconclusive); --range-for t/score=1:10 has it read by betting,
    valid at every size: worse, exit 1."""
    ref = judge_scores(40)
    ref_dir, cand_dir = value_pair(tmp_path, ref, ref - 2.0, metric="score")
    undeclared = row_of(ref_dir, cand_dir)
    assert undeclared.verdict == "inconclusive" and cli.main([str(ref_dir), str(cand_dir)]) == 0
    assert undeclared.note.endswith("where its values are known to lie in a range, --range-for TASK/METRIC=LO:HI has "
                                    "it tested by betting at every size")
    assert cli.main([str(ref_dir), str(cand_dir), "--range-for", "t/score=1:10"]) == 1
    row = row_of(ref_dir, cand_dir, tolerance=Tolerances(ranges={("t", "score"): (1.0, 10.0)}))
    assert row.method == "betting" and row.verdict == "worse" and row.p_floor == 0.0 and row.ci_high < -0.02


@pytest.mark.parametrize("side, value, doc", [("ref", 11.0, 3), ("cand", 0.5, 7)])
def test_a_value_outside_its_declared_range_is_unusable_input_naming_the_document(tmp_path, capsys, side, value,
                                                                                   doc):
    """A range declared 1..10 and a value outside it: the betting test's guarantee rests on the range, so the
    value is refused in one line naming the task, metric, run and document (exit 2), not tested."""
    ref, cand = judge_scores(40), judge_scores(40) - 0.1
    (ref if side == "ref" else cand)[doc] = value
    ref_dir, cand_dir = value_pair(tmp_path, ref, cand, metric="score")
    assert cli.main([str(ref_dir), str(cand_dir), "--range-for", "*/score=1:10"]) == 2
    err = capsys.readouterr().err
    run = "reference" if side == "ref" else "candidate"
    assert err.count("\n") == 1 and err.startswith(
        f"evalkit.compare: error: t/score (none): the {run}'s value on document {doc} ({value!r}) lies outside the "
        "range [1, 10] declared by --range-for")


@pytest.mark.parametrize("option, why", [
    ("t/score=10:1", "needs a task, a metric and finite bounds LO < HI"),
    ("t/score=1", "expected TASK/METRIC=LO:HI"),
    ("t/score=a:b", "expected TASK/METRIC=LO:HI"),
    ("t/scroe=1:10", "--range-for t/scroe: no such task/metric compared"),
    ("t/ppl=-1e9:0", "t/ppl is aggregated by perplexity, not averaged over documents"),
])
def test_a_declared_range_that_cannot_hold_is_a_bad_option(tmp_path, capsys, option, why):
    ref = judge_scores(40)
    runs = [value_run(tmp_path / "m" / name, {"t": {"score": (list(ref), "mean", True),
                                                    "ppl": (list(-ref), "perplexity", False)}})
            for name in ("ref", "cand")]
    assert cli.main([*map(str, runs), "--range-for", option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err


def test_a_groups_declared_range_holds_for_its_tasks_documents(tmp_path, capsys):
    """A range declared for a group (g/score=1:10) holds for the documents of every task in it: a task's value
    outside it is refused, naming the task and document."""
    ref = judge_scores(40)
    cand = ref.copy()
    cand[5] = 12.0
    folders = [value_run(tmp_path / "m" / name, {"a": {"score": (list(values), "mean", True)},
                                                 "b": {"score": (list(ref), "mean", True)}})
               for name, values in (("ref", ref), ("cand", cand))]
    for folder in folders:
        results = json.loads((folder / "results.json").read_text())
        scores = [results["results"][t]["score,none"] for t in ("a", "b")]
        results["groups"], results["group_subtasks"] = {"g": {"score,none": float(np.mean(scores))}}, {"g": ["a", "b"]}
        (folder / "results.json").write_text(json.dumps(results))
    assert cli.main([*map(str, folders), "--range-for", "g/score=1:10"]) == 2
    assert "a/score (none): the candidate's value on document 5 (12.0) lies outside" in capsys.readouterr().err


@pytest.mark.parametrize("n", [17, 21, 1003])
def test_the_drawn_sign_flips_are_summed_exactly_through_the_byte_tables(n):
    """Above 16 documents the signs are random bytes (a bit a document, the last byte's spare bits unused) summed
    through each 8 documents' table of partial sums (two columns' tables gathered at once, a third alone): the sums
    equal those of the signs drawn, for every column (a column of ones, a mean's units, exactly), and no pattern
    counts twice."""
    from evalkit.compare.statistics import means

    rng = np.random.default_rng(n)
    d, u = rng.normal(0.0, 1.0, n), rng.uniform(1.0, 5.0, n)
    (flipped_d, flipped_u, flipped_ones), always = means.flipped_sums([d, u, np.ones(n)], 5000, seed=3)
    groups = -(-n // 8)
    drawn = np.random.default_rng(3).integers(0, 256, size=(5000, groups), dtype=np.uint8)
    drawn[:, -1] &= (1 << (n - 8 * (groups - 1))) - 1
    bits = np.unpackbits(drawn, axis=1, bitorder="little")[:, :n]
    signs = 1 - 2 * bits.astype(float)
    kept = bits.any(axis=1)
    assert always == int((~kept).sum()) and len(flipped_d) == int(kept.sum())
    np.testing.assert_allclose(flipped_d, signs[kept] @ d, rtol=0, atol=1e-9)
    np.testing.assert_allclose(flipped_u, signs[kept] @ u, rtol=0, atol=1e-9)
    assert np.array_equal(flipped_ones, signs[kept].sum(axis=1))  # whole numbers, exactly


def test_the_drawn_sign_flips_are_the_same_on_any_number_of_threads(monkeypatch):
    """Blocks of patterns are drawn in order on one thread and summed on several: the sums, in the order drawn, are
    those of one thread, block for block (8 blocks here, a third still being summed when the next is drawn)."""
    from evalkit.compare.statistics import means

    n, draws = 1003, 5000
    rng = np.random.default_rng(n)
    d, u = rng.normal(0.0, 1.0, n), rng.uniform(1.0, 5.0, n)
    groups = -(-n // 8)
    monkeypatch.setattr(means, "DRAWN_CELLS", 700 * groups)  # blocks of 700 patterns
    found = {}
    for threads in (1, 3):
        monkeypatch.setattr(means, "THREADS", threads)
        found[threads] = means.flipped_sums([d, u], draws, seed=3)
    (one_d, one_u), one_always = found[1]
    (many_d, many_u), many_always = found[3]
    assert one_always == many_always and np.array_equal(one_d, many_d) and np.array_equal(one_u, many_u)
    drawing = np.random.default_rng(3)
    blocks = [drawing.integers(0, 256, size=(min(700, draws - start), groups), dtype=np.uint8)
              for start in range(0, draws, 700)]
    drawn = np.concatenate(blocks)
    drawn[:, -1] &= (1 << (n - 8 * (groups - 1))) - 1
    bits = np.unpackbits(drawn, axis=1, bitorder="little")[:, :n]
    kept = bits.any(axis=1)
    np.testing.assert_allclose(many_d, (1 - 2 * bits[kept].astype(float)) @ d, rtol=0, atol=1e-9)


@pytest.mark.parametrize("values, method, imported", [
    (lambda rng: -0.5 + rng.uniform(-0.3, 0.3, 300), "sign-flip", False),
    (lambda rng: rng.integers(0, 2, 300).astype(float), "tango", True)])
def test_scipy_optimize_is_imported_only_by_a_row_whose_limits_it_finds(tmp_path, values, method, imported):
    """scipy.optimize costs every command 0.07 s to import: compare imports it only where a root is looked for
    (Tango's limits), and a sign-flip row's compare, on the command line, does without it."""
    ref = values(np.random.default_rng(0))
    folders = value_pair(tmp_path, ref, ref[::-1])
    script = ("import sys, contextlib, io; from evalkit.compare import cli; tables = []; family = cli.compare_family\n"
              "cli.compare_family = lambda *a, **k: tables.append(family(*a, **k)) or tables[-1]\n"
              "with contextlib.redirect_stdout(io.StringIO()): code = cli.main(sys.argv[1:])\n"
              "print(code, tables[0][0][0].iloc[0]['method'], 'scipy.optimize' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", script, *map(str, folders), "--output", str(tmp_path / "out")],
                           capture_output=True, text=True, check=True).stdout.split()
    assert found[1:] == [method, str(imported)] and found[0] in ("0", "1")
