"""The Ray launcher (hydra_plugins/evalkit_ray_launcher) and the launcher device check (evalkit/sweep/devices.py).

The sweeps run tests/sweep_app/app.py, an app shaped like evalkit's whose points record what Ray gave them
(devices, start and end, cluster address), each sweep in a subprocess that starts and stops its own Ray with 8
logical GPUs. Two sweeps, about 45 s in all on 2 cores; no vLLM. One more joins a running cluster of two nodes
(the ray_nodes fixture, tests/clusters/local_ray.py: about 25 s to start).

    .venv/bin/python -m pytest tests/test_launcher.py
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from evalkit.config import CONF_DIR, ConfigError, compose_config, register_configs
from evalkit.sweep.devices import EVALKIT_SLURM, SLURM, check_launcher_devices, point_launcher
from evalkit.sweep.points import read_points

APP = Path(__file__).parent / "sweep_app" / "app.py"
RAY_LAUNCHER = "hydra_plugins.evalkit_ray_launcher.ray_launcher.EvalkitRayLauncher"


def sweep(sweep_dir: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    """The app's sweep on the Ray launcher with 8 logical GPUs; its output and each point's trace."""
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, str(APP), "-m", "hydra/launcher=evalkit_ray", "hydra.launcher.num_gpus=8",
           f"hydra.sweep.dir={sweep_dir}", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    traces = {}
    for path in sweep_dir.glob("*/trace.json"):
        trace = json.loads(path.read_text())
        traces[trace["num"]] = trace
    return done, traces


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    """Five 2-GPU points on 8 GPUs, 5 s each; point 4's process dies at its end (a worker killed for memory)."""
    sweep_dir = tmp_path_factory.mktemp("five") / "sweep"
    done, traces = sweep(sweep_dir, "hydra.launcher.num_cpus=5", "tensor_parallel_size=2", "tag=0,1,2,3,4",
                         "sleep=5", "die_at=4")
    return done, traces, {p.num: p for p in read_points(sweep_dir)}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Points of (tensor x data parallel) 2, 2x2, 4, 4x2, 8 and 8x2 devices; point 0 exits with code 5."""
    sweep_dir = tmp_path_factory.mktemp("shapes") / "sweep"
    done, traces = sweep(sweep_dir, "hydra.launcher.num_cpus=4", "tensor_parallel_size=2,4,8",
                         "data_parallel_size=1,2", "sleep=1.5", "exit_at=0")
    return done, traces, {p.num: p for p in read_points(sweep_dir)}


def test_four_two_gpu_points_run_at_once_on_disjoint_devices(five):
    done, traces, _ = five
    assert sorted(traces) == [0, 1, 2, 3, 4], done.stderr[-3000:]
    first = sorted(traces.values(), key=lambda t: t["start"])[:4]
    assert all(overlap(a, b) for a, b in itertools.combinations(first, 2)), first
    for trace in traces.values():
        assert len(trace["devices"].split(",")) == 2, trace
    for a, b in itertools.combinations(traces.values(), 2):
        if overlap(a, b):
            assert not set(a["devices"].split(",")) & set(b["devices"].split(",")), (a, b)


def test_fifth_point_waits_for_devices(five):
    _, traces, _ = five
    by_start = sorted(traces.values(), key=lambda t: t["start"])
    fifth = by_start[4]
    assert fifth["start"] >= min(t["end"] for t in by_start[:4]), by_start
    assert sum(overlap(fifth, t) for t in by_start[:4]) <= 3


def test_points_lines_reach_the_terminal(five):
    done, _, _ = five
    for num in range(5):
        assert re.search(rf"^\(point {num} pid=\d+\) evalkit: point {num} holds devices \d,\d$", done.stderr, re.M)
    assert "evalkit: sweep: 5 points on Ray at " in done.stderr
    # progress while points still run; which counts show depends on how the 5 s points finish together
    progress = re.findall(r"^evalkit: sweep ([1-4])/5 points done, ([1-4]) running", done.stderr, re.M)
    assert progress and all(int(n) + int(r) <= 5 for n, r in progress), done.stderr
    assert "\x1b[" not in done.stderr  # no colour codes off a terminal
    assert "repeated" not in done.stderr  # Ray folds lines alike but for numbers; every point's must show


def test_lost_point_is_recorded_and_the_others_finish(five):
    done, _, records = five
    assert [records[n].status for n in range(4)] == ["ok"] * 4
    assert records[4].status == "failed" and records[4].error.startswith("lost: "), records[4]
    assert "evalkit: error: point 4 was lost: " in done.stderr


def test_point_too_large_for_the_cluster_fails_alone(shapes):
    done, traces, records = shapes
    line = "evalkit: error: point 5 needs 16 devices (tensor_parallel_size=8 x data_parallel_size=2); the cluster has 8"
    assert line in done.stderr.splitlines(), done.stderr[-3000:]
    assert records[5].status == "failed"
    assert records[5].error == "needs 16 devices (tensor_parallel_size=8 x data_parallel_size=2); the cluster has 8"
    assert sorted(traces) == [0, 1, 2, 3, 4]
    assert [len(traces[n]["devices"].split(",")) for n in (0, 2, 4)] == [2, 4, 8]
    assert [records[n].status for n in (1, 2, 3, 4)] == ["ok"] * 4


def test_data_parallel_points_run_one_at_a_time(shapes):
    _, traces, _ = shapes
    assert not overlap(traces[1], traces[3])  # they hold no devices, so only the launcher keeps them apart


def test_exit_code_of_a_point_is_recorded(shapes):
    _, traces, records = shapes
    assert 0 in traces
    assert records[0].status == "failed" and records[0].error == "exit code 5", records[0]


def test_data_parallel_points_join_the_cluster_and_hold_no_devices(shapes):
    done, traces, records = shapes
    address = re.search(r"evalkit: sweep: 6 points on Ray at (\S+) ", done.stderr)[1]
    assert address.startswith("127.0.0.1:")  # the Ray the sweep started listens on loopback only
    for num in (1, 3):
        assert traces[num]["address"] == address and traces[num]["devices"] is None
        assert f"cluster.address='{address}'" in records[num].overrides
    assert [traces[n]["address"] for n in (0, 2, 4)] == [None] * 3


def test_points_see_the_sweeps_threads_and_launcher(shapes):
    _, traces, _ = shapes
    assert {t["threads"] for t in traces.values()} == {None}  # not Ray's OMP_NUM_THREADS=1
    launcher = traces[4]["launcher"]
    assert launcher["_target_"] == RAY_LAUNCHER
    check_launcher_devices(16, launcher)  # the Ray launcher sizes its points itself


def test_sigterm_ends_the_sweep_and_its_points(tmp_path):
    pytest.importorskip("ray")
    cmd = [sys.executable, str(APP), "-m", "hydra/launcher=evalkit_ray", "hydra.launcher.num_gpus=8",
           "hydra.launcher.num_cpus=2", f"hydra.sweep.dir={tmp_path}", "tensor_parallel_size=2", "tag=0,1", "sleep=300"]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*/pid"))) < 2 and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.5)
        pids = [int(p.read_text()) for p in tmp_path.glob("*/pid")]
        assert len(pids) == 2
        driver.send_signal(signal.SIGTERM)
        _, stderr = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "evalkit: sweep stopped by SIGTERM; its running points were ended" in stderr
    assert "Traceback" not in stderr
    time.sleep(2)
    for pid in pids:  # the points' processes (Ray workers) are gone, and with them what they started
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert {p.status for p in read_points(tmp_path)} == {"running"}  # cut off, never marked done


def test_a_sweep_on_a_cluster_of_two_nodes_runs_one_point_on_each(ray_nodes, tmp_path):
    """The launcher joins a running cluster of two one-CPU nodes (tests/clusters/local_ray.py) and each point,
    holding one CPU, runs on its own node."""
    cmd = [sys.executable, str(APP), "-m", "hydra/launcher=evalkit_ray", "hydra.launcher.address=auto",
           f"hydra.sweep.dir={tmp_path}", "tag=0,1", "sleep=3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ray_nodes.env)
    assert done.returncode == 0, done.stderr[-3000:]
    traces = [json.loads(p.read_text()) for p in tmp_path.glob("*/trace.json")]
    assert len(traces) == 2 and all(t["node"] for t in traces), traces
    assert traces[0]["node"] != traces[1]["node"] and overlap(*traces), traces  # side by side, one per node


HOLD_HEAD = """
import sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init()
head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
holder = ray.remote(num_cpus=1)(type("Hold", (), {"ready": lambda self: True}))
held = holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
ray.get(held.ready.remote())
print("held", flush=True)
sys.stdin.read()
"""


def test_a_point_on_a_node_without_the_model_fails_at_its_start_naming_the_node(ray_nodes, embedded_model_dir,
                                                                                  tmp_path):
    """A real evalkit point sent to the second node (the head's one CPU held), which lacks the model's folder
    (tests/clusters/local_ray.py, head_only): it fails at its start, before any engine, and the sweep's line
    names that node."""
    if ray_nodes.head_only is None:
        pytest.skip("nodes with a filesystem of their own need namespaces (root, unshare)")
    model = ray_nodes.head_only_copy(Path(embedded_model_dir), f"model-{tmp_path.name}")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=ray_nodes.env)
    try:
        assert holder.stdout.readline() == "held\n"
        cmd = [sys.executable, "-m", "evalkit", "-m", "hydra/launcher=evalkit_ray", "hydra.launcher.address=auto",
               f"vllm_path={model}", "tasks=[evalkit_arith]", "limit=2", f"output_dir={tmp_path / 'result'}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ray_nodes.env)
    finally:
        holder.communicate("", timeout=60)
    assert done.returncode == 1, done.stderr[-3000:]
    (point,) = read_points(next((tmp_path / "result" / ".sweeps").iterdir()))
    assert point.host == "node1" and point.error.startswith(f"vllm_path={model} does not exist"), point
    assert f") failed on node1: vllm_path={model} does not exist" in done.stderr, done.stderr[-3000:]


def test_hydra_discovers_the_launcher_from_any_folder(tmp_path):
    info = subprocess.run([sys.executable, "-m", "evalkit", "--info", "plugins"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert "\t\tEvalkitRayLauncher\n" in info.stdout.split("Sweeper:")[0], info.stdout + info.stderr
    assert "\t\tEvalkitSlurmLauncher\n" in info.stdout.split("Sweeper:")[0], info.stdout + info.stderr
    shown = subprocess.run([sys.executable, "-m", "evalkit", "hydra/launcher=evalkit_ray",
                            "hydra.launcher.num_gpus=8", "--cfg", "hydra", "--package", "hydra.launcher"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert OmegaConf.create(shown.stdout) == {"_target_": RAY_LAUNCHER, "address": None, "num_cpus": None, "num_gpus": 8,
                        "cpus_per_point": 1.0}, shown.stderr


def test_request_for_sizes_each_point():
    from hydra_plugins.evalkit_ray_launcher._plan import Request, request_for

    def ask(*overrides: str, gpus: float = 8) -> Request:
        return request_for(3, compose_config(list(overrides)), cluster_gpus=gpus, cpus_per_point=1.0)

    assert ask("tensor_parallel_size=2", "pipeline_parallel_size=2") == Request(4, 1.0, False)
    assert ask("tensor_parallel_size=2", "data_parallel_size=2") == Request(0, 0, True)
    assert ask("tensor_parallel_size=2", gpus=0) == Request(0, 1.0, False)  # a CPU cluster: cores only
    with pytest.raises(ConfigError, match=r"^point 3 needs 16 devices \(tensor_parallel_size=8 x "
                                          r"data_parallel_size=2\); the cluster has 8$"):
        ask("tensor_parallel_size=8", "data_parallel_size=2")
    with pytest.raises(ConfigError, match=r"needs 9 devices \(pipeline_parallel_size=9\)"):
        ask("pipeline_parallel_size=9")


def test_exclusive_keeps_points_of_one_set_of_answers_and_data_parallel_points_apart(tmp_path):
    from hydra_plugins.evalkit_ray_launcher._plan import Request, exclusive

    def keys(*overrides: str, dp: bool = False) -> frozenset[str]:
        return exclusive(compose_config([f"output_dir={tmp_path}", *overrides]), Request(0, 0, dp))

    assert keys("tasks=[evalkit_arith]") == keys("tasks=[evalkit_facts]", "limit=5")  # one store: one at a time
    assert keys("batch_size=4") == keys()  # scheduling only: the same answers
    for other in ("max_model_len=1024", "seed=3", "dtype=bfloat16", "model_name=other", f"output_dir={tmp_path}/b"):
        assert not keys(other) & keys(), other  # other answers, or another folder: side by side
    (lock,) = keys()
    assert lock.startswith(f"lock {tmp_path}/smollm2-135m-instruct/.lock-")
    assert keys(dp=True) - keys() == {"data parallel"}
    assert keys("seed=3", dp=True) & keys(dp=True) == {"data parallel"}
    assert exclusive(None, Request(2, 1, False)) == frozenset()  # not evalkit's config: Ray alone decides


def launcher(*overrides: str) -> dict:
    """hydra.launcher as a point of `python -m evalkit -m <overrides>` sees it (the installed plugins' own)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=False)


@pytest.mark.parametrize("name", ["submitit_slurm", "evalkit_slurm"])
def test_check_launcher_devices_slurm(name):
    slurm = launcher(f"hydra/launcher={name}", "hydra.launcher.gpus_per_node=2")
    assert slurm["_target_"] == {"submitit_slurm": SLURM, "evalkit_slurm": EVALKIT_SLURM}[name]  # the names checked
    check_launcher_devices(2, slurm)
    with pytest.raises(ConfigError, match=r"^this point needs 4 GPUs and the launcher gives it 2 \(hydra.launcher."
                                          r"gpus_per_node=2 x nodes=1\): pass hydra.launcher.gpus_per_node=4$"):
        check_launcher_devices(4, slurm)
    check_launcher_devices(4, {**slurm, "nodes": 2})
    with pytest.raises(ConfigError, match=r"gives it 1 \(hydra.launcher.gpus_per_task=1\): pass hydra.launcher."
                                          r"gpus_per_task=2$"):
        check_launcher_devices(2, {**slurm, "gpus_per_node": 8, "gpus_per_task": 1})
    gres = {**slurm, "gpus_per_node": None, "gres": "gpu:a100:2"}
    with pytest.raises(ConfigError, match=r"gives it 2 \(hydra.launcher.gres=gpu:a100:2 x nodes=1\)"):
        check_launcher_devices(4, gres)
    check_launcher_devices(8, {**slurm, "gpus_per_node": None})  # no GPU asked: a CPU job, the preflight's


def test_check_launcher_devices_local_launchers():
    local = launcher("hydra/launcher=submitit_local", "hydra.launcher.gpus_per_node=1")
    with pytest.raises(ConfigError, match=r"gives it 1 \(hydra.launcher.gpus_per_node=1\)"):
        check_launcher_devices(2, local)
    check_launcher_devices(1, local)
    check_launcher_devices(64, launcher())  # the basic launcher: this machine's devices, counted by the preflight
    check_launcher_devices(64, launcher("hydra/launcher=evalkit_ray"))  # sized by the launcher itself


def test_point_launcher_outside_a_sweep_is_none():
    assert point_launcher() is None


def test_point_launcher_inside_a_submitit_point(tmp_path):
    pytest.importorskip("submitit")
    cmd = [sys.executable, str(APP), "-m", "hydra/launcher=submitit_local", "hydra.launcher.gpus_per_node=1",
           f"hydra.sweep.dir={tmp_path}", "tensor_parallel_size=2", "sleep=0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    launcher = json.loads((tmp_path / "0" / "trace.json").read_text())["launcher"]
    assert launcher["gpus_per_node"] == 1 and launcher["_target_"].endswith(".LocalLauncher"), done.stderr[-2000:]
    with pytest.raises(ConfigError, match=r"^this point needs 2 GPUs and the launcher gives it 1 "):
        check_launcher_devices(2, launcher)


def test_a_point_given_fewer_gpus_than_it_needs_fails_before_its_engine(tmp_path):
    """submitit_local stands in for Slurm: same check, same settings (hydra.launcher.gpus_per_node)."""
    cmd = [sys.executable, "-m", "evalkit", "-m", "hydra/launcher=submitit_local", "hydra.launcher.gpus_per_node=1",
           "tensor_parallel_size=2", "tasks=[evalkit_facts]", "limit=1", f"output_dir={tmp_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    (sweep_dir,) = (tmp_path / ".sweeps").iterdir()
    (point,) = read_points(sweep_dir)
    assert point.status == "failed" and "needs 2 GPUs" in point.error and "gpus_per_node" in point.error, point
    assert not (tmp_path / "smollm2-135m-instruct").exists() or not [
        p for p in (tmp_path / "smollm2-135m-instruct").iterdir() if not p.name.startswith(".")]
