"""`evalkit.compare` on runs made through lm-eval with the deterministic fake engine.

The fake answers arithmetic right unless told to reply a fixed text, so the expected flips are known.
tests/compare_tasks/ holds small tasks for the cases evalkit's own two do not have: a metric without a
direction, perplexity (per-document tuples), and a group of two subtasks of different sizes.
Run: pytest tests/test_compare.py
"""

import json
import math
from pathlib import Path

import pytest

from evalkit.compare import cli, paired
from evalkit.compare import runs as on_disk
from evalkit.compare import scoring
from evalkit.compare.verdict import Tolerances
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
    # no document flips, but 12 documents cannot show a change below 0.02: Tango's 90% interval is +-0.184
    assert set(table.verdict) == {"inconclusive"} and (table["diff"] == 0).all()
    assert set(table.method) == {"tango"} and table.ci_high.min() == pytest.approx(2.7055 / (12 + 2.7055), abs=1e-4)
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
    assert page.count("data:image/png;base64,") == 3  # differences, log-prob drift, length shift


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
        assert rows.loc[metric, "method"] == f"bootstrap {aggregation}"
    # same scores in both runs: a zero-width interval, which is no evidence of equivalence
    assert set(rows.verdict) == {"inconclusive"} and all("zero-width" in note for note in rows.note)

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
    assert (rows["diff"] < 0).all() and (rows.ci_high < -0.02).all()  # lower is better: higher is worse
    assert set(rows.verdict) == {"worse"}


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
        row = scoring.compare_values(results, "t", metric, ref, cand, higher_is_better=True,
                                     tolerances=Tolerances(), settings=settings)
        assert row["reference"] == pytest.approx(get_aggregation(aggregation)(ref))
        assert row["candidate"] == pytest.approx(get_aggregation(aggregation)(cand))
        relative = row["candidate"] / row["reference"] - 1 if metric == "bleu" else row["candidate"] - row["reference"]
        assert row["relative"] == (metric == "bleu")  # BLEU is 0-100: relative; F1 is 0-1: absolute
        assert row["diff"] == pytest.approx(relative) and row["diff"] < 0
        assert row["ci_low"] < row["ci_high"] and row["method"].startswith("bootstrap ")


# --- hand-made runs: paired 0/1 tables whose verdicts are known ---------------------------------------------

