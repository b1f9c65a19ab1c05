"""Sweeps as Slurm jobs, on a real one-node Slurm started by the tests (tests/clusters/local_slurm.py, the `slurm`
fixture; skipped where Slurm is not installed).

* the sbatch settings docs/sweeps.md gives (partition, cpus, memory, time, GPUs) reach Slurm as written: a
  two-point sweep of tests/sweep_app/app.py through hydra/launcher=evalkit_slurm, read back with
  ``scontrol show job``; each point is a Slurm job that ``sacct`` shows (about 30 s, no vLLM);
* a point cancelled for good (``scancel``) while another runs: hydra/launcher=evalkit_slurm records it failed
  with one line and waits for the other (about 50 s, no vLLM);
* marked engine: a real three-point evalkit sweep through evalkit_slurm whose scores and samples equal the same
  points run on one engine; point 0 gets the time limit's SIGUSR2 mid-scoring (submitit requeues it) and point 1
  is requeued (``scontrol requeue``, SIGTERM then SIGKILL after KillWait, as a preemption): both resume from the
  request store and compute only what was missing; point 2, cancelled for good mid-scoring, is reported failed.

    .venv/bin/python -m pytest tests/test_slurm.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.sweep.points import read_points

APP = Path(__file__).parent / "sweep_app" / "app.py"
SBATCH = ["hydra/launcher=evalkit_slurm", "hydra.launcher.partition=local", "hydra.launcher.cpus_per_task=1",
          "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=7", "hydra.launcher.tasks_per_node=1",
          "hydra.launcher.nodes=1"]


def job_ids(sweep_dir: Path) -> list[str]:
    """The Slurm job of each point, from submitit's folders (``<sweep dir>/.submitit/<job id>/``), by point."""
    folders = [p for p in (sweep_dir / ".submitit").iterdir() if p.is_dir() and "_" in p.name]
    return [p.name for p in sorted(folders, key=lambda p: int(p.name.split("_")[1]))]


