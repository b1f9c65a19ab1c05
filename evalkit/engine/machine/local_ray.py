"""Ray started on this machine by evalkit (the data-parallel pool, the Ray sweep launcher, each where no cluster
address is given): its ports on 127.0.0.1 only, its session in a private folder of its own.

Left to itself, Ray on Linux advertises the node on the machine's routable address and listens on every
interface, and keeps its session (sockets, logs, the address of the running cluster) under the shared
``/tmp/ray``, where another process's ``ray.init()`` finds it and joins. Ray has no public setting for a node
that only this machine can reach; its single-machine mode does it: with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
(the mode Ray runs in on Windows and macOS, read when ray is imported) the node's address is 127.0.0.1, which
the GCS, the raylet, the object manager and the workers bind. ``_temp_dir``, one of the options ``ray.init``
documents as hidden, puts the session in a folder of a new one of mode 0700 (Ray opens its own folder to every
user), removed by :func:`stop`. Checked with Ray
2.60 (tests/engine/pool/test_dataparallel.py: every socket of a started pool's processes listens on
loopback); where another Ray puts the node elsewhere, :func:`start` says so in one line.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from evalkit.untrusted import loopback

log = logging.getLogger("evalkit")

SINGLE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's node address: 127.0.0.1
TESTED = "2.60"


def start(*, num_cpus: float | None, num_gpus: float | None, logging_level: int) -> Path | None:
    """Start Ray here, its node on 127.0.0.1 and its session under a new private folder, which it returns (for
    :func:`stop`); None where this process is connected to Ray already (a point of a Ray sweep)."""
    before = {name: os.environ.get(name) for name in SINGLE_MACHINE}
    os.environ.update(SINGLE_MACHINE)  # read when ray is imported; the processes Ray starts inherit it
    try:
        import ray

        if ray.is_initialized():
            return None
        folder = Path(tempfile.mkdtemp(prefix="evalkit-ray-"))
        try:
            # Ray opens its own folder to everyone (0777): its parent here is 0700
            ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, logging_level=logging_level,
                     _temp_dir=str(folder / "ray"))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
    finally:  # this process's later Ray calls (joining a cluster) see the environment as it was
        for name, value in before.items():
            os.environ.pop(name) if value is None else os.environ.update({name: value})
    host = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0].strip("[]")
    if not loopback(host):
        log.warning("Ray started on this machine listens on %s, not 127.0.0.1: other machines may reach its ports "
                    "(Ray %s imported before evalkit set %s, or another Ray than the %s evalkit was checked with)",
                    host, ray.__version__, ", ".join(SINGLE_MACHINE), TESTED)
    return folder


def stop(folder: Path | None) -> None:
    """Stop the Ray this process started or leave the cluster it joined, and remove the session folder of one
    started by :func:`start`."""
    import ray

    ray.shutdown()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