def hand_run(folder, tasks, *, side, versions=None, groups=None, dtype="float32", resps=None):
    """A run folder as evalkit writes one, by hand: tasks maps a task to (b, c, n), b documents right in the
    reference only, c in the candidate only, the rest right in both; side "ref" or "cand" picks whose scores."""
    folder.mkdir(parents=True)
    results = {"results": {}, "configs": {}, "higher_is_better": {}, "n-shot": {}, "versions": {},
               "groups": groups or {}, "group_subtasks": {g: list(v.pop("tasks")) for g, v in (groups or {}).items()},
               "evalkit": {"files": {"samples": {}}, "engine": {"engine_args": {"dtype": dtype}, "hardware": {}}}}
    for task, (b, c, n) in tasks.items():
        scores = [int(side == "ref")] * b + [int(side == "cand")] * c + [1] * (n - b - c)
        lines = [{"doc_id": i, "filter": "none", "metrics": ["acc"], "acc": s, "doc_hash": f"d{i}",
                  "prompt_hash": f"p{i}", "target_hash": f"t{i}", **({"resps": resps[i]} if resps else {})}
                 for i, s in enumerate(scores)]
        (folder / f"samples_{task}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        results["results"][task] = {"acc,none": sum(scores) / n}
        results["configs"][task] = {"metric_list": [{"metric": "acc", "aggregation": "mean"}]}
        results["higher_is_better"][task], results["n-shot"][task] = {"acc": True}, 0
        results["versions"][task] = (versions or {}).get(task, 1.0)
        results["evalkit"]["files"]["samples"][task] = f"samples_{task}.jsonl"
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def hand_pair(tmp_path, tasks, **kwargs):
    return (hand_run(tmp_path / "m" / "ref", tasks, side="ref", **kwargs),
            hand_run(tmp_path / "m" / "cand", tasks, side="cand", **kwargs))


@pytest.mark.parametrize("b, c, n, tolerance, verdict, code", [
    (4, 0, 270, 0.02, "inconclusive", 0),  # 4 of 270 lost (-1.5 %): a real loss, not shown beyond -2 % (was: worse)
    (40, 0, 200, 0.02, "worse", 1),  # 20 % lost
    (2, 0, 400, 0.05, "equivalent", 0),  # -0.5 %, shown within 5 %, no difference from 0 shown
    (10, 0, 400, 0.05, "lower", 0),  # -2.5 %: a real loss, shown within 5 %
    (0, 0, 40, 0.1, "equivalent", 0),  # nothing flipped in 40: within 10 % (0.9^40 = 1.5 % would show no flip)
    (0, 0, 40, 0.02, "inconclusive", 0),  # ... but not within 2 % (0.98^40 = 45 %)
    (0, 40, 200, 0.02, "better", 0),
])
def test_hand_made_runs_get_the_verdict_their_table_shows(tmp_path, b, c, n, tolerance, verdict, code):
    ref, cand = hand_pair(tmp_path, {"t": (b, c, n)})
    table, _ = paired.compare_runs(on_disk.load_run(ref), on_disk.load_run(cand), tolerance=tolerance)
    assert list(table.verdict) == [verdict] and (table.mcnemar_b[0], table.mcnemar_c[0]) == (b, c)
    assert cli.main([str(ref), str(cand), "--tolerance", str(tolerance)]) == code


def test_one_drop_fails_alone_and_passes_among_59_unchanged_tasks(tmp_path):
    """8 of 100 documents lost: p_worse 0.009 against -0.02, below 0.05 alone; among 60 rows Holm asks it to
    be below 0.05 / 60 = 0.00083. Five such tasks, each one of 100 documents, do not fail either: a run whose
    57 subtasks each lose 5 % of answers to noise now passes."""
    alone = hand_pair(tmp_path / "alone", {"t00": (8, 0, 100)})
    assert cli.main(list(map(str, alone))) == 1
    tasks = {f"t{i:02d}": (8, 0, 100) if i == 0 else (0, 0, 100) for i in range(60)}
    among = hand_pair(tmp_path / "among", tasks)
    assert cli.main(list(map(str, among))) == 0
    table, _ = paired.compare_runs(*map(on_disk.load_run, among))
    assert table.p_worse[0] == pytest.approx(0.00899, abs=1e-4) and table.p_worse_holm[0] == pytest.approx(
        60 * table.p_worse[0])  # Holm: the smallest p-value times the number of rows
    big = hand_pair(tmp_path / "big", {**tasks, "t01": (40, 0, 100)})  # a real collapse still fails
    assert cli.main(list(map(str, big))) == 1


def test_several_candidates_are_one_family(tmp_path):
    ref = hand_run(tmp_path / "m" / "ref", {"t": (8, 0, 100)}, side="ref")
    cand = hand_run(tmp_path / "m" / "cand", {"t": (8, 0, 100)}, side="cand")
    same = hand_run(tmp_path / "m" / "same", {"t": (8, 0, 100)}, side="ref")
    assert cli.main([str(ref), str(cand)]) == 1  # p_worse 0.009 < 0.05
    # with 20 candidates, 20 rows: 0.009 * 20 > 0.05
    assert cli.main([str(ref), str(cand), *[str(same)] * 19]) == 0


@pytest.mark.parametrize("change, message", [
    ("version", "t: task version 1.0 vs 2.0; the runs used different task definitions"),
    ("target", "t: document 3 differs (target_hash)"),
])
def test_other_task_versions_or_targets_are_refused_in_one_line(tmp_path, capsys, change, message):
    ref = hand_run(tmp_path / "m" / "ref", {"t": (0, 0, 10)}, side="ref")
    cand = hand_run(tmp_path / "m" / "cand", {"t": (0, 0, 10)}, side="cand",
                    versions={"t": 2.0} if change == "version" else None)
    if change == "target":
        lines = (cand / "samples_t.jsonl").read_text().splitlines()
        lines[3] = lines[3].replace('"t3"', '"other"')
        (cand / "samples_t.jsonl").write_text("\n".join(lines) + "\n")
    assert cli.main([str(ref), str(cand)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("evalkit.compare: error: ") and message in err


def test_tolerance_for_one_task_and_metric(tmp_path, capsys):
    ref, cand = hand_pair(tmp_path, {"t": (40, 0, 200), "u": (0, 0, 200)})
    assert cli.main([str(ref), str(cand)]) == 1
    assert cli.main([str(ref), str(cand), "--tolerance-for", "t/acc=0.5"]) == 0  # a 20 % drop within 50 %
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref, cand)), tolerance=cli.tolerances_from(
        type("Args", (), {"tolerance": 0.02, "relative_tolerance": 0.02, "tolerance_for": ["*/acc=30%"]})))
    assert list(table.relative) == [True, True] and list(table.tolerance) == [0.3, 0.3]
    capsys.readouterr()
    assert cli.main([str(ref), str(cand), "--tolerance-for", "tt/acc=0.5"]) == 2  # misspelt: refused
    assert "--tolerance-for tt/acc: no such task/metric compared" in capsys.readouterr().err
    assert cli.main([str(ref), str(cand), "--tolerance-for", "t=0.5"]) == 2
    assert "expected TASK/METRIC=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("weighted", [True, False])
