"""`evalkit.compare` on hand-made runs: paired 0/1 tables whose verdicts are known, several candidates as one
family, refusals of unlike runs, per-task tolerances, groups with lm-eval's weighting, and --locate's floor.
Run: pytest tests/test_compare_verdicts.py
"""

import json
import math

import numpy as np
import pytest

from evalkit.compare import cli
from evalkit.compare.statistics import paired
from evalkit.compare import runs as on_disk


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


def test_one_drop_passes_among_59_noisy_tasks_and_fails_among_59_unchanged_ones(tmp_path):
    """8 of 100 documents lost: p_worse 0.009 against -0.02, below 0.05 alone. Among 59 tasks where 2 documents
    flip each way (rows that could be worse) Holm asks it to be below 0.05 / 60 = 0.00083: it passes. Among 59
    tasks where no document changed (rows that cannot be worse) nothing dilutes it: it fails as alone (on Holm
    over all 60 rows it passed)."""
    alone = hand_pair(tmp_path / "alone", {"t00": (8, 0, 100)})
    assert cli.main(list(map(str, alone))) == 1
    noisy = hand_pair(tmp_path / "noisy", {f"t{i:02d}": (8, 0, 100) if i == 0 else (2, 2, 100) for i in range(60)})
    assert cli.main(list(map(str, noisy))) == 0
    table, _ = paired.compare_runs(*map(on_disk.load_run, noisy))
    assert table.p_worse[0] == pytest.approx(0.00899, abs=1e-4) and table.p_worse_holm[0] == pytest.approx(
        60 * table.p_worse[0])  # Holm: the smallest p-value times the rows that could reach
    tasks = {f"t{i:02d}": (8, 0, 100) if i == 0 else (0, 0, 100) for i in range(60)}
    unchanged = hand_pair(tmp_path / "unchanged", tasks)
    assert cli.main(list(map(str, unchanged))) == 1
    table, _ = paired.compare_runs(*map(on_disk.load_run, unchanged))
    assert list(table.verdict[:1]) == ["worse"] and table.p_worse_holm[0] == pytest.approx(table.p_worse[0])
    assert set(table.verdict[1:]) == {"inconclusive"} and (table.p_worse_holm[1:] == 1).all()


@pytest.mark.parametrize("copies", [1, 2, 5, 19])
@pytest.mark.parametrize("b, n, code", [(8, 100, 1), (3, 30, 0), (40, 400, 1)])
def test_copies_of_the_reference_do_not_dilute_a_candidate(tmp_path, b, n, code, copies):
    """A candidate `worse` alone stays `worse` (exit 1) with copies of the reference compared beside it: their
    rows, where no document changed, cannot be worse or better (Tarone). On Holm over every row, two copies
    made 8 of 100 lost (p 0.009) and 40 of 400 (p 0.02) `inconclusive`, exit 0; 3 of 30 is not `worse` even
    alone (p 0.09), with or without copies."""
    ref = hand_run(tmp_path / "m" / "ref", {"t": (b, 0, n)}, side="ref")
    cand = hand_run(tmp_path / "m" / "cand", {"t": (b, 0, n)}, side="cand")
    same = hand_run(tmp_path / "m" / "same", {"t": (b, 0, n)}, side="ref")
    alone = cli.main([str(ref), str(cand)])
    assert cli.main([str(ref), str(cand), *[str(same)] * copies]) == alone == code
    runs = [on_disk.load_run(path) for path in (ref, cand, *[same] * copies)]
    tables = [table for table, _ in paired.compare_family(runs[0], runs[1:])]
    assert [t.verdict[0] for t in tables[1:]] == ["equivalent" if n >= 149 else "inconclusive"] * copies


def test_noisy_candidates_are_still_one_family(tmp_path):
    """Candidates whose documents change (each could be worse) are each a row Holm counts: 20 candidates each
    losing 8 of 100, one row each: 0.009 * 20 > 0.05, exit 0; one alone: exit 1."""
    ref = hand_run(tmp_path / "m" / "ref", {"t": (8, 0, 100)}, side="ref")
    cand = hand_run(tmp_path / "m" / "cand", {"t": (8, 0, 100)}, side="cand")
    assert cli.main([str(ref), str(cand)]) == 1
    assert cli.main([str(ref), *[str(cand)] * 20]) == 0


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
    assert group.method == ("tango" if weighted else "sign-flip stratified") and group.n == 40
    assert ("weight_by_size" in group.note) and ("equally" in group.note) != weighted


