"""Values that cross a trust boundary (evalkit/untrusted.py) and what evalkit writes: no credential in any file a
run or a sweep writes (a URL's user:password, a secret VLLM_* variable's value), names from a run folder printed
without their control characters, file names that leave a folder refused. Runs with the fake engine; the sweep
through Hydra's basic launcher for real, its points failing before any engine starts.
Run: pytest tests/test_untrusted.py
"""

import json
import subprocess
import sys

import pytest

from evalkit import untrusted
from evalkit.config import Endpoint
from evalkit.sweep import points as sweep_points
from tests.fake_engine import FakeEngine
from tests.test_compare import fake_run

SECRET = "s3cret-pw"
URL = f"http://user:{SECRET}@127.0.0.1:9/v1"


def files_holding(folder, text):
    return [p for p in folder.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_helpers():
    assert untrusted.scrubbed({"a": [URL, "https://h/x?q=a@b", "u=http\\://a\\:b@h\\:1/v1"], "b": 3}) == {
        "a": ["http://127.0.0.1:9/v1", "https://h/x?q=a@b", "u=http\\://h\\:1/v1"], "b": 3}
    assert untrusted.printable("evalkit\x1b]0;owned\x07 \u202eab\tc\n", keep="\n") == \
        "evalkit\\x1b]0;owned\\x07 \\u202eab\\x09c\n"
    env = untrusted.environment({"VLLM_API_KEY": SECRET, "VLLM_CPU_KVCACHE_SPACE": "4", "HF_TOKEN": "x",
                                 "VLLM_HOST": URL}, "VLLM_")
    assert env == {"VLLM_API_KEY": untrusted.NOT_RECORDED, "VLLM_CPU_KVCACHE_SPACE": "4",
                   "VLLM_HOST": "http://127.0.0.1:9/v1"}


HARD = "hunter 2"  # a password with a space, after a user name with an @
HARD_URL = f"http://alice@corp:{HARD}@127.0.0.1:9/v1"


def test_a_user_name_with_an_at_and_a_password_with_spaces_are_scrubbed():
    """Everything before the last @ of a URL's authority goes: a user name may hold an @, a password spaces; a
    URL as Hydra escapes an override, and in a line of text, too. The served engine's messages take the same."""
    from evalkit.engine.served import http

    assert untrusted.scrubbed([HARD_URL, f"endpoint.url='{HARD_URL}'", "u=http\\://a@b\\:pw d@h\\:1/v1 x=1",
                               "ftp://a@b:c d@host", "a@b https://h/p?q=x@y"]) == [
        "http://127.0.0.1:9/v1", "endpoint.url='http://127.0.0.1:9/v1'", "u=http\\://h\\:1/v1 x=1", "ftp://host",
        "a@b https://h/p?q=x@y"]
    assert untrusted.without_credentials(HARD_URL) == http.without_credentials(HARD_URL) == "http://127.0.0.1:9/v1"
    assert [untrusted.literal_password(t) for t in (HARD_URL, "http://alice@corp:${oc.env:PW}@h/v1",
                                                    "http\\://u\\:${oc.env\\:PW}@h", "http://tok@h", "http://h/v1")] \
        == [True, False, False, True, False]


def test_a_sweep_prints_and_records_no_password_of_a_user_name_with_an_at(tmp_path):
    """A sweep whose endpoint.url has a user name with an @ and a password with a space: refused before its folder
    when no point's config can run (ftp://), its line holds no password; run when the config holds (a closed
    port), the points' errors (point.json, the report, stderr), Hydra's launch lines on stdout and multirun.yaml
    hold none either."""
    common = [sys.executable, "-m", "evalkit", "-m", f"output_dir={tmp_path}", "tasks=[evalkit_facts]", "limit=2",
              "engine=served", "endpoint.retries=0", "max_model_len=1000,2000"]
    refused = subprocess.run([*common, f"endpoint.url='{HARD_URL.replace('http://', 'ftp://')}'"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "endpoint.url='ftp://127.0.0.1:9/v1' must start with http:// or https://" in refused.stderr
    assert HARD not in refused.stderr + refused.stdout and not (tmp_path / ".sweeps").exists()
    done = subprocess.run([*common, f"endpoint.url='{HARD_URL}'"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    (folder,) = (tmp_path / ".sweeps").iterdir()
    points = sweep_points.read_points(folder)
    assert [p.error for p in points] == ["the server at http://127.0.0.1:9 refused connections (ConnectError: All "
                                         "connection attempts failed)"] * 2
    assert "#0 : " in done.stdout and "endpoint.url='http://127.0.0.1:9/v1'" in done.stdout
    assert files_holding(tmp_path, HARD) == [] and HARD not in done.stderr + done.stdout


def test_a_sweep_through_submitit_pickles_no_password(tmp_path):
    """submitit pickles each point's config into the sweep folder: a literal password in a URL stops the sweep in
    one line (exit 2) before anything is written; given as ${oc.env:VAR}, each job reads it from the environment
    (its points reach the URL) and no file in the sweep folder, pickles included, holds it."""
    import os

    common = [sys.executable, "-m", "evalkit", "-m", "hydra/launcher=submitit_local", f"output_dir={tmp_path}",
              "tasks=[evalkit_facts]", "limit=2", "engine=served", "endpoint.retries=0", "max_model_len=1000,2000"]
    refused = subprocess.run([*common, f"endpoint.url='{HARD_URL}'"], capture_output=True, text=True, timeout=300)
    assert (refused.returncode, refused.stderr.splitlines()) == (2, [
        "evalkit: error: a URL in this sweep holds a password, which submitit would write into its job files in the "
        "sweep folder; pass it through the environment instead: "
        "endpoint.url='http://USER:${oc.env:VARIABLE}@HOST:PORT/v1'"]), refused.stderr[-3000:]
    assert not tmp_path.exists() or files_holding(tmp_path, HARD) == []
    url = "endpoint.url='http://alice@corp:${oc.env:EVALKIT_TEST_PW}@127.0.0.1:9/v1'"
    done = subprocess.run([*common, url], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "EVALKIT_TEST_PW": HARD})
    assert done.returncode == 1, done.stderr[-3000:]
    (folder,) = (tmp_path / ".sweeps").iterdir()
    assert list(folder.rglob("*.pkl")) and files_holding(tmp_path, HARD) == []
    assert [p.error for p in sweep_points.read_points(folder)] == [
        "the server at http://127.0.0.1:9 refused connections (ConnectError: All connection attempts failed)"] * 2


@pytest.mark.parametrize("name", ["/etc/passwd", "../other/samples.jsonl", "a/../../b", "", None, 3])
def test_a_name_that_leaves_the_folder_is_refused(tmp_path, name):
    with pytest.raises(untrusted.OutsideFolder):
        untrusted.inside(tmp_path, name)


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "samples.jsonl").symlink_to("/etc/hostname")
    with pytest.raises(untrusted.OutsideFolder, match="through a link"):
        untrusted.inside(tmp_path / "run", "samples.jsonl")
    (tmp_path / "run" / "own.jsonl").write_text("{}")
    assert untrusted.inside(tmp_path, "run/own.jsonl") == tmp_path / "run" / "own.jsonl"


def test_a_run_records_no_credential(tmp_path, monkeypatch):
    """endpoint.url with a user:password: results.json and config.yaml hold the URL without it; a sweep point's
    description of this machine names VLLM_API_KEY, never its value."""
    run = fake_run(tmp_path, "a", FakeEngine(), endpoint=Endpoint(url=URL))
    assert files_holding(run, SECRET) == []
    assert json.loads((run / "results.json").read_text())["evalkit"]["config"]["endpoint"]["url"] == \
        "http://127.0.0.1:9/v1"
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    here = sweep_points.described_here({"environment": {}}, machine={})
    assert here["environment"]["VLLM_API_KEY"] == untrusted.NOT_RECORDED


def test_a_sweep_records_no_credential(tmp_path):
    """Through Hydra: the points' records, Hydra's multirun.yaml and the sweep report hold no user:password (the
    points fail at the closed port)."""
    cmd = [sys.executable, "-m", "evalkit", "-m", f"output_dir={tmp_path}", "tasks=[evalkit_facts]", "limit=2",
           "engine=served", "endpoint.retries=0", f"endpoint.url={URL}", "max_model_len=1000,2000"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    (folder,) = (tmp_path / ".sweeps").iterdir()
    assert (folder / "multirun.yaml").is_file() and (folder / "report.csv").is_file()
    assert files_holding(tmp_path, SECRET) == [] and SECRET not in done.stderr
    assert "endpoint.url=http\\://127.0.0.1\\:9/v1" in sweep_points.read_points(folder)[0].overrides


def test_compare_prints_no_terminal_control_from_a_run_folder(tmp_path, capsys):
    """Two runs whose filter name (as a sender could write it) holds an escape sequence that retitles the
    terminal: compare's report on the terminal shows it escaped."""
    from evalkit.compare import cli

    ref, cand = fake_run(tmp_path, "a", FakeEngine()), fake_run(tmp_path, "b", FakeEngine(reply=" 13"))
    for run in (ref, cand):
        for file in [run / "results.json", *run.glob("samples_*.jsonl")]:
            file.write_text(file.read_text().replace("first-integer", "first\\u001b]0;owned\\u0007"))
    capsys.readouterr()
    assert cli.main([str(ref), str(cand)]) == 1
    out = capsys.readouterr().out
    assert "first\\x1b]0;owned\\x07" in out and not any(c in out for c in "\x1b\x07")


@pytest.mark.parametrize("name", ["../../../{other}/{file}", "{absolute}"])
def test_a_samples_file_named_out_of_the_run_folder_is_refused(tmp_path, capsys, name):
    """results.json naming another folder's samples file (or any file) by .. or an absolute path: compare stops
    in one line, exit 2, and reads nothing there."""
    from evalkit.compare import cli

    ref, cand = fake_run(tmp_path, "a", FakeEngine()), fake_run(tmp_path, "b", FakeEngine())
    data = json.loads((cand / "results.json").read_text())
    samples = data["evalkit"]["files"]["samples"]
    task = next(iter(samples))
    own = json.loads((ref / "results.json").read_text())["evalkit"]["files"]["samples"][task]
    samples[task] = name.format(other=ref.relative_to(tmp_path), file=own, absolute=ref / own)
    (cand / "results.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert cli.main([str(ref), str(cand)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "leads out of" in err[0] and "a run folder names only its own files" in err[0], err


def divergence_pair(tmp_path):
    """Two fake-engine runs that recorded their divergence, and the candidate's results.json as data."""
    ref = fake_run(tmp_path, "a", FakeEngine(), divergence_top_k=20, dtype="float32")
    cand = fake_run(tmp_path, "b", FakeEngine(), divergence_top_k=20, dtype="float32")
    return ref, cand, json.loads((cand / "results.json").read_text())


@pytest.mark.parametrize("name", ["../../../{other}/{file}", "{absolute}"])
def test_a_divergence_file_named_out_of_the_run_folder_is_refused(tmp_path, capsys, name):
    """results.json naming another folder's divergence record by .. or an absolute path: compare stops in one
    line, exit 2, and a run given it as divergence_reference fails before its engine starts."""
    from evalkit.compare import cli
    from evalkit.config import ConfigError
    from evalkit.run import reference

    ref, cand, data = divergence_pair(tmp_path)
    files = data["evalkit"]["files"]["divergence"]
    task = next(iter(files))
    own = json.loads((ref / "results.json").read_text())["evalkit"]["files"]["divergence"][task]
    files[task] = name.format(other=ref.relative_to(tmp_path), file=own, absolute=ref / own)
    (cand / "results.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert cli.main([str(ref), str(cand)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "divergence file" in err[0] and "leads out of" in err[0], err
    with pytest.raises(ConfigError, match="leads out of .*a run folder names only its own files"):
        reference.load(str(cand))


def npz_claiming(path, shape):
    """An npz archive of a few hundred bytes whose one array's header claims shape (float32): NumPy allocates
    what a header claims before it reads."""
    import io
    import zipfile

    import numpy as np

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("version.npy", header.getvalue() + b"\0" * 64)


def test_a_divergence_record_that_would_decompress_past_the_bound_is_refused(tmp_path, capsys):
    """A record whose array claims 4 TiB: compare refuses it from its header, in one line naming the bound,
    exit 2, before any allocation (NumPy's load allocates it, or fails with a MemoryError)."""
    from evalkit.compare import cli

    ref, cand, data = divergence_pair(tmp_path)
    for name in data["evalkit"]["files"]["divergence"].values():
        npz_claiming(cand / name, (2**40,))
    capsys.readouterr()
    assert cli.main([str(ref), str(cand)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4.1e+03 GiB decompressed, above the 4 GiB" in err[0], err
    assert untrusted.FILE_LIMIT_VARIABLE in err[0]


def test_a_samples_file_past_the_bound_is_refused(tmp_path, capsys, monkeypatch):
    """A samples file larger than EVALKIT_FILE_LIMIT_GIB (here lowered to 1 MiB; 4 GiB by default): one line,
    exit 2, and no more than the bound is read."""
    from evalkit.compare import cli

    ref, cand = fake_run(tmp_path, "a", FakeEngine()), fake_run(tmp_path, "b", FakeEngine())
    samples = next(cand.glob("samples_*.jsonl"))
    with open(samples, "a") as f:
        f.write("\n" * 2**21)
    monkeypatch.setenv(untrusted.FILE_LIMIT_VARIABLE, str(1 / 1024))
    capsys.readouterr()
    assert cli.main([str(ref), str(cand)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{samples} holds 0.00" in err[0] and "GiB, above the 0.000977 GiB" in err[0], err
    monkeypatch.delenv(untrusted.FILE_LIMIT_VARIABLE)
    assert untrusted.file_limit() == 4 * 2**30


def plant_links(folder, names, victim):
    """A link at each name in folder pointing at victim, as another user of a shared folder could plant them."""
    for name in names:
        (folder / name).symlink_to(victim)


def test_writes_beside_a_run_follow_no_planted_link(tmp_path):
    """A link planted at the temporary names a writer used to pick (its name and process id): the report and
    the sweep's files land in the folder, the file the links point at stays as it was."""
    import os

    from evalkit.run import results

    victim = tmp_path / "victim"
    victim.write_text("mine")
    folder = tmp_path / "run"
    folder.mkdir()
    plant_links(folder, [f".tmp-{n}-{os.getpid()}" for n in ("compare.md", "point.json")], victim)
    results.write_beside(folder, {"compare.md": "report"})
    sweep_points.write_atomic(folder / "point.json", "{}")
    assert victim.read_text() == "mine"
    assert (folder / "compare.md").read_text() == "report" and (folder / "point.json").read_text() == "{}"
    assert oct((folder / "compare.md").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())
    assert sorted(p.name for p in folder.iterdir() if not p.is_symlink()) == ["compare.md", "point.json"]


def current_umask():
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_run_folder_is_built_where_no_planted_link_points(tmp_path):
    """A link at the temporary folder name a run used to build in (run id and process id) pointing elsewhere:
    the run is written into its own folder and nothing appears where the link points."""
    import os

    from evalkit.run import results

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    parent = tmp_path / "out" / "m"
    parent.mkdir(parents=True)
    plant_links(parent, [f".tmp-r1-{os.getpid()}"], elsewhere)
    final = results.write_run(output_dir=str(tmp_path / "out"), model_name="m", run_id="r1",
                              results={"results": {}}, records={}, config_yaml="x: 1\n",
                              evalkit={"counts": {}})
    assert final == parent / "r1" and (final / "config.yaml").read_text() == "x: 1\n"
    assert list(elsewhere.iterdir()) == []


def without_hanging(code, timeout=120):
    """code run by a fresh Python (a hang is a timeout, not a stuck test): its exit status and stderr's lines."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stderr.strip().splitlines()


@pytest.mark.parametrize("what", ["divergence", "divergence_reference", "point.json"])
def test_a_fifo_in_a_received_folder_is_refused_without_waiting(tmp_path, what):
    """A FIFO where a run or sweep folder has a file (opening one to read waits for a writer that never comes):
    compare, the sweep report and a run's divergence_reference refuse it in one line, exit 2, at once."""
    import os

    ref, cand, _ = divergence_pair(tmp_path)
    if what in ("divergence", "divergence_reference"):
        run = ref if what == "divergence_reference" else cand
        names = json.loads((run / "results.json").read_text())["evalkit"]["files"]["divergence"]
        fifo = run / next(iter(names.values()))
        fifo.unlink()
        os.mkfifo(fifo)
    if what == "divergence_reference":
        code, err = without_hanging(f"from evalkit.run import reference; reference.load({str(ref)!r})")
        assert code == 1 and err[-1].startswith("evalkit.errors.ConfigError: divergence_reference") \
            and "not a regular file" in err[-1], err
        return
    if what == "divergence":
        code, err = without_hanging(f"from evalkit.compare import cli; raise SystemExit(cli.main([{str(ref)!r}, "
                                    f"{str(cand)!r}]))")
    else:
        folder = tmp_path / "sweep"
        for num, run in ((0, ref), (1, cand)):
            sweep_points.write_point(folder / str(num), sweep_points.PointRecord(
                num=num, overrides=[f"seed={num}"], status="ok", run_dir=str(run), error=None, wall_seconds=1.0,
                devices=None, host="h", started="2026-01-01T10:00:00+00:00"))
        (folder / "1" / "point.json").unlink()
        os.mkfifo(folder / "1" / "point.json")
        code, err = without_hanging(f"from evalkit.sweep.cli import main; raise SystemExit(main([{str(folder)!r}, "
                                    f"'--runs-under', {str(tmp_path)!r}]))")
    assert code == 2 and len(err) == 1 and "not a regular file" in err[0], err


def test_a_results_json_that_links_out_of_its_folder_is_refused(tmp_path, capsys):
    """results.json itself a link to a file elsewhere on this machine (a run folder copied with its links): compare,
    the sweep report and divergence_reference refuse it in one line, exit 2, and show nothing of the file."""
    from evalkit.compare import cli
    from evalkit.config import ConfigError
    from evalkit.run import reference
    from evalkit.sweep.cli import main as report_main

    ref, cand, _ = divergence_pair(tmp_path)
    elsewhere = tmp_path / "private.json"
    (cand / "results.json").rename(elsewhere)
    (cand / "results.json").symlink_to(elsewhere)
    capsys.readouterr()
    assert cli.main([str(ref), str(cand)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "results.json leads out of" in err[0] and "through a link" in err[0], err
    with pytest.raises(ConfigError, match="results.json .*through a link"):
        reference.load(str(cand))
    folder = tmp_path / "sweep"
    for num, run in ((0, ref), (1, cand)):
        sweep_points.write_point(folder / str(num), sweep_points.PointRecord(
            num=num, overrides=[f"seed={num}"], status="ok", run_dir=str(run), error=None, wall_seconds=1.0,
            devices=None, host="h", started="2026-01-01T10:00:00+00:00"))
    assert report_main([str(folder), "--runs-under", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "point 1's" in err[0] and "through a link" in err[0], err
    assert not list(folder.glob("report.*"))


def test_the_sweep_report_reads_no_run_outside_the_sweeps_output_folder(tmp_path, capsys):
    """A received sweep folder's point records name run folders by path: one naming a run elsewhere on this
    machine is not read (its row says where the report reads runs, and how to widen it), so the report shows
    nothing of it; --runs-under a folder that holds it reads it."""
    from evalkit.sweep.cli import main as report_main

    (tmp_path / "mine").mkdir()
    ref, cand, _ = divergence_pair(tmp_path / "mine")  # this machine's own runs
    folder = tmp_path / "received" / ".sweeps" / "20260101-100000"
    for num, run in ((0, ref), (1, cand)):
        sweep_points.write_point(folder / str(num), sweep_points.PointRecord(
            num=num, overrides=[f"seed={num}"], status="ok", run_dir=str(run), error=None, wall_seconds=1.0,
            devices=None, host="h", started="2026-01-01T10:00:00+00:00"))
    assert report_main([str(folder)]) == 0
    capsys.readouterr()
    table = (folder / "report.csv").read_text()
    assert f"lies outside {(tmp_path / 'received').resolve()}, where this report reads runs" in table
    assert "evalkit report --runs-under DIR" in table and not list(folder.glob("compare-*"))
    assert report_main([str(folder), "--runs-under", str(tmp_path / "mine")]) == 0
    capsys.readouterr()
    assert "lies outside" not in (folder / "report.csv").read_text() and (folder / "compare-1-vs-0.md").is_file()
    assert report_main([str(folder), "--runs-under", str(tmp_path / "nothing")]) == 2
    said = capsys.readouterr().err.strip()
    assert said == f"evalkit.report: error: --runs-under {tmp_path / 'nothing'}: not a folder"


@pytest.mark.parametrize("where", ["results.json", "samples"])
@pytest.mark.parametrize("value", ["[" * 100000 + "]" * 100000, "9" * 5000])
def test_json_nested_too_deep_or_a_number_too_long_is_unusable_input_not_worse(tmp_path, capsys, where, value):
    """A received results.json or samples line holding 100,000 nested lists (past the parser's recursion) or a
    5,000-digit integer (past Python's 4,300 digits): compare refuses it in one line, exit 2 (1 means worse), as
    divergence_reference and the sweep report do."""
    from evalkit.compare import cli
    from evalkit.config import ConfigError
    from evalkit.run import reference

    ref, cand, _ = divergence_pair(tmp_path)
    file = cand / "results.json" if where == "results.json" else next(cand.glob("samples_*.jsonl"))
    lines = file.read_text().rstrip("\n").split("\n")
    lines[-1 if where == "results.json" else 0] = lines[-1 if where == "results.json" else 0][:-1] + \
        f', "x": {value}}}'
    file.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert cli.main([str(ref), str(cand)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("nested too deeply" in err[0] or "over 4300 digits" in err[0]), err
    if where == "results.json":
        with pytest.raises(ConfigError, match="nested too deeply|over 4300 digits"):
            reference.load(str(cand))


def test_a_newline_in_a_received_name_starts_no_line(tmp_path, capsys):
    """A task name and a run folder's name holding a newline (and the folder an escape sequence): compare's
    report on the terminal and its .md show them escaped (\\x0a) on their own line, never as a line of their own
    (a heading, a table row), and still compare the task."""
    from evalkit.compare import cli

    ref, cand = fake_run(tmp_path, "a", FakeEngine()), fake_run(tmp_path, "b", FakeEngine(reply=" 13"))
    odd = cand.rename(cand.parent / "run\x1b]0;owned\x07\n# Folder heading")
    for run in (ref, odd):
        data = json.loads((run / "results.json").read_text())
        new = "evalkit_arith\n## Injected heading"
        for section in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "task_hashes"):
            if isinstance(data.get(section), dict) and "evalkit_arith" in data[section]:
                data[section][new] = data[section].pop("evalkit_arith")
        files = data["evalkit"]["files"]["samples"]
        files[new] = files.pop("evalkit_arith")
        (run / "results.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert cli.main([str(ref), str(odd), "--output", str(tmp_path / "out")]) == 1  # arithmetic is worse
    shown = capsys.readouterr().out
    (md,) = (tmp_path / "out").glob("*.md")
    for text in (shown, md.read_text()):
        lines = text.splitlines()
        assert not [line for line in lines if line.startswith(("## Injected", "# Folder", "| ## Injected"))], text
        assert any("evalkit_arith\\x0a## Injected heading" in line and "worse" in line for line in lines), text
        assert "\x1b" not in text and "run\\x1b]0;owned\\x07\\x0a# Folder heading" in text
