"""Ray as evalkit starts it on this machine (evalkit/engine/machine/local_ray.py), through the data-parallel
pool's own connect (no engine): every port its processes listen on is on 127.0.0.1, its session lies in a
private folder of its own (not the shared /tmp/ray, where another user's Ray would be found and joined), and
that folder is gone once Ray stops. In a fresh interpreter, as a run's try is: Ray reads its node address when
it is imported. About 15 s (one Ray start).
Run: pytest tests/engine/machine/test_local_ray.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

START = """
import json, os
from pathlib import Path
import psutil
from evalkit.engine.pool import replicas
from tests.conftest import compose_config

connected = replicas.connect(compose_config(["data_parallel_size=2", "cluster.num_cpus=1"]))
import ray

processes = psutil.Process().children(recursive=True)
listening = sorted({c.laddr.ip for p in processes for c in p.net_connections(kind="inet") if c.status == "LISTEN"})
sessions = sorted({a.split("=", 1)[1] for p in processes if p.name() == "raylet" for a in p.cmdline()
                   if a.startswith("--session_dir=")})
found = {"address": ray.get_runtime_context().gcs_address, "listening": listening, "sessions": sessions,
         "modes": [oct(os.stat(Path(s).parents[1]).st_mode & 0o777) for s in sessions]}
replicas.local_ray.stop(connected[1]) if isinstance(connected, tuple) else ray.shutdown()
print(json.dumps(found))
"""


def test_ray_started_by_evalkit_listens_on_loopback_and_keeps_its_session_private():
    done = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["address"].startswith("127.0.0.1:"), found
    assert found["listening"] and set(found["listening"]) <= {"127.0.0.1", "::ffff:127.0.0.1"}, found
    (session,) = found["sessions"]
    assert not session.startswith("/tmp/ray/") and Path(session).parents[1].name.startswith("evalkit-ray-"), found
    assert found["modes"] == ["0o700"], found  # no other user reaches into it
    assert not Path(session).parents[1].exists()  # removed when Ray stopped
    assert "Ray started on this machine listens on" not in done.stderr
