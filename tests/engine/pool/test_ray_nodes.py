"""Data parallel across Ray nodes, on the real engine: a head node and a second node started on this machine
(tests/clusters/local_ray.py, one CPU each), joined as a user joins a cluster (``cluster.address=auto``).

* ``python -m evalkit data_parallel_size=2 cluster.address=auto`` places one engine on each node (each actor's
  node in results.json) and its samples equal one engine's;
a node loss (the second node stopped mid-run) is measured by benchmarks/clusters.py, whose run waits a minute
for a node with room before it ends.

    .venv/bin/python -m pytest tests/engine/pool/test_ray_nodes.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EAGER, run_dirs

pytestmark = pytest.mark.engine

LIMIT = 8
ARGS = ["tasks=[evalkit_arith]", f"limit={LIMIT}", "chunk_size=2", "gpu_memory_utilization=0.25", EAGER]


def evalkit(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "evalkit", *ARGS, f"output_dir={out}", *args]


def answers(run_dir: Path) -> list:
    from evalkit.run.results import read_samples

    return [{k: s[k] for k in ("doc_id", "resps", "filtered_resps", "exact_match")}
            for s in read_samples(run_dir, "evalkit_arith")]


def test_one_engine_on_each_node_answers_as_one_engine(ray_nodes, engine, tmp_path):
    from evalkit.config import compose_config
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    out = tmp_path / "result"
    done = subprocess.run(evalkit(out, "data_parallel_size=2", "cluster.address=auto"), capture_output=True,
                          text=True, timeout=900, env=ray_nodes.env)
    assert done.returncode == 0, done.stderr[-4000:]
    (run_dir,) = run_dirs(out / "smollm2-135m-instruct")
    actors = json.loads((run_dir / "results.json").read_text())["evalkit"]["engine"]["data_parallel"]["actors"]
    assert len({a["node"] for a in actors}) == 2, actors
    one = evaluate(compose_config([*ARGS, f"output_dir={tmp_path / 'one'}"]),
                   engine_factory=lambda cfg, model_dir: KeptRunning(engine))
    assert answers(run_dir) == answers(one)

