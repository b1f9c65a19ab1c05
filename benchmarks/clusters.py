"""Runs on the clusters users have, started on this machine: wall times, and what a node loss costs.

* a two-point sweep (max_model_len=1024,2048) sequentially (Hydra's basic launcher) and as Slurm jobs
  (hydra/launcher=evalkit_slurm on the one-node Slurm of tests/clusters/local_slurm.py);
* the same sweep through evalkit's Ray launcher on a Ray cluster of two nodes (hydra/launcher=evalkit_ray,
  hydra.launcher.address=auto: one point on each node);
* data parallel on a Ray cluster of two nodes (tests/clusters/local_ray.py, one CPU each): data_parallel_size=1
  (one node) and 2 (one engine on each node);
* the second node stopped after some answers were stored: how long until the run ends, the answers kept, and
  what the rerun on the remaining node computes.

Every run: the embedded model, evalkit_arith, `limit` documents (24), eager engine. Prints one Markdown table.
Run: .venv/bin/python -m benchmarks.clusters [limit]   (about 10 minutes on 2 CPU cores; Slurm parts need
root and `apt-get install slurm-wlm slurmdbd munge mariadb-server`)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.clusters.local_ray import LocalRay
from tests.clusters.local_slurm import LocalSlurm, missing

MODEL = "smollm2-135m-instruct"


def args(out: Path, limit: int, *extra: str, sweep: bool = False) -> list[str]:
    return [sys.executable, "-m", "evalkit", *(["-m"] if sweep else []), "tasks=[evalkit_arith]", f"limit={limit}", "chunk_size=2",
            "gpu_memory_utilization=0.25", "+engine_kwargs.enforce_eager=true", f"output_dir={out}", *extra]


def timed(cmd: list[str], env: dict | None = None) -> float:
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def stored(out: Path) -> int:
    files = list((out / MODEL / ".requests").glob("*.jsonl"))
    return len(files[0].read_text().splitlines()) if files else 0


def node_loss(ray: LocalRay, out: Path, limit: int) -> tuple[int, float, int, dict]:
    run = subprocess.Popen(args(out, limit, "data_parallel_size=2", "cluster.address=auto"), env=ray.env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while stored(out) < 4 and run.poll() is None:
        time.sleep(0.2)
    ray.stop_node(1)
    kept, lost = stored(out), time.perf_counter()
    run.communicate()
    ended = time.perf_counter() - lost
    finished = stored(out)
    timed(args(out, limit, "data_parallel_size=1", "cluster.address=auto"), env=ray.env)
    (results,) = (out / MODEL).glob("*/results.json")
    return kept, ended, finished, json.loads(results.read_text())["evalkit"]["resume"]


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sweep = "max_model_len=1024,2048"
        rows.append(("two-point sweep, sequential", timed(args(tmp / "seq", limit, sweep, sweep=True))))
        if missing() is None:
            slurm = LocalSlurm().start()
            try:
                on_slurm = args(tmp / "slurm", limit, sweep, "hydra/launcher=evalkit_slurm", "hydra.launcher.partition=local",
                                "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=6", sweep=True)
                rows.append(("two-point sweep, Slurm jobs (one node, 2 cores)", timed(on_slurm, env=slurm.env)))
            finally:
                slurm.stop()
        ray = LocalRay(nodes=2, cpus=1).start()
        try:
            on_ray = args(tmp / "ray", limit, sweep, "hydra/launcher=evalkit_ray", "hydra.launcher.address=auto",
                          sweep=True)
            rows.append(("two-point sweep, evalkit_ray on two Ray nodes", timed(on_ray, env=ray.env)))
            for size in (1, 2):
                cmd = args(tmp / f"dp{size}", limit, f"data_parallel_size={size}", "cluster.address=auto")
                rows.append((f"data_parallel_size={size} on {size} Ray node(s)", timed(cmd, env=ray.env)))
            kept, ended, finished, resume = node_loss(ray, tmp / "loss", limit)
        finally:
            ray.stop()
    print(f"| run ({limit} documents of evalkit_arith) | wall seconds |\n|---|--:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.0f} |")
    print(f"\nnode loss: stopped after {kept} answers; the run ended {ended:.0f} s later keeping {finished}; "
          f"the rerun on the remaining node reused {resume['reused']} and computed {resume['computed']}")


if __name__ == "__main__":
    main()
