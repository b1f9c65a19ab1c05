"""One engine against data-parallel engines on Ray: the same run with data_parallel_size=1, 2, ...

Prints, per size, the wall time of `python -m evalkit`, the try's stages from results.json (engine start,
evaluate) and the engine time per request kind, and whether the scores are those of the first size. Run:
.venv/bin/python -m benchmarks.dataparallel [sizes=1,2] [key=value ...] (the default run of 220 requests:
about 4 minutes on 2 CPU cores). On a CPU machine every size shares the same cores, which evalkit splits
between the engines; the first row, one engine bound to one core, is what each engine gets there, as each
gets one GPU on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "smollm2-135m-instruct"


def run(size: int, out: Path, extra: list[str], bind: str | None = None) -> tuple[float, dict]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}  # evalkit binds per engine
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "evalkit", f"output_dir={out}", "resume=false",
                    f"data_parallel_size={size}", *extra], check=True, capture_output=True, env=env)
    wall = time.perf_counter() - started
    return wall, json.loads(next((out / MODEL).glob("2*/results.json")).read_text())


def main() -> None:
    args = sys.argv[1:]
    sizes = [int(s) for a in args if a.startswith("sizes=") for s in a.split("=", 1)[1].split(",")] or [1, 2]
    extra = [a for a in args if not a.startswith("sizes=")]
    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        # one engine on one core: what each engine of the larger sizes gets on a CPU machine (a device's share)
        for size, bind in [(1, "0"), *((s, None) for s in sizes)]:
            wall, data = run(size, Path(tmp) / f"dp{size}-{bind}", extra, bind)
            first = first or data["results"]
            timings = data["evalkit"]["timings"]
            calls = ", ".join(f"{k} {v:.1f} s" for k, v in timings["engine_calls"].items())
            rows.append(f"| {size}{' (one core)' if bind else ''} | {wall:.1f} | {timings['engine_start']:.1f} | {timings['evaluate']:.1f} | {calls} "
                        f"| {'yes' if data['results'] == first else 'NO'} |")
    print("| data_parallel_size | wall s | engine start s | evaluate s | engine time per kind | same scores |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