def test_a_group_is_scored_with_the_weighting_lm_eval_recorded(tmp_path, weighted):
    """a: 10 documents, all lost; b: 30, none lost. By size the group drops 10/40 = 0.25; equally, 0.5."""
    tasks = {"a": (10, 0, 10), "b": (0, 0, 30)}
    groups = {side: {"g": {"tasks": ["a", "b"], "acc,none": score}} for side, score in
              (("ref", 1.0), ("cand", 0.75 if weighted else 0.5))}
    ref = hand_run(tmp_path / "m" / "ref", tasks, side="ref", groups=groups["ref"])
    cand = hand_run(tmp_path / "m" / "cand", tasks, side="cand", groups=groups["cand"])
    table, _ = paired.compare_runs(on_disk.load_run(ref), on_disk.load_run(cand), iterations=500)
    group = table.set_index("task").loc["g"]
    assert (group.reference, group.candidate, group["diff"]) == (1.0, pytest.approx(groups["cand"]["g"]["acc,none"]),
                                                                 pytest.approx(-0.25 if weighted else -0.5))
    assert group.method == ("tango" if weighted else "bootstrap stratified") and group.n == 40
    assert ("weight_by_size" in group.note) and ("equally" in group.note) != weighted


def test_no_group_row_where_lm_eval_recorded_no_group_score(tmp_path):
    tasks = {"a": (1, 0, 10), "b": (0, 0, 30)}
    groups = {"g": {"tasks": ["a", "b"], "acc,none": 0.123}}  # neither mean of its leaves: not ours to guess
    ref, cand = (hand_run(tmp_path / "m" / s, tasks, side=s, groups=json.loads(json.dumps(groups)))
                 for s in ("ref", "cand"))
    assert list(paired.compare_runs(on_disk.load_run(ref), on_disk.load_run(cand))[0].task) == ["a", "b"]


def test_locate_asks_for_noise_runs_outside_cpu_float32(tmp_path, capsys):
    """Two log-likelihood documents whose chosen answer changes: classifying them needs a noise floor, and the
    default one (1e-4 nats, CPU float32) does not hold for bfloat16: one line asks for --noise."""
    picks = {"ref": [[[[-1.0, False]], [[-2.0, False]]]] * 2, "cand": [[[[-2.0, False]], [[-1.0, False]]]] * 2}
    runs = {s: hand_run(tmp_path / "m" / s, {"t": (0, 0, 2)}, side=s, dtype="bfloat16", resps=picks[s])
            for s in ("ref", "cand")}
    assert cli.main([str(runs["ref"]), str(runs["cand"]), "--locate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measured on CPU float32 and run m/ref ran in dtype bfloat16" in err
    assert "pass --noise RUN_A RUN_B" in err
    noise = [str(runs["ref"]), str(runs["ref"])]
    assert cli.main([str(runs["ref"]), str(runs["cand"]), "--locate", "--noise", *noise]) == 0
    assert "noise floor 0 nats (--noise" in capsys.readouterr().out
