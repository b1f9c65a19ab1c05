"""The in-run gate (gate.reference=RUN, evalkit/run/gate.py): its checks before any engine starts, and on the real
engine a run that stops as soon as it is decided. Run the engine test under the shared lock:
flock /tmp/evalkit-engine.lock .venv/bin/python -m pytest tests/test_gate.py -q"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.compare.runs import CompareError, Run, check_like_for_like
from evalkit.config import ConfigError, EvalConfig, Gate, validate
from evalkit.harness.tasks import load_tasks
from evalkit.run import gate
from evalkit.run.sequence import Look

from .conftest import run_dirs
from .test_gpu_start import h100, run_on_gpus

TASKS = ["evalkit_arith", "evalkit_facts"]


def config(**gate_values) -> EvalConfig:
    return EvalConfig(model_name="m", vllm_path="embedded://smollm2-135m-instruct", limit=20,
                      gate=Gate(**gate_values))


@pytest.mark.parametrize("values, message", [
    ({"reference": "r", "require": "better"}, "gate.require"),
    ({"reference": "r", "tolerance": 0}, "gate.tolerance=0"),
    ({"reference": "r", "alpha": 1.5}, "gate.alpha=1.5"),
    ({"reference": "r", "chunk": 0}, "gate.chunk=0"),
])
def test_bad_gate_values_fail_in_one_line(values, message):
    with pytest.raises(ConfigError, match=message):
        validate(config(**values))


def test_the_gate_needs_the_request_store_and_the_samples():
    with pytest.raises(ConfigError, match="resume=true"):
        validate(dataclasses.replace(config(reference="r"), resume=False))
    with pytest.raises(ConfigError, match="log_samples=true"):
        validate(dataclasses.replace(config(reference="r"), log_samples=False))


def write_reference(folder, tasks, n, value=1.0, doc_hash="h", prompt_hash="p"):
    """A run folder as results.write_run lays it out: results.json naming one samples file per task."""
    folder.mkdir(parents=True)
    files = {}
    for task, (metric, filt) in tasks.items():
        files[task] = f"samples_{task}.jsonl"
        score = value.get(task, 1.0) if isinstance(value, dict) else value
        lines = [{"doc_id": i, "filter": filt, "metrics": [metric], metric: score, "doc_hash": doc_hash,
                  "prompt_hash": prompt_hash}
                 for i in range(n)]
        (folder / files[task]).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "results.json").write_text(json.dumps({"evalkit": {"run_id": "ref", "files": {"samples": files}}}))


@pytest.fixture(scope="module")
def tasks():
    return load_tasks(TASKS, task_data={}, extra_dirs=[])[1]


def test_a_reference_that_is_not_there_or_of_other_tasks_or_too_short_is_refused(tmp_path, tasks):
    with pytest.raises(ConfigError, match="no such folder"):
        gate.plan(config(reference=str(tmp_path / "nothing")), tasks)
    write_reference(tmp_path / "other", {"evalkit_arith": ("exact_match", "first-integer")}, 20)
    with pytest.raises(ConfigError, match="the gate compares the same tasks"):
        gate.plan(config(reference=str(tmp_path / "other")), tasks)
    both = {"evalkit_arith": ("exact_match", "first-integer"), "evalkit_facts": ("acc", "none")}
    write_reference(tmp_path / "short", both, 10)
    with pytest.raises(ConfigError, match="document 10 is missing"):
        gate.plan(config(reference=str(tmp_path / "short")), tasks)


def test_the_plan_gates_the_rows_in_zero_to_one_in_a_seeded_order(tmp_path, tasks):
    both = {"evalkit_arith": ("exact_match", "first-integer"), "evalkit_facts": ("perplexity", "none")}
    write_reference(tmp_path / "ref", both, 20, value={"evalkit_arith": 0.5, "evalkit_facts": 12.0})
    planned = gate.plan(config(reference=str(tmp_path / "ref")), tasks)
    assert [str(row) for row in planned.rows] == ["evalkit_arith/exact_match [first-integer]"]
    assert sorted(planned.orders["evalkit_arith"]) == list(range(20))
    assert planned.orders == gate.plan(config(reference=str(tmp_path / "ref")), tasks).orders
    assert planned.orders != gate.plan(config(reference=str(tmp_path / "ref"), seed=1), tasks).orders
    write_reference(tmp_path / "unbounded", {t: ("perplexity", "none") for t in TASKS}, 20, value=12.0)
    with pytest.raises(ConfigError, match=r"no row has values in \[0, 1\]"):
        gate.plan(config(reference=str(tmp_path / "unbounded")), tasks)


def test_a_reference_output_holding_a_unicode_line_separator_is_read_as_text(tmp_path, tasks):
    """lm-eval writes samples with their text raw (UTF-8): an output holding U+2028 or \\x85 is one line's text,
    not two lines (str.splitlines would have cut it, and the reference would be refused as damaged)."""
    both = {"evalkit_arith": ("exact_match", "first-integer"), "evalkit_facts": ("acc", "none")}
    write_reference(tmp_path / "ref", both, 20)
    samples = tmp_path / "ref" / "samples_evalkit_arith.jsonl"
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    lines[3]["resps"] = [["12\u2028 and \x85 13"]]
    samples.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    planned = gate.plan(config(reference=str(tmp_path / "ref")), tasks)
    assert sorted(planned.orders["evalkit_arith"]) == list(range(20))


def evalkit(out, *args):
    return subprocess.run([sys.executable, "-m", "evalkit", "limit=40", f"output_dir={out}", *args],
                          capture_output=True, text=True, timeout=1200)


def test_a_bad_reference_fails_the_command_in_one_line_before_any_engine_starts(tmp_path):
    done = evalkit(tmp_path / "result", f"gate.reference={tmp_path / 'nothing'}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (f"evalkit: error: gate.reference={tmp_path / 'nothing'}: no such "
                                                     "folder; name a run folder (result/<model>/<run id>)")
    assert "engine" not in done.stderr.lower()


def perfect_copy(run_dir, where):
    """The reference run with every document's 0-1 score set to 1: a reference the real model is far worse than,
    whose documents (hashes) are the run's own."""
    shutil.copytree(run_dir, where)
    for file in where.glob("samples_*.jsonl"):
        lines = [json.loads(line) for line in file.read_text().splitlines()]
        for line in lines:
            for metric in line["metrics"]:
                line[metric] = line["scores"][metric] = 1.0
        file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return where