@pytest.mark.parametrize("scores, why", [
    ({"ref": 0.123, "cand": 0.123}, "not compared: the reference's score of group g (0.123) is neither its 2 tasks' "
     "mean by size (0.975) nor their plain mean (0.95), the two ways lm-eval scores a group; its tasks' own rows are "
     "compared"),
    ({"ref": 0.975, "cand": 0.95}, "not compared: the reference's score of group g is its tasks' mean by size, the "
     "candidate's their plain mean: the runs weighted it differently"),
    ({"ref": 0.975, "cand": None}, "not compared: the candidate's results.json has no score acc,none of group g")])
def test_a_group_score_lm_eval_could_not_have_given_is_a_row_not_compared_saying_why(tmp_path, capsys, scores, why):
    """A group score that is no mean of its leaves (not ours to guess how it was made) used to leave the group out
    of the table unsaid; its row says it was not compared and why, and the leaves are compared as ever."""
    tasks = {"a": (1, 1, 10), "b": (0, 0, 30)}  # 0.9 and 1 in both runs: by size 39/40 = 0.975, plainly 0.95
    ref, cand = (hand_run(tmp_path / "m" / s, tasks, side=s, groups={"g": {"tasks": ["a", "b"], "acc,none": scores[s]}})
                 for s in ("ref", "cand"))
    table, _ = paired.compare_runs(on_disk.load_run(ref), on_disk.load_run(cand))
    assert list(table.task) == ["a", "b", "g"] and list(table.method.isna()) == [False, False, True]
    group = table.iloc[2]
    assert group.verdict == "inconclusive" and group.n == 0 and why in group.note, group.note
    assert cli.main([str(ref), str(cand)]) == 0 and f"- g / acc (none): {why}" in capsys.readouterr().out


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


def add_rolling_task(folder, task, log_likelihoods, words, *, metrics=("word_perplexity", "byte_perplexity",
                                                                        "bits_per_byte")):
    """A wikitext-shaped task added to a hand-made run: per document (log-likelihood, words) for every metric
    (bytes = 5 words), aggregated as lm-eval's wikitext aggregates them, lower is better."""
    from lm_eval.api.registry import get_aggregation

    aggregations = {"word_perplexity": "weighted_perplexity", "byte_perplexity": "weighted_perplexity",
                    "bits_per_byte": "bits_per_byte"}
    lines = [{"doc_id": i, "filter": "none", "metrics": list(metrics), "doc_hash": f"d{i}", "prompt_hash": f"p{i}",
              "target_hash": f"t{i}", **{m: [ll, w * (1 if m == "word_perplexity" else 5)] for m in metrics}}
             for i, (ll, w) in enumerate(zip(log_likelihoods, words))]
    (folder / f"samples_{task}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    results = json.loads((folder / "results.json").read_text())
    results["results"][task] = {f"{m},none": get_aggregation(aggregations[m])([tuple(s[m]) for s in lines])
                                for m in metrics}
    results["configs"][task] = {"metric_list": [{"metric": m, "aggregation": aggregations[m]} for m in metrics]}
    results["higher_is_better"][task] = {m: False for m in metrics}
    results["n-shot"][task], results["versions"][task] = 0, 1.0
    results["evalkit"]["files"]["samples"][task] = f"samples_{task}.jsonl"
    (folder / "results.json").write_text(json.dumps(results))


def wikitext_pair(tmp_path, acc_tasks, *, perplexity=(12.0, 150.0), documents=200, seed=0):
    """acc_tasks unchanged 0/1 tasks of 100 documents and wikitext whose word perplexity goes from
    perplexity[0] to perplexity[1] (documents of 50 to 400 words, each a little off the mean)."""
    rng = np.random.default_rng(seed)
    words = rng.integers(50, 400, size=documents)
    jitter = rng.normal(0.0, 0.1, size=documents)
    jitter -= np.average(jitter, weights=words)  # the corpus perplexity exactly perplexity[i]
    tasks = {f"t{i:02d}": (0, 0, 100) for i in range(acc_tasks)}
    ref, cand = hand_pair(tmp_path, tasks)
    for folder, ppl in zip((ref, cand), perplexity):
        add_rolling_task(folder, "wikitext", (-math.log(ppl) * (1 + jitter) * words).tolist(), words.tolist())
    return ref, cand


def test_a_perplexity_rise_is_worse_among_60_rows(tmp_path, capsys):
    """57 unchanged tasks and wikitext's three perplexity rows: word perplexity 12 -> 150 must fail. A bootstrap
    of 1,000 resamples could not (its p-value is at least 1/1001, times 60 rows by Holm: 0.06)."""
    ref, cand = wikitext_pair(tmp_path, 57)
    assert cli.main([str(ref), str(cand)]) == 1
    out = capsys.readouterr().out
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref, cand)))
    rows = table.set_index("metric").loc[["word_perplexity", "byte_perplexity", "bits_per_byte"]]
    assert len(table) == 60 and set(rows.verdict) == {"worse"} and rows.p_floor.max() < 0.05 / 60
    assert rows.loc["word_perplexity", "method"] == "sign-flip weighted_perplexity"
    assert rows.loc["word_perplexity", ["reference", "candidate"]].tolist() == pytest.approx([12.0, 150.0])
    assert "| wikitext" in out and "worse" in out


