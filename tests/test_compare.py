"""`evalkit.compare` on runs made through lm-eval with the deterministic fake engine.

The fake answers arithmetic right unless told to reply a fixed text, so the expected flips are known.
tests/compare_tasks/ holds small tasks for the cases evalkit's own two do not have: a metric without a
direction, perplexity (per-document tuples), and a group of two subtasks of different sizes.
Hand-made runs whose verdicts are known: tests/test_compare_verdicts.py.
Run: pytest tests/test_compare.py
"""

import json
import math
from pathlib import Path

import pytest

from evalkit.compare import cli
from evalkit.compare.statistics import metric_rows, paired
from evalkit.compare import runs as on_disk
from evalkit.compare.statistics.verdict import Tolerances
from evalkit.config import EvalConfig
from evalkit.run.evaluate import evaluate
from tests.fake_engine import FakeEngine


COMPARE_TASKS = Path(__file__).with_name("compare_tasks")


def fake_run(tmp_path, name, engine, **cfg):
    """A run folder made by evaluate() through lm-eval with the fake engine: the one place runs are built."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    settings = dict(model_name="fake", vllm_path=str(model), output_dir=str(tmp_path / name), limit=12) | cfg
    return evaluate(EvalConfig(**settings), engine_factory=lambda c, d: engine, check_devices=False)


def task_run(tmp_path, name, engine, tasks):
    """A run of tasks in tests/compare_tasks/, all documents. lm-eval loads a group's subtasks itself and reads
    their relative data_files from the working directory, so the run is made from that folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(COMPARE_TASKS)
        return fake_run(tmp_path, name, engine, tasks=tasks, tasks_dirs=[str(COMPARE_TASKS)], limit=None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    return {
        "ref": fake_run(tmp, "a", FakeEngine()),
        "same": fake_run(tmp, "b", FakeEngine()),
        "broken": fake_run(tmp, "c", FakeEngine(reply=" 13")),
        "fewer": fake_run(tmp, "d", FakeEngine(), limit=8),
    }


@pytest.fixture(scope="module")
def task_runs(tmp_path_factory):
    """The reference answers right; the candidate always replies 7 (right on 12 of 20 undirected documents,
    on 10 of 10 in group_a and 6 of 30 in group_b). Perplexity scores do not depend on the reply."""
    tmp = tmp_path_factory.mktemp("task_runs")
    single, group = ["evalkit_cmp_undirected", "evalkit_cmp_rolling"], ["evalkit_cmp_group"]
    return {
        "ref": task_run(tmp, "a", FakeEngine(), single),
        "cand": task_run(tmp, "b", FakeEngine(reply=" 7"), single),
        "group_ref": task_run(tmp, "c", FakeEngine(), group),
        "group_cand": task_run(tmp, "d", FakeEngine(reply=" 7"), group),
    }


def test_identical_runs_of_12_documents_are_inconclusive_and_exit_zero(runs, capsys):
    table, details = paired.compare_runs(on_disk.load_run(runs["ref"]), on_disk.load_run(runs["same"]))
    # no document flips, but 12 documents cannot show a change below 0.02: the 90% interval the exact tests
    # invert is +-0.221 (Tango's asymptotic one, shown until issue 28, +-0.184)
    assert set(table.verdict) == {"inconclusive"} and (table["diff"] == 0).all()
    assert set(table.method) == {"tango"} and table.ci_high.min() == pytest.approx(0.22092, abs=1e-4)
    assert all(not d.generations for d in details)
    assert cli.main([str(runs["ref"]), str(runs["same"])]) == 0
    out = capsys.readouterr().out
    assert "with no flips, ±0.02 needs about 149 documents" in out
    assert f"Holm-adjusted over all {len(table)} rows" in out and "at most 0.05 (family-wise)" in out


def test_a_broken_candidate_is_worse_with_its_flips_and_divergences(runs, capsys):
    ref, cand = on_disk.load_run(runs["ref"]), on_disk.load_run(runs["broken"])
    table, details = paired.compare_runs(ref, cand)
    arith = table[table.task == "evalkit_arith"].iloc[0]
    assert arith.verdict == "worse" and arith["diff"] == pytest.approx(-11 / 12)  # only doc 0 (14-1) is 13
    assert (arith.mcnemar_b, arith.mcnemar_c) == (11, 0) and arith.mcnemar_p == pytest.approx(2 / 2 ** 11)
    (detail,) = [d for d in details if d.task == "evalkit_arith"]
    assert detail.flips["exact_match"]["right_to_wrong"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert detail.flips["exact_match"]["wrong_to_right"] == []
    first = next(g for g in detail.generations if g["doc_id"] == 1)  # " 16" vs " 13": second token
    assert (first["token_index"], first["char_index"], first["reference"], first["candidate"]) == (2, 2, "6", "3")
    facts = table[table.task == "evalkit_facts"]  # log-likelihoods: the reply changes nothing, but 12 documents
    assert set(facts.verdict) == {"inconclusive"} and set(facts.mcnemar_b) == set(facts.mcnemar_c) == {0}
    assert cli.main([str(runs["ref"]), str(runs["broken"])]) == 1
    out = capsys.readouterr().out
    assert "| evalkit_arith" in out and "right -> wrong on 11" in out
    written = sorted(p.name for p in runs["broken"].iterdir() if p.name.startswith("compare-vs-"))
    assert [p.rsplit(".", 1)[1] for p in written] == ["html", "md"]
    page = (runs["broken"] / written[0]).read_text()
    # differences, length shift (3 generations 1 token longer), and the divergence's two plots (default runs
    # record it: KLD percentiles, per-document KLD)
    assert page.count("data:image/png;base64,") == 4
    assert "no log-probability drift above the noise floor" in page  # facts: identical log-likelihoods, no histogram


@pytest.mark.parametrize("other, message", [
    ("fewer", "different documents"),
    ("other_tasks", "different tasks"),
])
def test_unlike_for_like_is_refused(runs, task_runs, other, message, capsys):
    path = task_runs["ref"] if other == "other_tasks" else runs[other]
    with pytest.raises(on_disk.CompareError, match=message):
        paired.compare_runs(on_disk.load_run(runs["ref"]), on_disk.load_run(path))
    assert cli.main([str(runs["ref"]), str(path)]) == 2
    assert capsys.readouterr().err.startswith("evalkit.compare: error: ")


def test_a_changed_prompt_is_refused(runs, tmp_path):
    cand = on_disk.load_run(runs["same"])
    sample = cand.samples["evalkit_arith"][(3, "first-integer")]
    sample["prompt_hash"] = "0" * 64
    with pytest.raises(on_disk.CompareError, match="document 3 differs \\(prompt_hash\\)"):
        paired.compare_runs(on_disk.load_run(runs["ref"]), cand)


def test_not_a_run(tmp_path):
    with pytest.raises(on_disk.CompareError, match="not an evalkit run"):
        on_disk.load_run(tmp_path)


def test_noise_command_rejects_bad_input_in_one_line(capsys):
    from evalkit.compare import noise

    assert noise.main(["max_tokenz=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("evalkit.compare.noise: error: unknown config key 'max_tokenz' (did you mean max_tokens")
    assert err.count("\n") == 1


def test_a_fall_without_a_known_direction_is_changed_never_better(task_runs, capsys):
    ref, cand = on_disk.load_run(task_runs["ref"]), on_disk.load_run(task_runs["cand"])
    assert ref.results["higher_is_better"]["evalkit_cmp_undirected"] == {"exact_match": None}
    table, _ = paired.compare_runs(ref, cand)
    row = table[table.task == "evalkit_cmp_undirected"].iloc[0]
    assert (row.reference, row.candidate, row["diff"]) == (1.0, 0.6, pytest.approx(-0.4))  # unoriented
    assert row.ci_high < -0.02 and row.verdict == "changed" and "direction unknown" in row.note
    assert cli.main([str(task_runs["ref"]), str(task_runs["cand"])]) == 1  # the only failing row
    assert "direction unknown (higher_is_better null)" in capsys.readouterr().out


def test_perplexity_is_compared_through_its_own_aggregation(task_runs):
    ref, cand = on_disk.load_run(task_runs["ref"]), on_disk.load_run(task_runs["cand"])
    table, _ = paired.compare_runs(ref, cand)
    rows = table[table.task == "evalkit_cmp_rolling"].set_index("metric")
    lm_eval = ref.results["results"]["evalkit_cmp_rolling"]
    for metric, aggregation in [("word_perplexity", "weighted_perplexity"),  # named in the task's metric_list
                                ("byte_perplexity", "weighted_perplexity"), ("bits_per_byte", "bits_per_byte")]:
        assert rows.loc[metric, "reference"] == pytest.approx(lm_eval[f"{metric},none"])
        assert rows.loc[metric, "method"] == f"sign-flip {aggregation}"  # lm-eval's aggregation, not resampled
    # fewer than 200 documents: untested, as their log-likelihood changes are unbounded, and no evidence anyway
    n = len(ref.samples["evalkit_cmp_rolling"])
    assert n < 200 and set(rows.verdict) == {"inconclusive"}
    assert all(note.startswith(f"{n} documents whose log-likelihood changes are unbounded") for note in rows.note)

    for sample in cand.samples["evalkit_cmp_rolling"].values():  # a candidate 1.5 times less likely per text
        for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
            sample[metric] = [sample[metric][0] * 1.5, sample[metric][1]]
    rows = paired.compare_runs(ref, cand)[0].set_index("metric").loc[["word_perplexity", "bits_per_byte"]]
    items = [tuple(s["word_perplexity"]) for s in cand.samples["evalkit_cmp_rolling"].values()]
    assert rows.loc["word_perplexity", "candidate"] == pytest.approx(
        math.exp(-sum(ll for ll, _ in items) / sum(words for _, words in items)))
    # unbounded metrics: relative tolerance (2% of the reference's score), diff = candidate / reference - 1
    assert rows.relative.all() and (rows.tolerance == 0.02).all()
    assert rows.loc["word_perplexity", "diff"] == pytest.approx(
        -(rows.loc["word_perplexity", "candidate"] / rows.loc["word_perplexity", "reference"] - 1))
    assert (rows["diff"] < 0).all()  # lower is better: higher is worse
    # ... but on so few documents a rise is not shown worse: zero-inflated or skewed changes could hide anything
    assert set(rows.verdict) == {"inconclusive"} and (rows.ci_high == math.inf).all() and (rows.p_floor == 1).all()


def test_a_group_pools_its_subtasks_documents_by_size(task_runs):
    ref, cand = on_disk.load_run(task_runs["group_ref"]), on_disk.load_run(task_runs["group_cand"])
    table, _ = paired.compare_runs(ref, cand)
    assert list(table.task) == ["evalkit_cmp_group_a", "evalkit_cmp_group_b", "evalkit_cmp_group"]
    group = table.iloc[-1]
    lm_eval = cand.results["groups"]["evalkit_cmp_group"]["exact_match,first-integer"]
    # lm-eval's size-weighted group score: (10 + 6) / 40 = 0.4, not the subtasks' plain mean (1.0 + 0.2) / 2
    assert (group.n, group.reference, group.candidate) == (40, 1.0, pytest.approx(lm_eval)) and lm_eval == 0.4
    assert (group.mcnemar_b, group.mcnemar_c, group.method, group.verdict) == (24, 0, "tango", "worse")
    assert "pooled (weight_by_size" in group.note


def test_corpus_metrics_stored_as_json_lists_go_through_lm_evals_aggregation():
    """bleu (reference, prediction) and f1 (gold, prediction) pairs as a samples file stores them: lists."""
    from lm_eval.api.registry import get_aggregation

    texts = ["the cat sat on the mat", "a dog barks at night", "rain falls on the hills", "she reads a book",
             "the river runs to the sea", "birds sing in the morning"]
    pairs = [({"bleu": [t, t], "f1": [i % 2, i % 2]}, {"bleu": [t, " ".join(t.split()[:-1])], "f1": [i % 2, 1]})
             for i, t in enumerate(texts)]
    results = {"configs": {"t": {"metric_list": [{"metric": "bleu", "aggregation": "bleu"}]}},  # f1: the default
               "higher_is_better": {"t": {"bleu": True, "f1": True}}}
    settings = dict(confidence=0.95, iterations=200, seed=0)
    for metric, aggregation in [("bleu", "bleu"), ("f1", "f1")]:
        ref, cand = paired.metric_values(pairs, metric)
        assert all(isinstance(v, tuple) for v in ref + cand)
        row = metric_rows.compare_values(results, "t", metric, ref, cand, higher_is_better=True,
                                     tolerances=Tolerances(), settings=settings)
        assert row["reference"] == pytest.approx(get_aggregation(aggregation)(ref))
        assert row["candidate"] == pytest.approx(get_aggregation(aggregation)(cand))
        relative = row["candidate"] / row["reference"] - 1 if metric == "bleu" else row["candidate"] - row["reference"]
        assert row["relative"] == (metric == "bleu")  # BLEU is 0-100: relative; F1 is 0-1: absolute
        assert row["diff"] == pytest.approx(relative) and row["diff"] < 0
        assert row["ci_low"] < row["ci_high"] and row["method"].startswith("bootstrap ")