@pytest.mark.engine
def test_the_embedded_run_stops_worse_against_a_better_reference_and_says_why(tmp_path):
    """One engine start (the reference run); the gated runs take every answer from its request store."""
    out = tmp_path / "result"
    done = evalkit(out, "divergence_top_k=0")
    assert done.returncode == 0, done.stderr[-3000:]
    (reference,) = run_dirs(out / "smollm2-135m-instruct")
    better = perfect_copy(reference, tmp_path / "better")

    stopped = evalkit(out, "divergence_top_k=0", f"gate.reference={better}", "gate.chunk=10")
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "gate: worse (stopped early: 20 of 80 documents)" in stopped.stdout
    assert "worse than the reference beyond -0.02" in stopped.stdout
    assert "evalkit: gate: 20 of 80 documents (60 left); worst row" in stopped.stderr
    run_dir = next(p for p in run_dirs(out / "smollm2-135m-instruct") if p != reference)
    section = json.loads((run_dir / "results.json").read_text())["evalkit"]
    record = section["gate"]
    assert record["stopped_early"] and record["verdict"] == "worse" and record["documents"] == {t: 10 for t in TASKS}
    assert section["resume"]["computed"] == 0  # every answer from the store
    evaluated = [json.loads(line)["doc_id"] for line in
                 (run_dir / section["files"]["samples"]["evalkit_arith"]).read_text().splitlines()]
    assert sorted(evaluated) == sorted(record["order"]["evalkit_arith"][:10])
    (last,) = record["looks"]
    assert any(row["verdict"] == "worse" and row["high"] < -0.02 for row in last["rows"])
    compared = subprocess.run([sys.executable, "-m", "evalkit.compare", str(better), str(run_dir)],
                              capture_output=True, text=True, timeout=300)
    assert compared.returncode == 2 and "stopped early by its gate (worse after 20 documents" in compared.stderr, \
        compared.stderr

    same = evalkit(out, "divergence_top_k=0", f"gate.reference={reference}", "gate.chunk=15",
                   "gate.require=equivalent")
    assert same.returncode == 0, same.stderr[-3000:]
    assert "gate: equivalent" in same.stdout
    ran = sorted(run_dirs(out / "smollm2-135m-instruct"), key=lambda p: p.stat().st_mtime)[-1]
    record = json.loads((ran / "results.json").read_text())["evalkit"]["gate"]
    assert record["documents"] == {t: 40 for t in TASKS} and not record["stopped_early"]
    assert [look["documents"]["evalkit_arith"] for look in record["looks"]] == [15, 30, 40]
    assert all(row["low"] == pytest.approx(0, abs=1e-6) == row["high"] for row in record["looks"][-1]["rows"])

    # in a sweep, as in one run: 1 when a point's gate says worse; 3 when a point failed and none is worse
    swept = evalkit(out, "-m", "divergence_top_k=0", f"gate.reference={better}", "gate.chunk=10", "gate.seed=0,1")
    assert swept.returncode == 1, swept.stderr[-3000:]
    assert "evalkit: point 0 (gate.seed=0) gate: worse: " in swept.stderr
    assert "evalkit: point 1 (gate.seed=1) gate: worse: " in swept.stderr
    swept = evalkit(out, "-m", "divergence_top_k=0", f"gate.reference={reference}", "gate.chunk=15",
                    "gate.require=equivalent", "max_model_len=4096,100000")
    assert swept.returncode == 3, swept.stderr[-3000:]
    assert "evalkit: point 1 (max_model_len=100000) failed: max_model_len=100000 exceeds" in swept.stderr
    assert " gate: " not in swept.stderr