def test_few_iterations_leave_no_row_blind(tmp_path):
    """--iterations 100 and 6 rows: a bootstrap p-value of 1/101 times 6 rows is 0.059, above 0.05."""
    ref, cand = wikitext_pair(tmp_path, 3)
    assert cli.main([str(ref), str(cand), "--iterations", "100"]) == 1


def f1_pair(tmp_path, tasks, every=3):
    """Hand-made 0/1 tasks and `cls`, 300 documents of F1 (lm-eval's f1_score, re-aggregated on every resample),
    the candidate's prediction flipped on every `every`-th document."""
    ref, cand = hand_pair(tmp_path, tasks)
    for folder, shift in ((ref, 0), (cand, 1)):
        lines = [{"doc_id": i, "filter": "none", "metrics": ["f1"], "f1": [i % 2, (i + shift * (i % every == 0)) % 2],
                  "doc_hash": f"d{i}", "prompt_hash": f"p{i}", "target_hash": f"t{i}"} for i in range(300)]
        (folder / "samples_cls.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        results = json.loads((folder / "results.json").read_text())
        results["results"]["cls"], results["configs"]["cls"] = {"f1,none": 0.5}, {}
        results["higher_is_better"]["cls"], results["n-shot"]["cls"], results["versions"]["cls"] = {"f1": True}, 0, 1
        results["evalkit"]["files"]["samples"]["cls"] = "samples_cls.jsonl"
        (folder / "results.json").write_text(json.dumps(results))
    return ref, cand


def test_a_corpus_row_says_when_its_resolution_limits_it(tmp_path):
    """F1 is re-aggregated on every resample, so its resamples stop at 1,000: among 60 rows the note says that a
    p-value of at least 1/1001 cannot reach 0.05 / 59 (Tarone's count: the other rows change, so each could be
    worse, and this one cannot reach)."""
    ref, cand = f1_pair(tmp_path, {f"t{i:02d}": (2, 2, 100) for i in range(59)})
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref, cand)))
    row = table.set_index("task").loc["cls"]
    assert row.method == "bootstrap f1_score" and row.p_floor == pytest.approx(1 / 1001)
    assert row.verdict == "inconclusive" and "resolution: its p-values cannot go below 0.001" in row.note
    assert "Holm over 59 rows that could be worse needs 0.00085 (0.00083 over all 60 for equivalent)" in row.note


@pytest.mark.parametrize("unchanged", [1, 20, 59])
def test_a_corpus_row_beside_unchanged_ones_is_adjusted_over_itself(tmp_path, unchanged):
    """Beside tasks where no document changed, the F1 row is the only one that could be worse: Tarone's screen
    adjusts its p-value over itself alone, so its 1,000 resamples are enough and it is `worse`."""
    ref, cand = f1_pair(tmp_path, {f"t{i:02d}": (0, 0, 100) for i in range(unchanged)})
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref, cand)))
    assert table.set_index("task").loc["cls"].verdict == "worse" and not table.note.str.contains("resolution").any()
    assert cli.main([str(ref), str(cand)]) == 1


