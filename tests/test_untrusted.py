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
    """Through Hydra: the points' records, Hydra's multirun.yaml and the sweep report hold no user:password."""
    cmd = [sys.executable, "-m", "evalkit", "-m", f"output_dir={tmp_path}", "tasks=[evalkit_facts]", "limit=2",
           f"endpoint.url={URL}", "max_model_len=100000,200000"]
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
