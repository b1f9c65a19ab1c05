"""A Ray cluster of several nodes on this one machine: a head node and workers, each its own raylet with its
own resources (a second raylet is a second node to Ray), as a user's cluster is joined (``cluster.address=auto``).

Each node is a ``ray start --block`` of ours, in a session of its own: :meth:`LocalRay.stop_node` ends one node
(its raylet and every worker and actor on it: a node loss), :meth:`LocalRay.stop` all of them, leaving no process.
Only this cluster's processes are touched (never ``ray stop``, which stops every Ray on the machine).
:attr:`LocalRay.env` sets ``RAY_ADDRESS``, so that ``auto`` finds this cluster and no other. Started ``apart``
(root, util-linux's ``unshare``; :func:`apart_here`), each worker node has a hostname of its own and does not see
:attr:`LocalRay.head_only`, as a node of a user's cluster has its own name and disks.

    .venv/bin/python -m tests.clusters.local_ray -- ray status     # start two nodes, run a command, stop them
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.clusters import free_port, run_against

RAY = str(Path(sys.executable).with_name("ray"))
START_WAIT = 120.0  # seconds for every node to join


def apart_here() -> bool:
    """Whether nodes can be started apart here (namespaces need root and ``unshare``)."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None


class LocalRay:
    """A running cluster of `nodes` nodes, each with `cpus` CPUs; env joins it."""

    def __init__(self, nodes: int = 2, cpus: int = 1, object_store_bytes: int = 300 * 2**20,
                 apart: bool = False, gpus: tuple[int, ...] = ()) -> None:
        from ray.util import get_node_ip_address

        self.port = free_port()
        self.address = f"{get_node_ip_address()}:{self.port}"  # the address Ray gives its nodes here
        # token authentication, as `ray start --head` turns it on: each node and each driver reads the token
        # (~/.ray/auth_token, which the head writes, or RAY_AUTH_TOKEN)
        self.env = {**os.environ, "RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token"}
        self.options = [f"--num-cpus={cpus}", f"--object-store-memory={object_store_bytes}", "--disable-usage-stats"]
        # GPUs each node declares to Ray (none by default): Ray counts and assigns them as it would real ones, and
        # gives an actor CUDA_VISIBLE_DEVICES for them; nothing here uses a GPU
        self.gpus = tuple(gpus) or (0,) * nodes
        self.count = nodes
        self.nodes: list[subprocess.Popen] = []
        self.logs = Path(tempfile.mkdtemp(prefix="evalkit-ray-"))  # each node's ray start output
        # apart: each worker node in namespaces of its own (``unshare``, root): its own hostname (node1, ...) and
        # an empty folder mounted over head_only, which the head node and the driver see as it is
        self.head_only = self.logs / "head-only" if apart else None
        if self.head_only:
            self.head_only.mkdir()

    def start(self) -> "LocalRay":
        try:
            self.nodes.append(self._node(0, "--head", f"--port={self.port}", "--include-dashboard=false"))
            for index in range(1, self.count):
                self.nodes.append(self._node(index, f"--address={self.address}"))
            deadline = time.monotonic() + START_WAIT
            while self.alive_nodes() < self.count:
                if time.monotonic() > deadline or any(n.poll() is not None for n in self.nodes):
                    raise RuntimeError(f"local Ray: {self.alive_nodes()} of {self.count} nodes joined; logs in {self.logs}")
                time.sleep(1)
        except BaseException:
            self.stop()
            raise
        return self

    def _node(self, index: int, *args: str) -> subprocess.Popen:
        env = {k: v for k, v in self.env.items() if k != "RAY_ADDRESS"}
        apart = [] if index == 0 or self.head_only is None else [
            "unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
            'hostname "$1" && mount -t tmpfs none "$2" && shift 2 && exec "$@"', "sh", f"node{index}",
            str(self.head_only)]
        with open(self.logs / f"node{index}.log", "ab") as log:  # unshare and sh exec: the pid is ray start's
            return subprocess.Popen([*apart, RAY, "start", "--block", *self.options, f"--num-gpus={self.gpus[index]}",
                                     *args], env=env,
                                    start_new_session=True, stdout=log, stderr=subprocess.STDOUT)

    def head_only_copy(self, source: Path, name: str) -> Path:
        """A folder under head_only whose files link to source's (a model's): whole on the head node, missing on
        the nodes apart."""
        assert self.head_only is not None, "start the cluster apart"
        folder = self.head_only / name
        folder.mkdir()
        for file in Path(source).iterdir():
            (folder / file.name).symlink_to(file)
        return folder

    def alive_nodes(self) -> int:
        probe = "import ray; ray.init(); print(sum(n['Alive'] for n in ray.nodes()))"
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=self.env, timeout=60)
        lines = done.stdout.split()
        return int(lines[-1]) if done.returncode == 0 and lines else 0

    def stop_node(self, index: int, *, grace: float = 10.0) -> None:
        """End node index and everything on it: its ``ray start --block``, raylet, workers and actors; SIGTERM
        first (``ray start --block`` stops what it started), SIGKILL to what is left after grace seconds."""
        node = self.nodes[index]
        members = self._session(node)
        if node.poll() is None:
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(grace)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
        members = [p for p in members if p.is_running()]
        for process in members:  # what it started and left (workers of its raylet, in its session)
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(members, timeout=10)

    def stop(self) -> None:
        for index in reversed(range(len(self.nodes))):
            self.stop_node(index)
        left = [p.pid for n in self.nodes for p in self._session(n)]
        if left:
            raise RuntimeError(f"local Ray: processes {left} still running after stop")

    @staticmethod
    def _session(node: subprocess.Popen) -> list[psutil.Process]:
        """The living processes of node's session (started by its ``ray start``, which made the session)."""
        found = []
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == node.pid and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except (psutil.Error, OSError):
                continue
        return found


def main(argv: list[str]) -> int:
    return run_against(lambda: LocalRay().start(), argv, [RAY, "status"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