@pytest.mark.parametrize("unchanged", [50, 59])
def test_the_resolution_note_counts_only_rows_that_could_be_worse(tmp_path, unchanged):
    """An F1 row that changed a little (6 of 300 documents) beside unchanged tasks: `worse` and `better` are
    adjusted over it alone (Tarone's count: 1), which its 1,000 resamples can reach; only `equivalent`, adjusted
    over every row, is beyond them. The note said that it could be shown none of the three, over all the rows."""
    ref, cand = f1_pair(tmp_path, {f"t{i:02d}": (0, 0, 100) for i in range(unchanged)}, every=50)
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref, cand)))
    row = table.set_index("task").loc["cls"]
    assert row.verdict == "inconclusive" and (table.note.str.contains("resolution").sum() == 1)
    assert (f"Holm over 1 row that could be worse needs 0.05 ({0.05 / (unchanged + 1):.2g} over all {unchanged + 1} "
            "for equivalent): this row cannot be shown equivalent here") in row.note


def perplexity_group(tmp_path, rise, *, leaves=4, documents=62):
    """A group of `leaves` wikitext-shaped leaves averaged equally (weight_by_size: false, as lm-eval's
    uncheatable_eval), the candidate's word perplexity `rise` times the reference's on every leaf, give or take
    0.3 % per document."""
    rng = np.random.default_rng(1)
    ref, cand = hand_pair(tmp_path, {})
    names = [f"leaf{k}" for k in range(leaves)]
    for name in names:
        words = rng.integers(50, 400, size=documents)
        ll = -math.log(rng.uniform(8, 20)) * (1 + rng.normal(0.0, 0.1, size=documents)) * words
        wobble = rng.normal(0.0, 0.003, size=documents)
        add_rolling_task(ref, name, ll.tolist(), words.tolist(), metrics=("word_perplexity",))
        add_rolling_task(cand, name, (ll * (1 + wobble) - math.log(rise) * words).tolist(), words.tolist(),
                         metrics=("word_perplexity",))
    for folder in (ref, cand):
        results = json.loads((folder / "results.json").read_text())
        score = float(np.mean([results["results"][n]["word_perplexity,none"] for n in names]))
        results["groups"] = {"g": {"word_perplexity,none": score}}
        results["group_subtasks"] = {"g": names}
        (folder / "results.json").write_text(json.dumps(results))
    return ref, cand


@pytest.mark.parametrize("rise, verdict, code", [(1.005, "lower", 0), (1.04, "worse", 1)])
def test_a_group_of_perplexity_leaves_is_judged_like_a_perplexity_task(tmp_path, rise, verdict, code):
    """Relative, lower is better, like each leaf: a 0.5 % rise is inside the 2 % tolerance (it was `worse`:
    0.06 in perplexity units against an absolute 0.02); a 4 % rise is beyond it."""
    ref, cand = perplexity_group(tmp_path, rise)
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref, cand)))
    group, leaf = table.set_index("task").loc["g"], table.set_index("task").loc["leaf0"]
    assert group.relative and leaf.relative and group.tolerance == leaf.tolerance == 0.02
    assert group.higher_is_better == False and group["diff"] == pytest.approx(  # noqa: E712
        -(group.candidate / group.reference - 1)) and group["diff"] < 0
    assert group.method == "sign-flip stratified weighted_perplexity" and group.verdict == verdict
    assert cli.main([str(ref), str(cand)]) == code


