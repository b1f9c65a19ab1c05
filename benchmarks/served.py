"""A vLLM server evaluated three ways, against the offline engine: evalkit served, lm-eval's local-completions, and
evalkit offline (the reference), on the same documents. One table.

One ``vllm.entrypoints.openai.api_server`` of the embedded model (float32, eager, max_model_len 4096), started by
evalkit's own ``endpoint.serve`` code and already up before any side's clock starts:

* **evalkit served**: ``evaluate`` with ``engine=served`` on that server (its probe done at engine start, before
  the clock), ``endpoint.max_concurrency`` at its default (256: as many in flight as the server batches);
* **lm-eval local-completions**: lm-eval's ``LocalCompletionsAPI`` on the same server, as a careful user sets it:
  token ids (``tokenized_requests=True``), the same local tokenizer, ``max_length=4096`` (its default 2048 would
  cut prompts); each of ``--lm-eval-settings`` (``num_concurrent`` x ``batch_size``, prompts per request) is
  run on every task and the fastest is shown with the setting that won ("its best settings", issue 31), and
  every setting's answers are checked against the offline engine's;
* **evalkit offline**: ``evaluate`` on a ``vllm.LLM`` in this process (the reference every side is compared with).

Seconds are each side's evaluate/simple_evaluate wall for the task (harness included, engine or server already
up). Every side starts with a cold prefix cache: the server runs with ``VLLM_SERVER_DEV_MODE=1`` and its
``/reset_prefix_cache`` is called before each side (else the side that runs second would find the first's
prompts cached). Agreement: greedy generations identical to the offline engine's, and the largest |Δ log-likelihood| over
every choice. Tasks: evalkit_facts (0-shot, 4 numeric/short choices), evalkit_bench_mc (4 choices behind a
~250-token few-shot context), evalkit_arith (3-shot generation), evalkit_bench_num_mc (4 choices of 4-6 digits,
each several tokens) and evalkit_bench_fewshot_gen (5-shot generation of up to 128 tokens), 30 documents each
by default (the last two made by the seeded make_data.py in benchmarks/tasks/, issue 31).

Two more tables (issue 31): the generation task's seconds against ``endpoint.max_concurrency`` on the same server,
and the start of each client in a fresh process (imports, tokenizer, evalkit's probe; lm-eval's model init).

Run: .venv/bin/python benchmarks/served.py [--limit N] [--lm-eval-settings 8x8,32x1,...] [--out benchmarks/served.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _evalkit_side import environment_restored  # noqa: E402
from _report import answers, primary_metric  # noqa: E402

EMBEDDED = "embedded://smollm2-135m-instruct"
BENCH_TASKS = ROOT / "benchmarks" / "tasks"
TASKS = ["evalkit_facts", "evalkit_bench_mc", "evalkit_arith", "evalkit_bench_num_mc", "evalkit_bench_fewshot_gen"]
LM_EVAL_SETTINGS = ["8x8", "32x1", "32x8", "64x16"]  # local-completions' num_concurrent x batch_size, tried on each task
CONCURRENCY = [1, 4, 16, 256]  # endpoint.max_concurrency values timed on the generation task
SETTINGS = ["+engine_kwargs.enforce_eager=true", f"tasks_dirs=[{BENCH_TASKS}]", "resume=false"]
SIDES = ("evalkit served", "lm-eval local-completions", "evalkit offline")


def evalkit_task(cfg_args: list[str], engine: Any, task: str) -> tuple[float, dict[str, Any], list, list]:
    """(seconds, results of task, log-likelihoods, generations) of one evalkit run of task on engine."""
    from evalkit.config import compose_config
    from evalkit.engine.wrapper import Lent
    from evalkit.run.evaluate import evaluate
    from evalkit.run.results import read_samples

    started = time.perf_counter()
    run_dir = evaluate(compose_config([*cfg_args, f"tasks=[{task}]"]), engine_factory=lambda c, d: Lent(engine))
    seconds = time.perf_counter() - started
    results = json.loads((run_dir / "results.json").read_text())["results"][task]
    return (seconds, results, *answers(read_samples(run_dir, task)))


def lm_eval_task(server_url: str, model: str, model_dir: str, task: str, limit: int,
                 concurrent: int = 8, batch_size: int = 8) -> tuple[float, dict, list, list]:
    """The same for lm-eval's local-completions on the server: concurrent requests in flight, batch_size prompts
    in each."""
    from lm_eval import simple_evaluate

    from evalkit.harness.tasks import load_tasks

    manager, built = load_tasks([task], task_data={}, extra_dirs=[str(BENCH_TASKS)])
    args = {"model": model, "base_url": f"{server_url}/completions", "tokenizer_backend": "huggingface",
            "tokenizer": model_dir, "tokenized_requests": True, "num_concurrent": concurrent, "max_retries": 3,
            "max_length": 4096}
    started = time.perf_counter()
    outcome = simple_evaluate(model="local-completions", model_args=args, tasks=built, task_manager=manager,
                              limit=limit, batch_size=batch_size, log_samples=True, bootstrap_iters=0)
    seconds = time.perf_counter() - started
    return (seconds, outcome["results"][task], *answers(outcome["samples"][task]))


EVALKIT_START = """import sys, time
t0 = time.perf_counter()
from evalkit.config import compose_config
from evalkit.engine.factory import start_served
t1 = time.perf_counter()
import evalkit.engine.tokenizer as tk
loaded = tk.load_tokenizer
def timed(*a, **k):
    t = time.perf_counter(); out = loaded(*a, **k); timed.s = time.perf_counter() - t; return out
