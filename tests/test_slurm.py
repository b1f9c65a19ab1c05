"""Sweeps as Slurm jobs, on a real one-node Slurm started by the tests (tests/clusters/local_slurm.py, the `slurm`
fixture; skipped where Slurm is not installed).

* the sbatch settings docs/sweeps.md gives (partition, cpus, memory, time, GPUs) reach Slurm as written: a
  two-point sweep of tests/sweep_app/app.py through hydra/launcher=submitit_slurm, read back with
  ``scontrol show job``; each point is a Slurm job that ``sacct`` shows (about 30 s, no vLLM);
* marked engine: a real two-point evalkit sweep through submitit_slurm whose scores and samples equal the same
  points run on one engine; one of its points requeued mid-scoring (``scontrol requeue``, SIGTERM then SIGKILL
  after KillWait, as a preemption) resumes from the request store and computes only what was missing.

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
SBATCH = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=local", "hydra.launcher.cpus_per_task=1",
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
    accounted = {row["JobID"]: row for row in slurm.accounting()}
    for job in jobs:
        assert accounted[job]["State"] == "COMPLETED" and accounted[job]["NodeList"] == slurm.name, accounted
        shown = slurm.job(job)
        assert (shown["Partition"], shown["NumCPUs"], shown["MinMemoryNode"], shown["TimeLimit"]) == (
            "local", "1", "1G", "00:07:00"), shown
        assert shown["TresPerNode"] == "gres:gpu:1" and shown["NumNodes"] == "1", shown
    script = next((tmp_path / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "#SBATCH --signal=USR2@120\n" in script and "#SBATCH --mem=1GB\n" in script, script


# --- a real evalkit sweep on Slurm (engine) ---

LIMIT = 16
POINTS = ["tasks=[evalkit_arith]", f"limit={LIMIT}", "chunk_size=2", "gpu_memory_utilization=0.25",
          "max_model_len=1024,2048"]


def store_of(job: str) -> Path | None:
    """The request store a running point of Slurm job ``<array id>_<index>`` holds open, from its processes."""
    import psutil

    array, index = job.split("_")
    for process in psutil.process_iter():
        try:
            env = process.environ()
            if (env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")) != (array, index):
                continue
            for opened in process.open_files():
                if "/.requests/" in opened.path and opened.path.endswith(".jsonl"):
                    return Path(opened.path)
        except (psutil.Error, OSError):
            continue
    return None


def lines(path: Path | None) -> int:
    return len(path.read_text().splitlines()) if path and path.exists() else 0


def wait_for(condition, driver: subprocess.Popen, what: str, timeout: float = 600):
    import time

    deadline = time.time() + timeout
    while not (found := condition()):
        assert driver.poll() is None and time.time() < deadline, f"the sweep ended before {what}"
        time.sleep(0.2)
    return found


@pytest.mark.engine
def test_sweep_on_slurm_equals_one_engine_and_a_requeued_point_resumes(slurm, engine, tmp_path):
    """Two points as Slurm jobs; point 1 requeued mid-scoring (as a preemption): it records that it stopped,
    runs again when Slurm starts it again and computes only the answers its store lacks; the sweep gathers both,
    and their samples equal the same documents on one engine."""
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
    job = wait_for(lambda: (lambda jobs: jobs[1] if len(jobs) == 2 else None)(job_ids(sweep_dir)), driver, "jobs")
    store = wait_for(lambda: store_of(job), driver, "point 1 opened its store")
    wait_for(lambda: lines(store) >= 4, driver, "point 1 scored part of its documents")
    slurm.run("scontrol", "requeue", job)  # SIGTERM to its processes, SIGKILL KillWait later; then pending again
    stopped = wait_for(lambda: next((p for p in read_points(sweep_dir) if p.num == 1 and p.status != "running"),
                                    None), driver, "point 1 recorded its stop")
    kept = lines(store)
    stdout, stderr = driver.communicate(timeout=900)
    assert driver.returncode == 0, stderr[-4000:]
    assert stopped.status == "failed" and stopped.error.startswith("stopped:"), stopped  # not memory, not retried
    assert 4 <= kept < LIMIT
    assert int(slurm.job(job)["Restarts"]) == 1
    points = read_points(sweep_dir)
    assert [(p.num, p.status) for p in points] == [(0, "ok"), (1, "ok")], points
    assert "evalkit: sweep report in " in stderr and (sweep_dir / "report.md").is_file()
    resumed = json.loads((Path(points[1].run_dir) / "results.json").read_text())["evalkit"]
    assert resumed["resume"]["reused"] >= kept and resumed["resume"]["computed"] <= LIMIT - kept, resumed["resume"]
    assert [a["status"] for a in resumed["attempts"]] == ["ok"]

    cfg = compose_config(["tasks=[evalkit_arith]", f"limit={LIMIT}", "chunk_size=2", "gpu_memory_utilization=0.25",
                          f"output_dir={tmp_path / 'one'}"])
    one = evaluate(cfg, engine_factory=lambda cfg, model_dir: KeptRunning(engine))
    fields = ("doc_id", "resps", "filtered_resps", "exact_match")
    load = lambda d: [{k: s[k] for k in fields} for s in read_samples(d, "evalkit_arith")]
    for point in points:
        assert load(Path(point.run_dir)) == load(one), point.num
    print(f"\nrequeued after {kept}/{LIMIT} answers; the rerun computed {resumed['resume']['computed']}; "
          f"wall seconds {[p.wall_seconds for p in points]}")
