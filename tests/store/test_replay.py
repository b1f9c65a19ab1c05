"""A rerun whose every answer is in the request store starts no engine (evalkit/store/replay.py,
evalkit.engine.wrapper.Deferred), on the real engine through ``python -m evalkit`` as a user reruns:

* the first run starts the engine; the same command again finds the earlier run of its config, reads every
  answer from the store, never imports vLLM's engine, and writes the same scores and samples, its results.json
  saying the engine did not start;
* the custom task's prompt edited (same config, new requests): the rerun starts the engine at its first missing
  answer, says so in one line, and records the engine it started.
Two engine starts (about 30 s each here). Run: pytest -m engine -s tests/store/test_replay.py
"""

import json
import subprocess
import sys
import time

import pytest

from evalkit.run.results import read_samples
from tests.conftest import EAGER, run_dirs
from tests.test_sweep import custom_task

pytestmark = pytest.mark.engine
MODEL = "smollm2-135m-instruct"
STARTING = "evalkit: an answer is not in the request store: starting the engine"


def rerun(out) -> tuple[subprocess.CompletedProcess, object, float]:
    """`python -m evalkit` on sweep_facts and evalkit_arith, resume on (the default): the process, its new run
    folder and its wall seconds."""
    before = set(run_dirs(out / MODEL)) if (out / MODEL).is_dir() else set()
    cmd = [sys.executable, "-m", "evalkit", "tasks=[sweep_facts,evalkit_arith]", f"tasks_dirs=[{out.parent / 'tasks'}]",
           "limit=4", f"output_dir={out}", "gpu_memory_utilization=0.25", EAGER]
    clock = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - clock
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = set(run_dirs(out / MODEL)) - before
    time.sleep(1)  # run folders are named by the second
    return done, run_dir, seconds


@pytest.fixture(scope="module")
def reruns(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "result"
    out.mkdir()
    tasks = custom_task(out.parent / "tasks")
    runs = {"first": rerun(out), "stored": rerun(out)}
    yaml = tasks / "sweep_facts" / "sweep_facts.yaml"
    yaml.write_text(yaml.read_text().replace('doc_to_text: "Question:', 'doc_to_text: "Q:'))  # new requests
    runs["edited"] = rerun(out)
    print("\n" + ", ".join(f"{name} {seconds:.1f} s" for name, (_, _, seconds) in runs.items()))
    return runs


def evalkit_section(run_dir) -> dict:
    return json.loads((run_dir / "results.json").read_text())["evalkit"]


def test_a_rerun_with_every_answer_stored_starts_no_engine_and_writes_the_same_run(reruns):
    (_, first, _), (done, stored, _) = reruns["first"], reruns["stored"]
    section = evalkit_section(stored)
    assert section["engine"]["started"] is False and "started" not in evalkit_section(first)["engine"]
    assert STARTING not in done.stderr and "evalkit: chose " not in done.stderr  # no tuning: no engine start
    assert section["resume"]["computed"] == 0 and section["resume"]["reused"] > 0, section["resume"]
    assert section["provenance"]["model_fingerprint"] == evalkit_section(first)["provenance"]["model_fingerprint"]
    a = json.loads((first / "results.json").read_text())["results"]
    b = json.loads((stored / "results.json").read_text())["results"]
    assert a == b
    for task in ("sweep_facts", "evalkit_arith"):
        assert [s["resps"] for s in read_samples(first, task)] == [s["resps"] for s in read_samples(stored, task)]


def test_a_missing_answer_starts_the_engine_then_and_the_run_records_it(reruns):
    done, edited, _ = reruns["edited"]
    section = evalkit_section(edited)
    assert done.stderr.count(STARTING) == 1, done.stderr[-3000:]
    assert "started" not in section["engine"] and section["engine"]["start_seconds"]
    assert section["resume"]["computed"] > 0 and section["resume"]["reused"] > 0  # arith's answers were stored
    assert all(s["arguments"]["gen_args_0"]["arg_0"].startswith("Q:") for s in read_samples(edited, "sweep_facts"))
