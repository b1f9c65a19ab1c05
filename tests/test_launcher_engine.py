"""Real evalkit sweeps through Hydra launchers, on the real engine: two points (max_model_len=1024,2048, two
documents of evalkit_facts) with submitit_local, and the same two with evalkit_ray on a local Ray. Four points,
3-5 minutes on 2 cores.

    .venv/bin/python -m pytest tests/test_launcher_engine.py -m engine
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from evalkit.sweep.points import read_points
from tests.conftest import EAGER, run_dirs

pytestmark = pytest.mark.engine

POINTS = ["tasks=[evalkit_facts]", "limit=2", "max_model_len=1024,2048", "gpu_memory_utilization=0.25", EAGER]


def evalkit_sweep(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, list]:
    """`python -m evalkit -m <args> <POINTS> output_dir=out`; its output and the sweep's point records."""
    cmd = [sys.executable, "-m", "evalkit", "-m", *args, *POINTS, f"output_dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    (sweep_dir,) = (out / ".sweeps").iterdir()
    return done, read_points(sweep_dir)


def check_runs(points: list) -> None:
    """Both points ok, each with a run folder whose results are of its own max_model_len."""
    assert [(p.num, p.status) for p in points] == [(0, "ok"), (1, "ok")], points
    for point, length in zip(points, (1024, 2048)):
        results = json.loads((Path(point.run_dir) / "results.json").read_text())
        assert results["evalkit"]["config"]["max_model_len"] == length
        assert results["results"]["evalkit_facts"]["acc,none"] is not None


def test_submitit_local_sweep(tmp_path):
    done, points = evalkit_sweep(tmp_path, "hydra/launcher=submitit_local")  # both points at once
    check_runs(points)
    assert len(run_dirs(tmp_path / "smollm2-135m-instruct")) == 2
    assert "evalkit: sweep report in " in done.stderr


def test_ray_sweep(tmp_path):
    pytest.importorskip("ray")
    done, points = evalkit_sweep(tmp_path, "hydra/launcher=evalkit_ray")
    check_runs(points)
    assert len(run_dirs(tmp_path / "smollm2-135m-instruct")) == 2
    # Ray found no GPU here: each point holds one of the 2 cores, so both run at once (other answers, other locks)
    started = [datetime.fromisoformat(p.started).timestamp() for p in points]
    assert abs(started[1] - started[0]) < min(p.wall_seconds for p in points), points
    for num in (0, 1):  # the points' own lines reach the terminal through Ray, prefixed; vLLM's stay in the logs
        assert re.search(rf"^\(point {num} pid=\d+\) evalkit: done loglikelihood 8/8 requests", done.stderr, re.M)
    assert not re.search(r"^\(point \d pid=\d+\) (?!evalkit: )", done.stderr, re.M), done.stderr[-4000:]
    assert re.search(r"^evalkit: sweep 1/2 points done, ", done.stderr, re.M)
    assert "evalkit: sweep report in " in done.stderr
