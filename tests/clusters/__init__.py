"""Schedulers started on this machine for the cluster tests and benchmarks: a one-node Slurm (local_slurm.py) and
a Ray cluster of several nodes (local_ray.py). Each module runs as a command (``python -m tests.clusters.<module>
-- <command>``) through :func:`run_against`."""

from __future__ import annotations

import socket
import subprocess
from typing import Callable, Protocol


class Cluster(Protocol):
    env: dict[str, str]  # the environment that finds this cluster (SLURM_CONF, RAY_ADDRESS)

    def stop(self) -> None: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_against(start: Callable[[], Cluster], argv: list[str], default: list[str]) -> int:
    """Start a cluster, run the command after ``--`` in argv (default without one) in its env, stop the cluster:
    the command's exit code."""
    command = argv[argv.index("--") + 1:] if "--" in argv else default
    cluster = start()
    try:
        return subprocess.run(command, env=cluster.env).returncode
    finally:
        cluster.stop()
