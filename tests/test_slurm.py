"""Sweeps as Slurm jobs, on a real one-node Slurm started by the tests (tests/slurm/local_slurm.py, the `slurm`
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
