"""Where evalkit's scoring time goes: py-spy samples one in-process evaluation of a scoring task on the real engine,
and the samples inside ``evaluate`` are split into the model's forward, vLLM's prompt-logprob processing, the rest
of vLLM, evalkit's own Python and lm-eval's.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one profile holds all of it; engine
start and close are left out (they sit outside ``evaluate``). Needs py-spy (``pip install py-spy``; not a
dependency of evalkit). Samples are of the Python main thread: time inside a torch operator counts for the Python
frame that called it.
Run: .venv/bin/python -m benchmarks.profile_scoring [--task evalkit_bench_short_mc] [--rate 50]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARES = ("model forward", "vLLM prompt-logprob processing", "vLLM, the rest", "evalkit's own Python", "lm-eval")


def share_of(frames: list[str]) -> str:
    """The part of the stack (outermost first) a sample belongs to."""
    joined = ";".join(frames)
    if "vllm/model_executor/models" in joined:
        return "model forward"
    if "vllm" in joined:
        return "vLLM prompt-logprob processing" if re.search(r"logprob", joined, re.I) else "vLLM, the rest"
    files = [m.group(1) for m in (re.search(r"\(([^:)]*)", f) for f in frames) if m]
    own = [f for f in files if f.startswith(("evalkit/", "lm_eval/"))]
    return "evalkit's own Python" if own and own[-1].startswith("evalkit/") else "lm-eval"


def child(task: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    from evalkit.config import compose_config
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.vllm.start import start_vllm
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    model_dir = resolve_model_path("embedded://smollm2-135m-instruct")
    out = tempfile.mkdtemp(prefix="evalkit-profile-")
    base = [f"vllm_path={model_dir}", "gpu_memory_utilization=0.25", "+engine_kwargs.enforce_eager=true",
            f"tasks_dirs=[{ROOT / 'benchmarks' / 'tasks'}]", "resume=false", f"output_dir={out}"]
    engine = start_vllm(compose_config(base), model_dir)
    started = time.perf_counter()
    evaluate(compose_config([*base, f"tasks=[{task}]"]), engine_factory=lambda c, d: KeptRunning(engine))
    print(f"evaluate: {time.perf_counter() - started:.1f} s", flush=True)
    engine.close()
    shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="evalkit_bench_short_mc")
    parser.add_argument("--rate", type=int, default=50, help="samples per second")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        return child(options.task)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "profile.txt"
        done = subprocess.run([spy, "record", "--format", "raw", "-r", str(options.rate), "-o", str(raw), "--",
                               sys.executable, "-m", "benchmarks.profile_scoring", "--child", "--task", options.task],
                              capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            sys.exit(f"py-spy failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        counts: Counter[str] = Counter()
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            if any(f.startswith("evaluate (evalkit/run/evaluate.py") for f in frames):
                counts[share_of(frames)] += int(count)
    total = sum(counts.values())
    wall = next((line for line in done.stdout.splitlines() if line.startswith("evaluate:")), "evaluate: ?")
    print(f"{options.task}, {wall}, {total} samples at {options.rate}/s inside evaluate")
    print("| share | samples | % |\n|---|---|---|")
    for name in SHARES:
        print(f"| {name} | {counts[name]} | {100 * counts[name] / max(total, 1):.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
