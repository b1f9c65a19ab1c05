"""Data parallel across Ray nodes, on the real engine: a head node and a second node started on this machine
(tests/clusters/local_ray.py, one CPU each), joined as a user joins a cluster (``cluster.address=auto``).

* ``python -m evalkit data_parallel_size=2 cluster.address=auto`` places one engine on each node (each actor's
  node in results.json) and its samples equal one engine's;
* a model folder that the second node lacks (a folder only the head node sees: the second node runs in a mount
  namespace of its own, ``LocalRay.head_only``) fails in one line naming that node, before any engine starts;
a node loss (the second node stopped mid-run) is measured by benchmarks/clusters.py, whose run waits a minute
for a node with room before it ends.

    .venv/bin/python -m pytest tests/engine/pool/test_ray_nodes.py
"""

from __future__ import annotations

import json
import re
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



def test_a_model_folder_missing_on_a_node_fails_in_one_line_naming_it(ray_nodes, embedded_model_dir, tmp_path):
    if ray_nodes.head_only is None:
        pytest.skip("nodes with a filesystem of their own need namespaces (root, unshare)")
    model = ray_nodes.head_only_copy(Path(embedded_model_dir), f"model-{tmp_path.name}")
    done = subprocess.run(evalkit(tmp_path / "result", "data_parallel_size=2", "cluster.address=auto",
                                  f"vllm_path={model}"), capture_output=True, text=True, timeout=600, env=ray_nodes.env)
    assert done.returncode == 2, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("evalkit: error")]
    assert len(said) == 1 and re.fullmatch(
        rf"evalkit: error: the model folder {re.escape(str(model))} does not exist on Ray node [0-9a-f]{{12}} "
        r"\(node1\), where engine [01] was placed: every node needs the weights at the same path", said[0]), said
    assert not list((tmp_path / "result").rglob("results.json"))
