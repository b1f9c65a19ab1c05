"""A real evalkit sweep through Hydra's submitit_local launcher, on the real engine: two points
(max_model_len=1024,2048, two documents of evalkit_facts) at once. evalkit's Ray launcher runs the sweep of
tests/test_sweep.py.

    .venv/bin/python -m pytest tests/test_launcher_engine.py -m engine
"""

from __future__ import annotations

import json
import subprocess
import sys
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
