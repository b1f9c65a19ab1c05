"""A Hydra app shaped like evalkit's, for the launcher tests (tests/test_launcher.py): the same parallel-size
keys and ``cluster.address``, and a task that records what its process was given instead of evaluating.

Each point writes its record as evalkit's points do (evalkit/sweep/points.py, so the sweep's progress lines
count it) and ``trace.json`` in its folder: CUDA_VISIBLE_DEVICES, cluster.address, start and end (time.time()),
OMP_NUM_THREADS, the launcher settings a point reads (evalkit/sweep/devices.py) and its Ray node (a Ray launcher's).
It prints one ``evalkit:`` line, which the launcher must bring to the terminal, then sleeps.

    python tests/sweep_app/app.py -m hydra/launcher=evalkit_ray hydra.launcher.num_gpus=8 tensor_parallel_size=2 tag=0,1,2
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig


@dataclass
class Cluster:
    address: Optional[str] = None


@dataclass
class AppConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    cluster: Cluster = field(default_factory=Cluster)
    tag: int = 0  # a sweep key that only tells points apart
    sleep: float = 2.0  # seconds each point holds its devices
    exit_at: int = -1  # the point that ends with sys.exit(5), as evalkit ends a stopped point
    die_at: int = -1  # the point whose process dies (os._exit), as a worker killed for memory


def ray_node() -> str | None:
    """The Ray node this point runs on (a point of the Ray launcher runs as a Ray task), else None."""
    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        return None
    return sys.modules["ray"].get_runtime_context().get_node_id()


def point(cfg: AppConfig) -> None:
    from evalkit.sweep.devices import point_launcher
    from evalkit.sweep.points import PointRecord, now_iso, write_point

    hydra_cfg = HydraConfig.get()
    num, folder = hydra_cfg.job.num, Path(hydra_cfg.runtime.output_dir)
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    record = PointRecord(num=num, overrides=list(hydra_cfg.overrides.task), status="running", run_dir=None,
                         error=None, wall_seconds=None, devices=devices, host=socket.gethostname(), started=now_iso())
    write_point(folder, record)
    (folder / "pid").write_text(str(os.getpid()))
    start = time.time()
    print(f"evalkit: point {num} holds devices {devices}", file=sys.stderr, flush=True)
    time.sleep(cfg.sleep)
    trace = {"num": num, "devices": devices, "address": cfg.cluster.address, "start": start, "end": time.time(),
             "threads": os.environ.get("OMP_NUM_THREADS"), "launcher": point_launcher(), "node": ray_node()}
    (folder / "trace.json").write_text(json.dumps(trace))
    if num == cfg.exit_at:
        sys.exit(5)
    if num == cfg.die_at:
        os._exit(3)
    write_point(folder, replace(record, status="ok", wall_seconds=round(time.time() - start, 1)))


if __name__ == "__main__":
    ConfigStore.instance().store(name="sweep_app", node=AppConfig)
    hydra.main(config_path=None, config_name="sweep_app", version_base=None)(point)()
