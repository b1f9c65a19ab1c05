"""What `python -m evalkit.compare` tells a pipeline: the interval it shows agrees with the verdict, and its exit
code means one thing (0 pass, 1 a row is worse, 2 unusable input: one line, never a traceback), whatever the
arguments, the files or the folder the report goes to; `python -m evalkit.compare.noise` exits as its
comparison does. Hand-made runs (tests/test_compare_verdicts.py's), run through the command in a subprocess.
Run: pytest tests/test_compare_gate.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.compare import cli
from evalkit.compare.statistics import paired
from evalkit.compare import runs as on_disk
from tests.test_compare_verdicts import hand_pair

ROOT = Path(__file__).resolve().parents[1]


def compare(*args, cwd=None):
    """python -m evalkit.compare ARGS: (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "evalkit.compare", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=300)
    return done.returncode, done.stdout, done.stderr


def one_line_error(code, err, *words):
    assert code == 2 and err.startswith("evalkit.compare: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(word in err for word in words), err


def row_of(tmp_path, b, c, n, tolerance=0.02):
    ref, cand = hand_pair(tmp_path, {"t": (b, c, n)})
    table, _ = paired.compare_runs(on_disk.load_run(ref), on_disk.load_run(cand), tolerance=tolerance)
    (row,) = table.itertuples()
    return ref, cand, row


def test_identical_runs_of_140_documents_show_the_interval_their_verdict_reads(tmp_path):
    """Tango's asymptotic 90 % interval, shown until this change, is +-0.019 here: inside +-0.02 beside an
    `inconclusive` verdict. The exact tests behind the verdict need 149 unflipped documents for +-0.02."""
    ref, cand, row = row_of(tmp_path / "140", 0, 0, 140)
    assert row.verdict == "inconclusive" and row.ci_low < -0.02 and row.ci_high > 0.02  # +-0.0212
    code, out, _ = compare(ref, cand)
    table_line = next(line for line in out.splitlines() if line.startswith("| t "))
    assert code == 0 and "-0.02117" in table_line and "0.02117" in table_line and "inconclusive" in table_line
    ref, cand, row = row_of(tmp_path / "149", 0, 0, 149)
    assert row.verdict == "equivalent" and -0.02 < row.ci_low and row.ci_high < 0.02  # +-0.0199


@pytest.mark.parametrize("b, c, n", [(0, 0, 148), (0, 0, 149), (4, 0, 270), (8, 0, 100), (2, 0, 400), (10, 0, 400),
                                     (0, 12, 200), (0, 40, 200), (6, 6, 600), (30, 12, 1200), (3, 0, 30)])
def test_a_lone_rows_interval_lies_where_its_verdict_says(tmp_path, b, c, n):
    """One row (no family to adjust for): below -tolerance exactly when `worse`, above +tolerance exactly when
    `better`, inside exactly when `equivalent`, `lower` or `higher`."""
    _, _, row = row_of(tmp_path, b, c, n)
    assert (row.verdict == "worse") == (row.ci_high < -0.02)
    assert (row.verdict == "better") == (row.ci_low > 0.02)
    assert (row.verdict in ("equivalent", "lower", "higher")) == (-0.02 < row.ci_low and row.ci_high < 0.02)
    assert (row.verdict == "lower") == (row.ci_high < 0 and -0.02 < row.ci_low)


@pytest.mark.parametrize("args, words", [
    (["--tolerance", "-0.02"], ["--tolerance -0.02", "(0, 1)"]),  # called identical runs worse
    (["--tolerance", "0"], ["--tolerance 0.0"]),
    (["--tolerance", "nan"], ["--tolerance nan"]),
    (["--tolerance", "1.5"], ["--tolerance 1.5"]),
    (["--relative-tolerance", "-0.1"], ["--relative-tolerance -0.1"]),
    (["--relative-tolerance", "nan"], ["--relative-tolerance nan"]),
    (["--tolerance-for", "t/acc=inf"], ["--tolerance-for 't/acc=inf'", "(0, 1)"]),
    (["--tolerance-for", "t/acc=inf%"], ["--tolerance-for 't/acc=inf%'", "a percentage above 0"]),
    (["--tolerance-for", "t/acc=5"], ["--tolerance-for 't/acc=5'", "(0, 1)", "e.g. t/acc=0.02", "t/acc=2%"]),
    (["--tolerance-for", "t/acc=1"], ["--tolerance-for 't/acc=1'", "(0, 1)"]),  # as --tolerance 5 and 1 are
    (["--tolerance-for", "t/acc=-1"], ["--tolerance-for 't/acc=-1'"]),
    (["--alpha", "0"], ["--alpha 0.0"]), (["--alpha", "0.5"], ["--alpha 0.5"]), (["--alpha", "nan"], ["--alpha nan"]),
])
def test_a_bad_tolerance_or_alpha_is_one_line_and_exit_2(tmp_path, capsys, args, words):
    ref, cand = hand_pair(tmp_path, {"t": (0, 0, 200)})
    assert cli.main([str(ref), str(cand), *args]) == 2
    one_line_error(2, capsys.readouterr().err, *words)


def test_a_negative_tolerance_through_the_command(tmp_path):
    ref, cand = hand_pair(tmp_path, {"t": (0, 0, 200)})
    one_line_error(*compare(ref, cand, "--tolerance", "-0.02")[::2], "--tolerance -0.02")


def truncate(file):
    file.write_text(file.read_text()[: len(file.read_text()) // 2])


def drop_doc_id(file):
    lines = file.read_text().splitlines()
    first = json.loads(lines[0])
    del first["doc_id"]
    file.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")


@pytest.mark.parametrize("damage, file, words", [
    (truncate, "results.json", ["results.json: not JSON", "truncated"]),
    (truncate, "samples_t.jsonl", ["samples_t.jsonl, line", "not JSON"]),
    (drop_doc_id, "samples_t.jsonl", ["samples_t.jsonl, line 1: a sample without an integer doc_id"]),
    (lambda f: f.write_text("[1, 2]"), "results.json", ["not an evalkit results file"]),
    (lambda f: f.write_bytes(b"\xff\xfe{"), "results.json", ["results.json: cannot be read"]),
])
def test_an_unusable_run_is_one_line_and_exit_2(tmp_path, damage, file, words):
    ref, cand = hand_pair(tmp_path, {"t": (0, 0, 50)})
    damage(cand / file)
    one_line_error(*compare(ref, cand)[::2], *words)


def test_a_document_twice_in_a_samples_file_is_one_line_and_exit_2(tmp_path, capsys):
    """The candidate's first line again at the end, scored 0: the second line used to replace the first, so the
    comparison read a document the run never scored that way (exit 0). Refused, naming file, task, doc and filter."""
    ref, cand = hand_pair(tmp_path, {"t": (0, 0, 50)})
    lines = (cand / "samples_t.jsonl").read_text().splitlines()
    again = {**json.loads(lines[0]), "acc": 0}
    (cand / "samples_t.jsonl").write_text("\n".join([*lines, json.dumps(again)]) + "\n")
    assert cli.main([str(ref), str(cand)]) == 2
    one_line_error(2, capsys.readouterr().err, "samples_t.jsonl, line 51: task t, doc_id 0, filter 'none' again "
                   "(first on line 1)")


def test_a_samples_file_missing_from_both_runs_is_one_line_and_exit_2(tmp_path, capsys):
    """Task u's samples deleted from both runs: both still had the same tasks, so u was dropped and t compared
    alone (exit 0). Refused, naming the file and the task."""
    ref, cand = hand_pair(tmp_path, {"t": (0, 0, 50), "u": (30, 0, 50)})
    for run in (ref, cand):
        (run / "samples_u.jsonl").unlink()
    assert cli.main([str(ref), str(cand)]) == 2
    one_line_error(2, capsys.readouterr().err, "results.json: names samples_u.jsonl as task u's samples, but the "
                   "folder has no such file (1 of 2 tasks' files missing)")


def block_report(folder, how):
    """Make writing the report into folder fail: read-only (not as root, whom chmod does not stop), or a
    folder already standing where the report file goes (which stops root too)."""
    if how == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        folder.chmod(0o555)
    else:
        (folder / "compare-vs-m-ref.md").mkdir()


@pytest.mark.parametrize("how", ["read-only", "taken"])
@pytest.mark.parametrize("b, expected", [(0, 0), (40, 1)])  # nothing lost: pass; 40 of 200 lost: worse
def test_a_report_that_cannot_be_written_keeps_the_verdicts_exit_code(tmp_path, how, b, expected):
    ref, cand = hand_pair(tmp_path, {"t": (b, 0, 200)})
    block_report(cand, how)
    try:
        code, out, err = compare(ref, cand)
    finally:
        cand.chmod(0o755)
    assert code == expected and "| t " in out and "verdicts: " in out
    assert err.startswith(f"evalkit.compare: the report could not be written to {cand}") and err.count("\n") == 1
    assert "--output DIR" in err and "Traceback" not in err
    assert not [p.name for p in cand.iterdir() if p.name.startswith(".tmp-")]  # nothing half-written left
    code, out, err = compare(ref, cand, "--output", tmp_path / "reports")
    assert code == expected and err == ""
    names = sorted(p.name for p in (tmp_path / "reports").iterdir())
    assert names == ["compare-m-cand-vs-m-ref.html", "compare-m-cand-vs-m-ref.md"]
    assert f"written: {tmp_path / 'reports'}" in out


def test_noise_exits_as_its_comparison_does(tmp_path, monkeypatch, capsys):
    """Two runs of one config that compare cannot read (samples not logged): compare exits 2, so must noise.
    The engine is the deterministic fake (tests/fake_engine.py): what is tested is the exit code."""
    from evalkit.compare import noise
    from evalkit.engine import factory
    from tests.fake_engine import FakeEngine

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    monkeypatch.setattr(factory, "start_engines", lambda cfg, model_dir: FakeEngine())
    code = noise.main(["model_name=fake", f"vllm_path={model}", f"output_dir={tmp_path / 'out'}", "limit=4",
                       "log_samples=false"])
    captured = capsys.readouterr()
    assert "rerun with log_samples=true" in captured.err and "noise pair:" in captured.out
    assert code == 2


@pytest.mark.parametrize("tasks, default, verdicts", [
    ({"t": (3, 0, 20)}, 0, {"inconclusive"}),  # 3 of 20 documents lost: no evidence either way
    ({f"t{i}": (4, 0, 100) for i in range(5)}, 0, {"inconclusive"}),  # 20 points lost over five rows
    ({"t": (0, 0, 400)}, 0, {"equivalent"}),
    ({"t": (0, 40, 400)}, 0, {"better"}),
    ({"t": (40, 0, 200)}, 1, {"worse"}),
])
def test_require_equivalent_fails_unless_every_row_is_shown_inside_or_better(tmp_path, capsys, tasks, default,
                                                                             verdicts):
    """`inconclusive` exits 0 by default; --require equivalent exits 1 unless every row is `equivalent` (or
    `lower`/`higher`, shown inside too) or `better`."""
    ref, cand = hand_pair(tmp_path, tasks)
    table, _ = paired.compare_runs(on_disk.load_run(ref), on_disk.load_run(cand))
    assert set(table.verdict) == verdicts
    assert cli.main([str(ref), str(cand)]) == default
    required = int(not verdicts <= {"equivalent", "better"})
    assert cli.main([str(ref), str(cand), "--require", "equivalent"]) == required


@pytest.mark.parametrize("b, n", [(0, 20), (0, 149), (3, 100), (0, 2000)])
def test_each_row_states_the_smallest_drop_it_could_show(tmp_path, b, n):
    """mde: the tolerance plus the interval's upper half-width, in the table, the report and the page; a drop of
    it would have been `worse` alone, and it shrinks with the documents (about 0.02 + 0.0199 at 149 unflipped)."""
    ref, cand, row = row_of(tmp_path, b, 0, n)
    assert row.mde == pytest.approx(row.tolerance + row.ci_high - row.diff)
    code, out, _ = compare(ref, cand, "--output", tmp_path / "out")
    header = next(line for line in out.splitlines() if line.startswith("| task "))
    assert "mde" in header and f"{row.mde:.4g}" in out
    page = next((tmp_path / "out").glob("*.html")).read_text()
    assert ">mde<" in page
    if n == 149:
        assert row.mde == pytest.approx(0.0399, abs=2e-4)


@pytest.mark.parametrize("unchanged", [0, 3, 59])
def test_the_header_says_which_rows_worse_is_adjusted_over(tmp_path, capsys, unchanged):
    """The promise (a candidate with no change beyond the tolerance fails with probability at most alpha) names
    the rows `worse` is adjusted over: Tarone's screen leaves out unchanged rows (here the `u` tasks), so one
    task losing 10 of 100 documents fails however many unchanged tasks stand beside it."""
    ref, cand = hand_pair(tmp_path, {"t": (10, 0, 100), **{f"u{i:02d}": (0, 0, 100) for i in range(unchanged)}})
    assert cli.main([str(ref), str(cand)]) == 1
    promise = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("- exit code 1"))
    assert f"Holm-adjusted over all {unchanged + 1} rows" in promise
    assert "Tarone's screen leaves out rows where no document changed" in promise
    assert "fails with probability at most 0.05" in promise


def test_the_line_of_a_report_not_written_names_the_command_as_typed(tmp_path):
    """Under `evalkit compare` its lines start `evalkit compare:`, not the module's name."""
    ref, cand = hand_pair(tmp_path, {"t": (0, 0, 200)})
    block_report(cand, "taken")
    done = subprocess.run([sys.executable, "-m", "evalkit.cli", "compare", str(ref), str(cand)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0
    assert done.stderr.startswith(f"evalkit compare: the report could not be written to {cand}")
