"""What a resumed run saves: the default run killed half-way (SIGKILL), then the same command again.

Prints the wall time of an uninterrupted run, of the run until it was killed, and of the resumed run,
with the requests the resumed run reused and computed. Run: .venv/bin/python -m benchmarks.resume
(about 6 minutes on 2 CPU cores; extra `key=value` arguments go to every run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "smollm2-135m-instruct"


def run(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "evalkit", *args], check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    extra = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        clean_dir, killed_dir = Path(tmp) / "clean", Path(tmp) / "killed"
        clean = run([f"output_dir={clean_dir}", "resume=false", *extra])
        total = sum(c["requests"] for c in json.loads(next((clean_dir / MODEL).glob("2*/results.json")).read_text())
                    ["evalkit"]["counts"].values())

        args = [f"output_dir={killed_dir}", "chunk_size=16", *extra]
        started = time.perf_counter()
        first = subprocess.Popen([sys.executable, "-m", "evalkit", *args], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        store = killed_dir / MODEL / ".requests"
        while not list(store.glob("*.jsonl")) or \
                len(next(store.glob("*.jsonl")).read_text().splitlines()) < total // 2:
            if first.poll() is not None:
                raise SystemExit("the run finished before it could be killed; raise limit")
            time.sleep(0.05)
        first.kill()
        first.wait()
        until_kill = time.perf_counter() - started
        resumed = run(args)
        evalkit = json.loads(next((killed_dir / MODEL).glob("2*/results.json")).read_text())["evalkit"]

    print(f"requests in the default run:       {total}")
    print(f"uninterrupted run:                 {clean:6.1f} s")
    print(f"killed after:                      {until_kill:6.1f} s "
          f"({evalkit['resume']['reused']} requests finished)")
    print(f"resumed run:                       {resumed:6.1f} s "
          f"(reused {evalkit['resume']['reused']}, computed {evalkit['resume']['computed']}; "
          f"engine start {evalkit['timings']['engine_start']:.1f} s, evaluate {evalkit['timings']['evaluate']:.1f} s)")
    print(f"killed + resumed vs uninterrupted: {until_kill + resumed:6.1f} s vs {clean:.1f} s")


if __name__ == "__main__":
    main()