def test_points_are_slurm_jobs_with_the_sbatch_settings_as_written(slurm, tmp_path):
    cmd = [sys.executable, str(APP), "-m", *SBATCH, "hydra.launcher.gpus_per_node=1", f"hydra.sweep.dir={tmp_path}",
           "tag=0,1", "sleep=1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=slurm.env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(p.num, p.status) for p in read_points(tmp_path)] == [(0, "ok"), (1, "ok")]
    jobs = job_ids(tmp_path)
    assert len(jobs) == 2
    accounted = wait_for(lambda: ended(slurm, jobs), None, "sacct shows both jobs ended", 60)
    for job in jobs:
        assert accounted[job]["State"] == "COMPLETED" and accounted[job]["NodeList"] == slurm.name, accounted
        shown = slurm.job(job)
        assert (shown["Partition"], shown["NumCPUs"], shown["MinMemoryNode"], shown["TimeLimit"]) == (
            "local", "1", "1G", "00:07:00"), shown
        assert shown["TresPerNode"] == "gres:gpu:1" and shown["NumNodes"] == "1", shown
    script = next((tmp_path / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "#SBATCH --signal=USR2@120\n" in script and "#SBATCH --mem=1GB\n" in script, script


def test_a_point_cancelled_for_good_is_recorded_and_the_sweep_waits_for_the_others(slurm, tmp_path):
    """Point 0 cancelled while it runs and point 1 still runs: the launcher records point 0 failed with one line
    and returns once point 1 has finished (submitit's own wait raises at once for point 0, leaving point 1 to
    run unwatched). The app has no sweep callback: evalkit's report and exit status are the engine test's."""
    cmd = [sys.executable, str(APP), "-m", *SBATCH, f"hydra.sweep.dir={tmp_path}", "tag=0,1", "sleep=40"]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slurm.env)
    wait_for(lambda: (tmp_path / "0" / "pid").is_file() and (tmp_path / "1" / "pid").is_file(), driver, "both ran")
    job = job_ids(tmp_path)[0]
    slurm.run("scancel", job)  # SIGTERM (submitit's job ignores it), SIGKILL KillWait later: no result
    stdout, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 0, stderr[-3000:]
    points = read_points(tmp_path)
    assert [(p.num, p.status) for p in points] == [(0, "failed"), (1, "ok")], points
    assert points[0].error == f"Slurm job {job} ended CANCELLED without a result", points[0]
    assert (f"evalkit: point 0 (tag=0) was not finished: its Slurm job {job} ended CANCELLED; the same command "
            "again runs only the points without results\n") in stderr, stderr[-3000:]


# --- a real evalkit sweep on Slurm (engine) ---

LIMIT = 16
POINTS = ["tasks=[evalkit_arith]", f"limit={LIMIT}", "chunk_size=2", "gpu_memory_utilization=0.25",
          "model_name=p0,p1,p2"]


def lines(path: Path | None) -> int:
    return len(path.read_text().splitlines()) if path and path.exists() else 0


def wait_for(condition, driver: subprocess.Popen | None, what: str, timeout: float = 600):
    """What condition returns once it is something, polled until then; fails when the sweep's driver ended (or
    timeout seconds passed) first."""
    import time

    deadline = time.time() + timeout
    while not (found := condition()):
        assert (driver is None or driver.poll() is None) and time.time() < deadline, f"ended before {what}"
        time.sleep(0.2)
    return found


def ended(slurm, jobs: list[str]) -> dict[str, dict[str, str]] | None:
    """sacct's rows by job once every one of jobs has ended, else None: a point's result is written before its job
    ends, and slurmdbd may lag behind both."""
    rows = {row["JobID"]: row for row in slurm.accounting()}
    running = (None, "PENDING", "RUNNING", "COMPLETING")
    return rows if all(rows.get(job, {}).get("State") not in running for job in jobs) else None


def point_record(sweep_dir: Path, num: int):
    return next((p for p in read_points(sweep_dir) if p.num == num), None)


@pytest.mark.engine
def test_sweep_on_slurm_equals_one_engine_stopped_points_resume_a_cancelled_one_is_reported(slurm, engine, tmp_path):
    """Three points as Slurm jobs, two at a time on the node's two cores, each in a folder of its own (model_name)
    so that its request store is known. Mid-scoring, point 0 gets the notice of its time limit (SIGUSR2, as
    ``--signal=USR2@N`` sends it) and point 1 is requeued (as a preemption): each records that it stopped, runs
    again when Slurm starts it again (point 0 requeued by submitit's handler, which evalkit passes the notice on
    to) and computes only the answers its store lacks. Point 2, cancelled for good mid-scoring, is recorded failed
    with one line; the sweep writes its report and exits 1, and the finished points' samples equal the same
    documents on one engine."""
    from evalkit.config import compose_config
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate
    from evalkit.run.results import read_samples
    from tests.conftest import EAGER

    out = tmp_path / "result"
    cmd = [sys.executable, "-m", "evalkit", "-m", *SBATCH[:4], "hydra.launcher.mem_gb=6", *SBATCH[5:], *POINTS,
           EAGER, f"output_dir={out}"]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slurm.env)
    sweep_dir = wait_for(lambda: next((out / ".sweeps").glob("*/.submitit"), None), driver, "it submitted").parent
    jobs = wait_for(lambda: (lambda found: found if len(found) == 3 else None)(job_ids(sweep_dir)), driver, "jobs")
    stops = {0: ("scancel", "--signal=USR2", jobs[0]), 1: ("scontrol", "requeue", jobs[1]),  # requeue: SIGTERM
             2: ("scancel", jobs[2])}
    enough = {0: 4, 1: 4, 2: 2}  # answers stored before the stop
    store = lambda num: next((out / f"p{num}" / ".requests").glob("*.jsonl"), None)

    stopped, kept = {}, {}  # points 0 and 1 as they first recorded their stop, before their requeued jobs ran

    def watch() -> None:
        for num in {0, 1} - set(stopped):
            record = point_record(sweep_dir, num)
            if record and record.status != "running":
                stopped[num], kept[num] = record, lines(store(num))

    def stop_each_when_it_has_enough() -> bool:
        watch()  # a point stopped first may be requeued and run again while the others reach their stops
        for num in [n for n in stops if lines(store(n)) >= enough[n]]:
            slurm.run(*stops.pop(num))
        return not stops

    wait_for(stop_each_when_it_has_enough, driver, "each point scored part of its documents")
    wait_for(lambda: watch() or len(stopped) == 2, driver, "points 0 and 1 recorded their stops")
    stdout, stderr = driver.communicate(timeout=900)
    assert driver.returncode == 1, stderr[-4000:]  # a failed point: point 2
    assert stopped[0].error.startswith("stopped: by SIGUSR2;"), stopped  # not memory, not retried
    assert stopped[1].error.startswith("stopped: by SIGTERM;"), stopped
    assert all(4 <= kept[num] < LIMIT for num in kept), kept
    assert [int(slurm.job(jobs[num])["Restarts"]) for num in (0, 1, 2)] == [1, 1, 0]
    points = read_points(sweep_dir)
    assert [(p.num, p.status) for p in points] == [(0, "ok"), (1, "ok"), (2, "failed")], points
    assert points[2].error.startswith("stopped: by SIGTERM;"), points[2]  # its own record, kept
    assert (f"evalkit: point 2 (model_name=p2) was not finished: its Slurm job {jobs[2]} ended CANCELLED; the "
            "same command again runs only the points without results\n") in stderr, stderr[-3000:]
    assert "evalkit: sweep report in " in stderr and (sweep_dir / "report.md").is_file()
    for num in (0, 1):
        resumed = json.loads((Path(points[num].run_dir) / "results.json").read_text())["evalkit"]
        assert resumed["resume"]["reused"] >= kept[num], resumed["resume"]
        assert resumed["resume"]["computed"] <= LIMIT - kept[num], resumed["resume"]
        assert [a["status"] for a in resumed["attempts"]] == ["ok"]

    cfg = compose_config(["tasks=[evalkit_arith]", f"limit={LIMIT}", "chunk_size=2", "gpu_memory_utilization=0.25",
                          f"output_dir={tmp_path / 'one'}"])
    one = evaluate(cfg, engine_factory=lambda cfg, model_dir: KeptRunning(engine))
    fields = ("doc_id", "resps", "filtered_resps", "exact_match")
    load = lambda d: [{k: s[k] for k in fields} for s in read_samples(d, "evalkit_arith")]
    for point in points[:2]:
        assert load(Path(point.run_dir)) == load(one), point.num
    print(f"\nstopped after {kept} of {LIMIT} answers; wall seconds {[p.wall_seconds for p in points]}")
