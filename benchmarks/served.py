"""A vLLM server evaluated three ways, against the offline engine: evalkit served, lm-eval's local-completions, and
evalkit offline (the reference), on the same documents. One table.

One ``vllm.entrypoints.openai.api_server`` of the embedded model (float32, eager, max_model_len 4096), started by
evalkit's own ``endpoint.serve`` code and already up before any side's clock starts:

* **evalkit served**: ``evaluate`` with ``engine=served`` on that server (its probe done at engine start, before
  the clock), ``endpoint.max_concurrency`` at its default (256: as many in flight as the server batches);
* **lm-eval local-completions**: lm-eval's ``LocalCompletionsAPI`` on the same server, as a careful user sets it:
  token ids (``tokenized_requests=True``), the same local tokenizer, ``max_length=4096`` (its default 2048 would
  cut prompts); each of ``--lm-eval-settings`` (``num_concurrent`` x ``batch_size``, prompts per request) is
  run once on every task (the sweep), and every setting's answers are checked against the offline engine's;
* **evalkit offline**: ``evaluate`` on a ``vllm.LLM`` in this process (the reference every side is compared with).

How the two clients are compared ("its best settings", issue 31): a single run of one side varies by 10-40 %
on this shared machine, so the fastest of the sweep's four runs would be a minimum set against one run of
evalkit. The sweep only chooses local-completions' setting for each task (its fastest); then evalkit served and
local-completions at that setting run in turn, ``--repeats`` times each (served, lm-eval, served, lm-eval,
...), each from a cold prefix cache, and each side's median is shown with its spread (fastest-slowest). The
verdict for a task is on the medians: evalkit served is "no slower" where its median is at most
local-completions'.

Seconds are each side's wall for the task as its command runs it, from loading the task to writing the results and
samples (evalkit's run folder; lm-eval's files as its CLI writes them with ``--output_path --log_samples``); evalkit's
engine and lm-eval's client (its tokenizer loaded) are both built before the clock, the server already up. Every
run starts with a cold prefix cache: the server runs with ``VLLM_SERVER_DEV_MODE=1`` and its
``/reset_prefix_cache`` is called before each run (else a run would find the one before's prompts cached).
lm-eval's environment facts for its results (``add_env_info``: torch's ``collect_env``, a dozen subprocesses,
about 0.3 s of CPU here) are gathered by lm-eval on every ``simple_evaluate`` call, and by evalkit once per
process, in a thread beside its first run's requests (``evalkit/harness/lm_eval_compat.py``): evalkit's first
run on the engine pays them, its later runs (as a sweep's later points) do not.
Agreement: greedy generations identical to the offline engine's, and the largest |Δ log-likelihood| over
every choice, over every run of a side. Tasks: evalkit_facts (0-shot, 4 numeric/short choices),
evalkit_bench_mc (4 choices behind a ~250-token few-shot context), evalkit_arith (3-shot generation),
evalkit_bench_num_mc (4 choices of 4-6 digits, each several tokens) and evalkit_bench_fewshot_gen (5-shot
generation of up to 128 tokens), 30 documents each by default (the last two made by the seeded make_data.py in
benchmarks/tasks/, issue 31).

Two more tables (issue 31): the generation task's seconds against ``endpoint.max_concurrency`` on the same server,
and the start of each client in a fresh process (imports, tokenizer, evalkit's probe; lm-eval's model init).

Run: .venv/bin/python -m benchmarks.served [--limit N] [--repeats 3] [--lm-eval-settings 8x8,32x1,...]
     [--out benchmarks/served.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import EMBEDDED, ROOT
from benchmarks.common.evalkit_side import environment_restored
from benchmarks.common.provenance import provenance
from benchmarks.common.served_side import SETTINGS, evalkit_task, lm_eval_task, reset_prefix_cache
from benchmarks.common.table import primary_metric

TASKS = ["evalkit_facts", "evalkit_bench_mc", "evalkit_arith", "evalkit_bench_num_mc", "evalkit_bench_fewshot_gen"]
LM_EVAL_SETTINGS = ["8x8", "32x1", "32x8", "64x16"]  # local-completions' num_concurrent x batch_size, tried on each task
CONCURRENCY = [1, 4, 16, 256]  # endpoint.max_concurrency values timed on the generation task
SIDES = ("evalkit served", "lm-eval local-completions", "evalkit offline")


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
    """Rows: each client's start in fresh processes (tries each, taking turns; the fastest's parts, the fastest
    and the median total): evalkit's served engine (imports, the tokenizer with the probe's round trips in a
    thread beside it, then the rest of the probe and of start_served) and lm-eval's LocalCompletionsAPI (import,
    init)."""
    import subprocess

    def once(code: str, *args: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout.split()

    # the two clients take turns, so that a machine whose load drifts (an engine still settling) weighs on both
    runs = [(once(EVALKIT_START, url, model_dir), once(LM_EVAL_START, url, model_dir, model)) for _ in range(tries)]
    ours, theirs = [r[0] for r in runs], [r[1] for r in runs]
    fast, slow = min(ours, key=lambda r: float(r[-3])), min(theirs, key=lambda r: float(r[-3]))
    middle = [statistics.median(float(r[-3]) for r in side) for side in (ours, theirs)]
    return [["evalkit served: imports / tokenizer (the probe's round trips beside it) / the rest of the probe",
             f"{fast[0]} / {fast[1]} / {fast[2]}", f"{fast[3]} / {middle[0]:.2f}", f"vllm {fast[4]}, torch {fast[5]}"],
            ["lm-eval local-completions: import / model init", f"{slow[0]} / {slow[1]}", f"{slow[2]} / {middle[1]:.2f}",
             f"vllm {slow[3]}, torch {slow[4]}"]]


def server_counts(root: str) -> dict[str, float]:
    """The server's counters so far: /v1/completions requests answered and prompt tokens prefilled (/metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"{root}/metrics", timeout=60) as answer:
        lines = answer.read().decode().splitlines()
    found = {"requests": 0.0, "prompt tokens": 0.0}
    for line in lines:
        if line.startswith("http_requests_total{") and 'handler="/v1/completions"' in line:
            found["requests"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prompt_tokens_total{"):
            found["prompt tokens"] += float(line.rsplit(" ", 1)[1])
    return found


def counted(root: str, run: Any) -> tuple:
    """run()'s answer with what it cost besides seconds: the server's requests and prompt tokens, and this
    process's CPU seconds (the client's own work; it shares the machine's cores with the server)."""
    import resource

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    before, cpu_before = server_counts(root), cpu()
    answer = run()
    after, cpu_after = server_counts(root), cpu()
    return (*answer, {**{k: after[k] - before[k] for k in after}, "client CPU s": cpu_after - cpu_before})


def spread(seconds: list[float]) -> str:
    """The median of a side's runs with their spread: '5.1 (4.8-5.9)'."""
    return f"{statistics.median(seconds):.1f} ({min(seconds):.1f}-{max(seconds):.1f})"


def compare_task(task: str, served: Any, offline: Any, base: list[str], model_dir: str, limit: int,
                 settings: list[str], repeats: int, out: Path) -> dict[str, Any]:
    """One task: local-completions' sweep (one run per setting, the fastest chosen), then evalkit served and
    local-completions at the chosen setting in turn, repeats runs each, then evalkit offline once; every run from
    a cold prefix cache. Returns every run's (seconds, results, log-likelihoods, generations)."""
    root = served.client.root()

    def on_server() -> tuple:
        reset_prefix_cache(root)
        return counted(root, lambda: evalkit_task([*base, "engine=served", f"endpoint.url={served.client.url}",
                                                   f"output_dir={out / 'served'}"], served, task))

    def lm_eval(setting: str) -> tuple:
        reset_prefix_cache(root)
        concurrent, batch = map(int, setting.split("x"))
        return counted(root, lambda: lm_eval_task(served.client.url, served.model, model_dir, task, limit,
                                                  concurrent, batch))

    sweep = {setting: lm_eval(setting) for setting in settings}
    best = min(sweep, key=lambda k: sweep[k][0])
    print(task, "sweep", {k: f"{v[0]:.1f} s" for k, v in sweep.items()}, "best", best, flush=True)
    runs: dict[str, list[tuple]] = {SIDES[0]: [], SIDES[1]: []}
    for _ in range(repeats):  # in turn, so that load drifting under the benchmark weighs on both
        runs[SIDES[0]].append(on_server())
        runs[SIDES[1]].append(lm_eval(best))
        print(task, {side: f"{r[-1][0]:.1f} s" for side, r in runs.items()}, flush=True)
    offline.llm.reset_prefix_cache()
    runs[SIDES[2]] = [evalkit_task([*base, f"output_dir={out / 'offline'}"], offline, task)]
    return {"runs": runs, "sweep": sweep, "best": best}


def task_rows(task: str, found: dict[str, Any]) -> list[list[str]]:
    """The table's rows of one task: medians and spreads, scores, agreement over every run, the sweep."""
    runs, sweep, ref = found["runs"], found["sweep"], found["runs"][SIDES[2]][0]
    n = {s: len(runs[s]) for s in SIDES}
    rows = [[f"**{task}**: seconds, median of runs (fastest-slowest)", *(spread([r[0] for r in runs[s]]) for s in SIDES)],
            [f"{task}: runs", *(str(n[s]) for s in SIDES)],
            [f"{task}: score ({primary_metric(ref[1])[0]})",
             *(" / ".join(sorted({f"{primary_metric(r[1])[1]:.3f}" for r in runs[s]})) for s in SIDES)]]
    if ref[2]:
        rows.append([f"{task}: max abs Δ log-likelihood vs offline ({len(ref[2])} choices), every run",
                     *(f"{max(max(abs(a - b) for a, b in zip(r[2], ref[2])) for r in runs[s]):.2e}"
                       if all(len(r[2]) == len(ref[2]) for r in runs[s]) else "n/a" for s in SIDES)])
        rows.append([f"{task}: max abs Δ log-likelihood, every local-completions setting", "",
                     f"{max(max(abs(a - b) for a, b in zip(o[2], ref[2])) for o in sweep.values()):.2e}", ""])
    if ref[3]:
        rows.append([f"{task}: generations identical to offline (of {len(ref[3])}), fewest over runs",
                     *(str(min(sum(a == b for a, b in zip(r[3], ref[3])) for r in runs[s])) for s in SIDES)])
        rows.append([f"{task}: generations identical, every local-completions setting", "",
                     str(min(sum(a == b for a, b in zip(o[3], ref[3])) for o in sweep.values())), ""])
    for what in ("requests", "prompt tokens", "client CPU s"):
        rows.append([f"{task}: {what} to the server, median of runs" if what != "client CPU s" else
                     f"{task}: client CPU seconds (this process), median of runs",
                     *(f"{statistics.median(r[4][what] for r in runs[s]):.{1 if 'CPU' in what else 0}f}"
                       for s in SIDES[:2]), ""])
    rows.append([f"{task}: local-completions' sweep, one run each (num_concurrent x batch_size: s)", "",
                 ", ".join(f"{k} {v[0]:.1f}" for k, v in sweep.items()) + f"; chosen {found['best']}", ""])
    ours, theirs = (statistics.median(r[0] for r in runs[s]) for s in SIDES[:2])
    rows.append([f"{task}: evalkit served ÷ local-completions (medians)", f"{ours / theirs:.2f}: "
                 + ("no slower" if ours <= theirs else "SLOWER"), "", ""])
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=30, help="documents per task")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each client at the chosen setting")
    parser.add_argument("--lm-eval-settings", default=",".join(LM_EVAL_SETTINGS),
                        help="local-completions' num_concurrent x batch_size settings swept on each task")
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

    load = os.getloadavg()
    model_dir = resolve_model_path(EMBEDDED)
    out = Path(tempfile.mkdtemp(prefix="evalkit-served-bench-"))
    base = [f"vllm_path={model_dir}", f"limit={options.limit}", *SETTINGS]
    started = time.perf_counter()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the server's /reset_prefix_cache, between runs
    served = start_served(compose_config([*base, "engine=served", "endpoint.serve=true", "gpu_memory_utilization=0.15",
                                          f"output_dir={out / 'server'}"]), model_dir)
    server_start = time.perf_counter() - started
    with environment_restored():  # lm-eval's client and the server must not see the offline engine's variables
        offline = start_vllm(compose_config([*base, "gpu_memory_utilization=0.25"]), model_dir)
    found: dict[str, dict[str, Any]] = {}
    try:
        starts = [] if options.no_start else start_times(served.client.url, served.model, model_dir)
        print(starts, flush=True)
        for task in options.tasks.split(","):
            found[task] = compare_task(task, served, offline, base, model_dir, options.limit,
                                       options.lm_eval_settings.split(","), options.repeats, out)
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

    rows = [row for task in found for row in task_rows(task, found[task])]
    total = {s: sum(statistics.median(r[0] for r in found[t]["runs"][s]) for t in found) for s in SIDES}
    rows.append(["**all tasks**: seconds, sum of the medians", *(f"{total[s]:.1f}" for s in SIDES)])
    rows.append(["server start (evalkit's endpoint.serve, probe included), s", f"{server_start:.1f}", "", ""])
    text = "\n".join([f"- command: python -m benchmarks.served {' '.join(argv)}", f"- {provenance()}",
                      f"- machine: {os.cpu_count()} cores; load average at start {load[0]:.2f} {load[1]:.2f} "
                      f"{load[2]:.2f}, at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
                      f"- server: {served.describe()['deployment']}", "",
                      tabulate(rows, headers=["measure", *SIDES], tablefmt="github", disable_numparse=True), "",
                      "evalkit_bench_fewshot_gen on the same server, by endpoint.max_concurrency (cold prefix cache; "
                      "in flight counts prompts):", "",
                      tabulate(by_concurrency, headers=["max_concurrency", "seconds", "most in flight"],
                               tablefmt="github", disable_numparse=True), "",
                      "Start of each client in a fresh process (seconds; the two take turns, 3 each):", "",
                      tabulate(starts, headers=["client", "parts (of its fastest start)", "fastest / median total",
                                                "imported"], tablefmt="github", disable_numparse=True)])
    print(text)
    Path(options.out).write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