def one(verdict):
    return Look(n=1, total=2, mean=0.0, low=-1.0, high=1.0, verdict=verdict)


@pytest.mark.parametrize("verdicts, require, finished, expected", [
    (["worse", "equivalent"], "equivalent", False, "worse"),
    (["undecided", "worse"], "not_worse", False, "worse"),
    (["equivalent", "equivalent"], "equivalent", False, "equivalent"),
    (["equivalent", "equivalent"], "not_worse", False, None),  # not_worse stops early only on worse
    (["equivalent", "undecided"], "equivalent", False, None),
    (["better", "equivalent"], "not_worse", True, "not worse"),
    (["better", "equivalent"], "equivalent", True, "not equivalent"),
])
def test_the_family_stops_on_any_worse_row_or_when_every_row_is_equivalent(verdicts, require, finished, expected):
    assert gate.decide([one(v) for v in verdicts], require, finished=finished) == expected


def test_request_records_go_back_under_their_documents_own_indices():
    records = {("a", 0): ["r0"], ("a", 1): ["r1"], ("b", 0): ["s0"]}
    assert gate.renumbered(records, {"a": [3, 7], "b": [5]}) == {("a", 3): ["r0"], ("a", 7): ["r1"], ("b", 5): ["s0"]}


def test_a_document_or_prompt_that_is_not_the_references_stops_the_gate(tmp_path, tasks):
    """The gate pairs documents by index; each pair is checked to be the same document asked the same way."""
    both = {"evalkit_arith": ("exact_match", "first-integer"), "evalkit_facts": ("acc", "none")}
    write_reference(tmp_path / "ref", both, 20, value=1.0)
    planned = gate.plan(config(reference=str(tmp_path / "ref")), tasks)
    row = planned.rows[0]
    first = planned.orders[row.task][0]

    def sample(**fields):
        return [{"doc_id": first, "filter": row.filter, row.metric: 0.0, "doc_hash": "h", "prompt_hash": "p",
                 **fields}]

    assert gate.differences(planned, row, sample()).tolist() == [-1.0]
    with pytest.raises(ConfigError, match="is not the reference's"):
        gate.differences(planned, row, sample(doc_hash="other"))
    with pytest.raises(ConfigError, match="another prompt than the reference's"):
        gate.differences(planned, row, sample(prompt_hash="other"))


