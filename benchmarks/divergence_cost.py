"""What recording the divergence record costs a run: each task with divergence_top_k=0 and with k, on one engine.

The embedded model (SmolLM2-135M, float32, eager) on vLLM's CPU build, one engine for every run (started once,
warmed up, its prefix cache reset before each run, as benchmarks/run.py does). Each run is
``evalkit.run.evaluate.evaluate`` of one task in process, as ``python -m evalkit`` runs it (resume on, into a
fresh output folder, so the request store is written as in a user's run), timed from the call to the run folder
written: the engine's start is left out, which makes the added share larger than a user sees. Tasks: the default
run's two (evalkit_arith: generations; evalkit_facts: 4 choices) and the benchmark tasks (evalkit_bench_mc and
evalkit_bench_num_mc: 4 choices behind a few-shot context; evalkit_bench_fewshot_gen: greedy generations behind a
five-shot context), 30 documents each by default.

Per task it prints the positions recorded, the run's seconds without the record and with it (the fastest of
--repeats runs of each, interleaved), the added share, the seconds of the trace calls themselves
(``timings.engine_calls.trace_*``), the bytes per position of the record on disk (.npz) and in the request store
(JSON lines), and the largest |Σ trace − score| of the run's log-likelihoods (results.json
``evalkit.divergence.max_score_gap``: the trace and the scores come from separate reads). Below the table, the
reads each task's traces sent (results.json ``evalkit.scoring``'s ``trace_*`` counts:
evalkit/engine/vllm/trace_from_cache.py).
The issue's target is at most +30 %.
Run: .venv/bin/python -m benchmarks.divergence_cost [--limit 30] [--repeats 2] [--k 20] [--tasks a,b] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import EMBEDDED
from benchmarks.common.evalkit_side import OFFLINE_SETTINGS, environment_restored, warm_up

TASKS = ["evalkit_arith", "evalkit_facts", "evalkit_bench_mc", "evalkit_bench_num_mc", "evalkit_bench_fewshot_gen"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=30, help="documents per task")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side per task; the fastest counts")
    parser.add_argument("--k", type=int, default=20, help="divergence_top_k of the recording side")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks")
    parser.add_argument("overrides", nargs="*", help="more evalkit key=value overrides")
    return parser.parse_args(argv)


def store_bytes(out: Path) -> int:
    """Bytes of the trace answers (lines whose answer has a top list) in the run's request store."""
    return sum(len(line) for path in out.glob("*/.requests/*.jsonl")
               for line in path.read_bytes().splitlines(keepends=True) if '"top"' in line.decode())


def one_run(base: list[str], engine: Any, task: str, k: int, out: Path) -> dict[str, Any]:
    """One task's run with divergence_top_k=k on the engine kept running, prefix cache cold: its facts."""
    from evalkit.config import compose_config
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    engine.llm.reset_prefix_cache()
    started = time.perf_counter()
    run_dir = evaluate(compose_config([*base, f"tasks=[{task}]", f"divergence_top_k={k}", f"output_dir={out}"]),
                       engine_factory=lambda c, d: KeptRunning(engine))
    seconds = time.perf_counter() - started
    section = json.loads((run_dir / "results.json").read_text())["evalkit"]
    calls = section["timings"]["engine_calls"]
    record = section["divergence"]
    return {"seconds": seconds, "trace": sum(v for key, v in calls.items() if key.startswith("trace_")),
            "answer": sum(v for key, v in calls.items() if not key.startswith("trace_")),
            "positions": record.get("positions", {}).get(task, 0),
            "disk": record.get("bytes_per_position", {}).get(task), "store": store_bytes(out),
            "gap": max(record.get("max_score_gap", {}).values(), default=None),
            "kinds": ", ".join(record.get("traced_requests", {})),
            "reads": {key[len("trace_"):]: v for key, v in section["scoring"].items() if key.startswith("trace_")}}


def measure(tasks: list[str], args: argparse.Namespace) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """task -> k -> its runs, every side of every task on one engine, the sides interleaved."""
    from evalkit.config import compose_config
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.vllm.start import start_vllm

    model_dir = resolve_model_path(EMBEDDED)
    base = [f"vllm_path={model_dir}", f"limit={args.limit}", *OFFLINE_SETTINGS, *args.overrides]
    found: dict[str, dict[int, list[dict[str, Any]]]] = {task: {0: [], args.k: []} for task in tasks}
    with environment_restored(), tempfile.TemporaryDirectory() as tmp:
        engine = start_vllm(compose_config(base), model_dir, sole_engine=True)
        try:
            warm_up(engine.llm)
            for task in tasks:
                for repeat in range(args.repeats):
                    for k in (0, args.k):
                        run = one_run(base, engine, task, k, Path(tmp) / f"{task}-{k}-{repeat}")
                        found[task][k].append(run)
                        print(f"{task} k={k}: {run['seconds']:.1f} s (trace {run['trace']:.1f} s)", flush=True)
        finally:
            engine.close()
    return found


def table(found: dict[str, dict[int, list[dict[str, Any]]]], k: int) -> str:
    lines = [f"| task | kinds traced | positions | k=0 s | k={k} s | added | trace calls s | answer calls s | "
             "bytes/position .npz | bytes/position store | max abs(Σ trace − score) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    totals = [0.0, 0.0]
    for task, sides in found.items():
        off, on = (min(sides[key], key=lambda r: r["seconds"]) for key in (0, k))
        totals[0] += off["seconds"]
        totals[1] += on["seconds"]
        store = f"{on['store'] / on['positions']:.0f}" if on["positions"] else "-"
        gap = f"{on['gap']:.2e}" if on["gap"] is not None else "-"
        lines.append(f"| {task} | {on['kinds']} | {on['positions']} | {off['seconds']:.1f} | {on['seconds']:.1f} | "
                     f"{on['seconds'] / off['seconds'] - 1:+.0%} | {on['trace']:.1f} | {on['answer']:.1f} | "
                     f"{on['disk'] or '-'} | {store} | {gap} |")
    lines.append(f"| all | | | {totals[0]:.1f} | {totals[1]:.1f} | {totals[1] / totals[0] - 1:+.0%} | | | | | |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    found = measure(args.tasks.split(","), args)
    print()
    print(table(found, args.k))
    print()
    for task, sides in found.items():
        reads = min(sides[args.k], key=lambda r: r["seconds"])["reads"]
        print(f"{task}: trace reads " + (", ".join(f"{key} {v}" for key, v in reads.items()) or "none counted"))


if __name__ == "__main__":
    main(sys.argv[1:])