def add_corpus_task(folder, task, metric, aggregation, items, score):
    """A corpus-level task added to a hand-made run: per document lm-eval's item (a list in the samples file)."""
    lines = [{"doc_id": i, "filter": "none", "metrics": [metric], metric: item, "doc_hash": f"d{i}",
              "prompt_hash": f"p{i}", "target_hash": f"t{i}"} for i, item in enumerate(items)]
    (folder / f"samples_{task}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    results = json.loads((folder / "results.json").read_text())
    results["results"][task] = {f"{metric},none": score}
    results["configs"][task] = {"metric_list": [{"metric": metric, "aggregation": aggregation}]}
    results["higher_is_better"][task], results["n-shot"][task], results["versions"][task] = {metric: True}, 0, 1.0
    results["evalkit"]["files"]["samples"][task] = f"samples_{task}.jsonl"
    (folder / "results.json").write_text(json.dumps(results))


def corpus_group(tmp_path, metric, aggregation, leaf_items):
    """A group averaging its leaves equally (flores_gl's shape), each leaf (reference items, candidate items)."""
    from lm_eval.api.registry import get_aggregation

    ref, cand = hand_pair(tmp_path, {})
    names = [f"leaf{k}" for k in range(len(leaf_items))]
    for folder, side in ((ref, 0), (cand, 1)):
        scores = [get_aggregation(aggregation)(items[side]) for items in leaf_items]
        for name, items, score in zip(names, leaf_items, scores):
            add_corpus_task(folder, name, metric, aggregation, items[side], score)
        results = json.loads((folder / "results.json").read_text())
        results["groups"], results["group_subtasks"] = {"g": {f"{metric},none": float(np.mean(scores))}}, {"g": names}
        (folder / "results.json").write_text(json.dumps(results))
    return ref, cand


def sentences(rng, count):
    words = "the a cat dog sat on mat river runs to sea birds sing in morning she reads book rain falls".split()
    return [" ".join(rng.choice(words, size=rng.integers(8, 20))) for _ in range(count)]


def test_a_bleu_group_is_relative_and_its_resamples_are_sums(tmp_path):
    """BLEU is 0-100: the group row is relative like each leaf's (it was absolute, the reference score passed as
    NaN). Its resamples sum per-segment counts (evalkit/compare/statistics/corpus.py), so they are sized to the family."""
    rng = np.random.default_rng(0)
    leaves = []
    for _ in range(3):
        refs = sentences(rng, 40)
        hyps = [r if i % 4 else " ".join(r.split()[:-2]) for i, r in enumerate(refs)]
        leaves.append(([(r, r) for r in refs], [(r, h) for r, h in zip(refs, hyps)]))
    ref, cand = corpus_group(tmp_path, "bleu", "bleu", leaves)
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref, cand)))
    group, leaf = table.set_index("task").loc["g"], table.set_index("task").loc["leaf0"]
    assert group.relative and leaf.relative and group.method == "bootstrap stratified"
    assert group["diff"] == pytest.approx(group.candidate / group.reference - 1) and group["diff"] < 0
    assert group.p_floor == leaf.p_floor == pytest.approx(1 / 10_001)  # --iterations, above 20 * 4 / 0.05


@pytest.mark.parametrize("documents, verdict", [(2, "inconclusive"), (10, "inconclusive"), (29, "inconclusive"),
                                                (30, "worse"), (60, "worse")])
def test_a_bootstrapped_group_is_tested_only_from_30_documents_a_leaf(tmp_path, documents, verdict):
    """Medians (re-aggregated on every resample) of leaves that all lose 0.3: a percentile bootstrap calls rows
    at the bound worse a quarter of the time at 2 documents, so the group is untested (and says why) until its
    smallest leaf has 30 documents."""
    rng = np.random.default_rng(documents)
    leaves = [(scores.tolist(), (scores - 0.3).tolist()) for scores in (rng.random(documents) for _ in range(3))]
    leaves[0] = (leaves[0][0] * 2, leaves[0][1] * 2)  # a bigger leaf: the smallest one counts
    ref, cand = corpus_group(tmp_path, "score", "median", leaves)
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref, cand)))
    group = table.set_index("task").loc["g"]
    assert group.method == "bootstrap stratified" and group.verdict == verdict
    assert ("a percentile bootstrap does not hold its level on fewer than 30" in group.note) == (documents < 30)
    assert cli.main([str(ref), str(cand)]) == (verdict == "worse")


def test_a_slow_corpus_group_is_bounded_like_a_corpus_row(tmp_path):
    """A median re-aggregates every resample, as chrF, TER, F1 do: a group of such leaves takes at most 1,000
    resamples, as such a task row does (it took all 10,000 of --iterations: hours for flores_gl's BLEU then)."""
    rng = np.random.default_rng(0)
    leaves = [(scores.tolist(), (scores - 0.1 * (rng.random(60) < 0.3)).tolist())
              for scores in (rng.random(60) for _ in range(3))]
    ref, cand = corpus_group(tmp_path, "score", "median", leaves)
    table, _ = paired.compare_runs(*map(on_disk.load_run, (ref, cand)))
    group, leaf = table.set_index("task").loc["g"], table.set_index("task").loc["leaf0"]
    assert group.method == "bootstrap stratified" and group.p_floor == leaf.p_floor == pytest.approx(1 / 1001)