tk.load_tokenizer = timed
import evalkit.engine.served.engine as served
served.load_tokenizer = timed
engine = start_served(compose_config(["engine=served", f"endpoint.url={sys.argv[1]}", "resume=false",
                                      f"vllm_path={sys.argv[2]}"]), sys.argv[2])
t2 = time.perf_counter()
print(f"{t1 - t0:.2f} {timed.s:.2f} {t2 - t1 - timed.s:.2f} {t2 - t0:.2f} {'vllm' in sys.modules} {'torch' in sys.modules}")
"""
LM_EVAL_START = """import sys, time
t0 = time.perf_counter()
from lm_eval.models.openai_completions import LocalCompletionsAPI
t1 = time.perf_counter()
LocalCompletionsAPI(model=sys.argv[3], base_url=f"{sys.argv[1]}/completions", tokenizer_backend="huggingface",
                    tokenizer=sys.argv[2], tokenized_requests=True, num_concurrent=8, max_length=4096)
t2 = time.perf_counter()
print(f"{t1 - t0:.2f} {t2 - t1:.2f} {t2 - t0:.2f} {'vllm' in sys.modules} {'torch' in sys.modules}")
"""


def start_times(url: str, model: str, model_dir: str, tries: int = 3) -> list[list[str]]:
    """Rows: each client's start in fresh processes (tries each, the least shown): evalkit's served engine
    (imports, tokenizer, probe and the rest of start_served) and lm-eval's LocalCompletionsAPI (import, init)."""
    import subprocess

    def once(code: str, *args: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout.split()

    # the two clients take turns, so that a machine whose load drifts (an engine still settling) weighs on both
    runs = [(once(EVALKIT_START, url, model_dir), once(LM_EVAL_START, url, model_dir, model)) for _ in range(tries)]
    ours = min((r[0] for r in runs), key=lambda r: float(r[-3]))
    theirs = min((r[1] for r in runs), key=lambda r: float(r[-3]))
    return [["evalkit served: imports / tokenizer / probe and the rest", f"{ours[0]} / {ours[1]} / {ours[2]}",
             f"{ours[3]}", f"vllm {ours[4]}, torch {ours[5]}"],
            ["lm-eval local-completions: import / model init", f"{theirs[0]} / {theirs[1]}", f"{theirs[2]}",
             f"vllm {theirs[3]}, torch {theirs[4]}"]]


def reset_prefix_cache(root: str) -> None:
    """Empty the server's prefix cache (a development endpoint, VLLM_SERVER_DEV_MODE=1)."""
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(f"{root}/reset_prefix_cache", method="POST"), timeout=60):
        pass


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=30, help="documents per task")
    parser.add_argument("--lm-eval-settings", default=",".join(LM_EVAL_SETTINGS),
                        help="local-completions' num_concurrent x batch_size settings to try on each task")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks to time")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        help="endpoint.max_concurrency values timed on evalkit_bench_fewshot_gen (empty: none)")
    parser.add_argument("--no-start", action="store_true", help="skip the clients' start times")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "served.md"), help="markdown copy of the table")
    options = parser.parse_args(argv)

    from tabulate import tabulate

    from evalkit.config import compose_config
    from evalkit.engine.factory import start_served
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.vllm.start import start_vllm

    model_dir = resolve_model_path(EMBEDDED)
    out = Path(tempfile.mkdtemp(prefix="evalkit-served-bench-"))
    base = [f"vllm_path={model_dir}", f"limit={options.limit}", *SETTINGS]
    started = time.perf_counter()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the server's /reset_prefix_cache, between sides
    served = start_served(compose_config([*base, "engine=served", "endpoint.serve=true", "gpu_memory_utilization=0.15",
                                          f"output_dir={out / 'server'}"]), model_dir)
    server_start = time.perf_counter() - started
    with environment_restored():  # lm-eval's client and the server must not see the offline engine's variables
        offline = start_vllm(compose_config([*base, "gpu_memory_utilization=0.25"]), model_dir)
    found: dict[str, dict[str, tuple]] = {}
    best: dict[str, str] = {}  # task -> the local-completions setting that was fastest on it
    every: dict[str, list[tuple]] = {}  # task -> every local-completions setting's outcome
    try:
        starts = [] if options.no_start else start_times(served.client.url, served.model, model_dir)
        print(starts, flush=True)
        for task in options.tasks.split(","):
            reset_prefix_cache(served.client.root())
            on_server = evalkit_task([*base, "engine=served", f"endpoint.url={served.client.url}",
                                      f"output_dir={out / 'served'}"], served, task)
            tried = {}
            for setting in options.lm_eval_settings.split(","):
                reset_prefix_cache(served.client.root())
                concurrent, batch = map(int, setting.split("x"))
                tried[setting] = lm_eval_task(served.client.url, served.model, model_dir, task, options.limit,
                                              concurrent, batch)
                print(task, "local-completions", setting, f"{tried[setting][0]:.1f} s", flush=True)
            best[task] = min(tried, key=lambda k: tried[k][0])
            lm_eval = tried[best[task]]
            every[task] = list(tried.values())
            offline.llm.reset_prefix_cache()
            found[task] = {"evalkit served": on_server, "lm-eval local-completions": lm_eval,
                           "evalkit offline": evalkit_task([*base, f"output_dir={out / 'offline'}"], offline, task)}
            print(task, {side: f"{found[task][side][0]:.1f} s" for side in SIDES}, flush=True)
        by_concurrency = []
        for cap in [int(c) for c in options.concurrency.split(",") if c]:
            reset_prefix_cache(served.client.root())
            served.client.max_concurrency, served.client.peak_in_flight = cap, 0
            seconds = evalkit_task([*base, "engine=served", f"endpoint.url={served.client.url}",
                                    f"output_dir={out / 'served'}"], served, "evalkit_bench_fewshot_gen")[0]
            by_concurrency.append([str(cap), f"{seconds:.1f}", str(served.client.peak_in_flight)])
            print("max_concurrency", by_concurrency[-1], flush=True)
    finally:
        offline.close()
        served.close()

    rows = []
    for task, sides in found.items():
        ref = sides["evalkit offline"]
        rows.append([f"**{task}**: seconds", *(f"{sides[s][0]:.1f}" for s in SIDES)])
        rows.append([f"{task}: score ({primary_metric(ref[1])[0]})", *(f"{primary_metric(sides[s][1])[1]:.3f}" for s in SIDES)])
        if ref[2]:
            rows.append([f"{task}: max abs Δ log-likelihood vs offline ({len(ref[2])} choices)",
                         *(f"{max(abs(a - b) for a, b in zip(sides[s][2], ref[2])):.2e}"
                           if len(sides[s][2]) == len(ref[2]) else "n/a" for s in SIDES)])
        if ref[3]:
            rows.append([f"{task}: generations identical to offline (of {len(ref[3])})",
                         *(str(sum(a == b for a, b in zip(sides[s][3], ref[3]))) for s in SIDES)])
        served_s, lm_s = sides["evalkit served"][0], sides["lm-eval local-completions"][0]
        if ref[2]:
            rows.append([f"{task}: max abs Δ log-likelihood, every local-completions setting", "",
                         f"{max(max(abs(a - b) for a, b in zip(o[2], ref[2])) for o in every[task]):.2e}", ""])
        if ref[3]:
            rows.append([f"{task}: generations identical, every local-completions setting", "",
                         str(min(sum(a == b for a, b in zip(o[3], ref[3])) for o in every[task])), ""])
        rows.append([f"{task}: local-completions' fastest setting (num_concurrent x batch_size)", "", best[task], ""])
        rows.append([f"{task}: evalkit served ÷ local-completions", f"{served_s / lm_s:.2f}", "", ""])
    total = {s: sum(found[t][s][0] for t in found) for s in SIDES}
    rows.append(["**all tasks**: seconds", *(f"{total[s]:.1f}" for s in SIDES)])
    rows.append(["server start (evalkit's endpoint.serve, probe included), s", f"{server_start:.1f}", "", ""])
    text = "\n".join([f"- command: python benchmarks/served.py {' '.join(argv)}",
                      f"- machine: {os.cpu_count()} cores; load average at start {os.getloadavg()[0]:.2f}",
                      f"- server: {served.describe()['deployment']}", "",
                      tabulate(rows, headers=["measure", *SIDES], tablefmt="github", disable_numparse=True), "",
                      "evalkit_bench_fewshot_gen on the same server, by endpoint.max_concurrency (cold prefix cache):", "",
                      tabulate(by_concurrency, headers=["max_concurrency", "seconds", "most in flight"],
                               tablefmt="github", disable_numparse=True), "",
                      "Start of each client in a fresh process (seconds, the fastest of 3):", "",
                      tabulate(starts, headers=["client", "parts", "total", "imported"], tablefmt="github",
                               disable_numparse=True)])
    print(text)
    Path(options.out).write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
