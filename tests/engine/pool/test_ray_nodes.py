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


@pytest.fixture
def gpu_nodes():
    """Two Ray nodes on this machine declaring 2 and 6 GPUs (Ray counts and assigns them as real ones; nothing
    here computes on them), four CPUs each."""
    pytest.importorskip("ray")
    from tests.clusters.local_ray import LocalRay

    cluster = LocalRay(nodes=2, cpus=4, gpus=(2, 6)).start()
    yield cluster
    cluster.stop()


# a driver joining the cluster as a run's try does (in a process of its own: Ray reads its token settings at import)
PLACING = r'''
import json, sys
import ray
from evalkit.config import ConfigError, compose_config
from evalkit.engine.pool import replicas

said = {}
try:
    replicas.Replicas(compose_config(["cluster.address=auto", "data_parallel_size=2", "tensor_parallel_size=4"]), "m")
except ConfigError as error:
    said["refused"] = str(error)


class Holder:
    def ready(self):
        return True


holder = ray.remote(num_gpus=6, num_cpus=0)(Holder).remote()  # another job's, on the 6-GPU node
ray.get(holder.ready.remote(), timeout=120)
replicas.PLACE_WAIT = 5.0
pool = replicas.Replicas(compose_config(["cluster.address=auto", "data_parallel_size=4", "tensor_parallel_size=2"]),
                         "m")
try:
    pool.start()
except RuntimeError as error:
    said["waited"] = str(error)
import time

deadline = time.monotonic() + 60  # the pool's actors killed: their GPUs free again, the holder's kept
while ray.available_resources().get("GPU", 0) != 2 and time.monotonic() < deadline:
    time.sleep(0.5)
said["free_gpus"] = ray.available_resources().get("GPU", 0)
print(json.dumps(said))
'''


def test_engines_no_node_holds_fail_in_one_line_and_a_busy_cluster_is_waited_for_a_bounded_time(gpu_nodes):
    """data_parallel_size=2 x tensor_parallel_size=4 fits the cluster's 8 GPUs and only one node: refused before
    any actor is made. 4 x 2 fits both nodes, but another job's actor holds the 6-GPU node: Ray would wait for
    ever; the pool waits PLACE_WAIT seconds, then fails in one line and leaves no actor of its own."""
    done = subprocess.run([sys.executable, "-c", PLACING], capture_output=True, text=True, timeout=600,
                          env=gpu_nodes.env)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["refused"] == ("data_parallel_size=2 engines of 4 GPUs each do not fit on the Ray nodes at once (1 do; "
                               "the nodes have 2, 6 GPUs): lower data_parallel_size")
    assert said["waited"] == ("Ray did not place all 4 engines ({'num_gpus': 2, 'num_cpus': 1} each) within 5 s: "
                              "other work holds the nodes with room for them; run the same command again when they "
                              "are free, or with a smaller data_parallel_size")
    assert said["free_gpus"] == 2  # the head node's two: no actor of the pool is left
