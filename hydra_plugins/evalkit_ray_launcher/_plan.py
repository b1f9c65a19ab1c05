"""What each point of a sweep asks Ray for (pure: no Ray, no I/O).

A point takes ``devices_needed`` GPUs (tensor x pipeline x data parallel, evalkit/config.py) and
``cpus_per_point`` cores; Ray holds it back until they are free and sets its ``CUDA_VISIBLE_DEVICES``. A
data-parallel point (``data_parallel_size > 1``) asks for nothing itself: its engines are Ray actors
(evalkit/engine/pool/engine.py) that take their own devices, and it is told the cluster's address to start them
on. On a cluster without GPUs (a CPU machine that declared none) points take cores only.

Two things Ray cannot know keep points apart (:func:`exclusive`): evalkit's lock allows one run at a time per
set of answers (evalkit/store/lock.py), and data-parallel points run one at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from evalkit.config import ConfigError, EvalConfig, devices_needed
from evalkit.store.fingerprint import answers_key
from evalkit.store.lock import result_lock

SIZE_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


@dataclass(frozen=True)
class RaySettings:
    address: Optional[str]  # None: start Ray here; "auto" / "host:port": join
    num_cpus: Optional[int]  # a local start only
    num_gpus: Optional[int]  # a local start only
    cpus_per_point: float


@dataclass(frozen=True)
class Request:
    num_gpus: float
    num_cpus: float
    data_parallel: bool  # its engines are actors on the cluster: it is passed cluster.address


def sizes(cfg: Any) -> str:
    """"tensor_parallel_size=8 x data_parallel_size=2": the parallel sizes above 1 (or tensor's, when none is)."""
    named = [f"{key}={getattr(cfg, key)}" for key in SIZE_KEYS if getattr(cfg, key) > 1]
    return " x ".join(named) or f"tensor_parallel_size={cfg.tensor_parallel_size}"


def request_for(num: int, cfg: Any, *, cluster_gpus: float, cpus_per_point: float) -> Request:
    """What point `num` (its composed config `cfg`) asks Ray for; ConfigError when it can never fit."""
    needed = devices_needed(cfg)
    if cluster_gpus and needed > cluster_gpus:
        raise ConfigError(f"point {num} needs {needed} devices ({sizes(cfg)}); the cluster has {cluster_gpus:g}")
    if cfg.data_parallel_size > 1:
        return Request(num_gpus=0, num_cpus=0, data_parallel=True)
    return Request(num_gpus=needed if cluster_gpus else 0, num_cpus=cpus_per_point, data_parallel=False)


def address_override(address: str) -> str:
    """The override that sends a data-parallel point's engines to the sweep's cluster."""
    return f"cluster.address='{address}'"


def exclusive(task_cfg: Any, request: Request) -> frozenset[str]:
    """What a point (task_cfg: its config as its task sees it) must not share with another running point.

    The lock its run will take: evalkit runs one run at a time per set of answers (evalkit/store/lock.py), and a
    point that finds the lock held waits for it, holding its devices idle; here it waits unstarted. Data
    parallelism: a point's engine actors are placed one by one, so two such points could each hold part of
    the GPUs and wait for the rest forever."""
    keys = {"data parallel"} if request.data_parallel else set()
    if isinstance(task_cfg, EvalConfig):
        lock = result_lock(task_cfg.output_dir, task_cfg.model_name, answers_key(task_cfg))
        keys.add(f"lock {os.path.abspath(lock.path)}")
    return frozenset(keys)