def test_compare_refuses_a_run_its_gate_stopped_and_compares_one_it_ran_to_the_end():
    """A stopped run's documents were chosen by when the gate decided: a fixed-n test on them claims too much."""
    samples = {"t": {(0, "none"): {"doc_id": 0, "doc_hash": "h", "prompt_hash": "p", "target_hash": "a"}}}

    def run(name, gated):
        return Run(path=Path("/runs") / name, results={"evalkit": {"gate": gated}}, samples=samples)

    stopped = {"stopped_early": True, "verdict": "worse", "documents": {"t": 1, "u": 2}}
    with pytest.raises(CompareError, match=r"^runs/cand: stopped early by its gate \(worse after 3 documents"):
        check_like_for_like(run("ref", None), run("cand", stopped))
    check_like_for_like(run("ref", None), run("cand", {**stopped, "stopped_early": False}))



def test_a_gated_run_that_fails_exits_3_so_that_1_means_worse_only(tmp_path):
    """The engine's start fails (the recreated GPU machine's vllm.LLM raises): no verdict, and not exit 1."""
    both = {"evalkit_arith": ("exact_match", "first-integer"), "evalkit_facts": ("acc", "none")}
    write_reference(tmp_path / "ref", both, 20)
    done, _ = run_on_gpus(tmp_path, [h100(0, 79 * 2**30)], "resume=true", "oom_retry.enabled=false",
                          f"gate.reference={tmp_path / 'ref'}")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "gate:" not in done.stdout


def test_each_look_evaluates_only_its_new_documents_and_the_decided_prefix_once_more(tmp_path, tasks):
    """lm-eval's work grows with the documents evaluated, not with their square over the looks: each look asks
    for its chunk alone, and the stopped run's results come from one more evaluation of every document drawn."""
    both = {"evalkit_arith": ("exact_match", "first-integer"), "evalkit_facts": ("acc", "none")}
    write_reference(tmp_path / "ref", both, 20, value=1.0)
    planned = gate.plan(config(reference=str(tmp_path / "ref"), chunk=4), tasks)
    asked = []

    class Records:
        records: dict = {}

    def evaluate(samples):
        asked.append(samples and {t: list(s) for t, s in samples.items()})
        lines = {t: [{"doc_id": i, "filter": f, m: 0.0, "doc_hash": "h", "prompt_hash": "p"} for i in docs]
                 for t, (m, f) in both.items() for docs in [samples[t]]}
        return Records(), {"samples": lines}

    _, _, record = gate.run(config(reference=str(tmp_path / "ref"), chunk=4), planned, evaluate)
    assert record["verdict"] == "worse" and record["stopped_early"]
    looks = len(record["looks"])
    assert [sorted(a["evalkit_arith"]) for a in asked[:looks]] == [
        sorted(planned.orders["evalkit_arith"][4 * k:4 * k + 4]) for k in range(looks)]
    assert asked[looks:] == [{t: sorted(o[:4 * looks]) for t, o in planned.orders.items()}]


def test_a_crafted_reference_is_refused_in_one_line_as_compare_refuses_it(tmp_path, tasks):
    """The reference is a folder from elsewhere: JSON nested past the parser's depth, or a results.json that links
    out of its folder, is a ConfigError (exit 2), never a traceback or a read outside it."""
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "results.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        gate.plan(config(reference=str(deep)), tasks)
    both = {"evalkit_arith": ("exact_match", "first-integer"), "evalkit_facts": ("acc", "none")}
    write_reference(tmp_path / "elsewhere", both, 20)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "results.json").symlink_to(tmp_path / "elsewhere" / "results.json")
    with pytest.raises(ConfigError, match=r"results.json leads out of .* \(through a link\)"):
        gate.plan(config(reference=str(linked)), tasks)
