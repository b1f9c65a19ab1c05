"""How long a rerun takes when every answer is in the request store: the README's main command (the default run
on the embedded model, the default tasks, all their documents), then the same command again, --repeats times.
The first run starts the engine; each rerun finds the earlier run of its config and reads every answer from
the store (evalkit/store/replay.py), starting none.

Prints each wall time (the process, from start to exit), the rerun's timings from its results.json and whether
its engine started, and writes them with the date, machine and commit to --out (benchmarks/stored_rerun.md, which
the pages quote for the default run's wall time). Run: .venv/bin/python -m benchmarks.stored_rerun [--repeats 5]
[--out FILE] [key=value ...] (about a minute and a half on 2 CPU cores; extra key=value arguments go to every run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.provenance import provenance

MODEL = "smollm2-135m-instruct"


def run(args: list[str]) -> tuple[float, dict]:
    """`python -m evalkit *args`: its wall seconds and its results.json's evalkit section."""
    out = Path(next(a for a in args if a.startswith("output_dir=")).split("=", 1)[1])
    before = set((out / MODEL).glob("2*")) if (out / MODEL).is_dir() else set()
    clock = time.perf_counter()
    subprocess.run([sys.executable, "-m", "evalkit", *args], check=True, capture_output=True)
    seconds = time.perf_counter() - clock
    (run_dir,) = set((out / MODEL).glob("2*")) - before
    time.sleep(1)  # run folders are named by the second
    return seconds, json.loads((run_dir / "results.json").read_text())["evalkit"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/stored_rerun.md", help="where the output is written")
    args, extra = parser.parse_known_args()
    load = os.getloadavg()
    lines = [f"- command: python -m benchmarks.stored_rerun --repeats {args.repeats} {' '.join(extra)}".rstrip(),
             f"- {provenance()}", f"- load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", ""]
    with tempfile.TemporaryDirectory() as tmp:
        command = [f"output_dir={Path(tmp) / 'result'}", *extra]
        first, section = run(command)
        lines.append(f"first run, the default run (engine started): {first:.1f} s; timings {section['timings']}")
        print(lines[-1], flush=True)
        walls = []
        for i in range(args.repeats):
            wall, section = run(command)
            walls.append(wall)
            started = section["engine"].get("started", True)
            lines.append(f"rerun {i + 1}: {wall:.1f} s, engine started: {started}, answers reused "
                         f"{section['resume']['reused']}, computed {section['resume']['computed']}; "
                         f"timings {section['timings']}")
            print(lines[-1], flush=True)
    lines.append(f"reruns: median {statistics.median(walls):.1f} s, min {min(walls):.1f} s, max {max(walls):.1f} s "
                 f"(first run {first:.1f} s); load average at the end {os.getloadavg()[0]:.2f}")
    print(lines[-1])
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
