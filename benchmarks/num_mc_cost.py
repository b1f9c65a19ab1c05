"""Where a served run's time goes on one task (issue 31: evalkit_bench_num_mc, a tie with local-completions):
evalkit served and lm-eval's local-completions on one vLLM server, in turn, each from a cold prefix cache.

The server is started as benchmarks/served.py starts it (evalkit's ``endpoint.serve``, float32, eager). For
each run of each side: the wall of evaluate / simple_evaluate, the client's CPU seconds (this process, every
thread), the server's CPU seconds (its process tree: API server, engine core and worker, from /proc), and what the
server's /metrics counted (requests to /v1/completions, prompt tokens, response bytes). For evalkit, the seconds
spent inside the engine's score/generate calls besides (the rest is the harness: lm-eval's task, requests,
metrics, the results files); for local-completions, inside its request methods (TemplateAPI's
_loglikelihood_tokens and generate_until), both as wall and as this process's CPU. ``--profile FILE`` writes a
cProfile of evalkit's last run and prints its top functions by own time. The client and the server share the
machine's cores: a client CPU-second is taken from the server.

``--variants N`` instead sends the task's whole prompt reads (those ``engine=served`` sends for
evalkit_bench_num_mc: chain_cost.py's ``num_mc``) through the served client alone, N times each way in turn,
to see what a request option or the in-flight window changes on the server: ``prompt_logprobs`` 1 (evalkit's),
0 (the token's own entry only) or none (the forward alone, no rows), 16 prompts a request (evalkit's) or all
120 in one, the window starting at 32 or 128 prompts. Per way: the median wall, the CPU seconds of the server's
API process, engine core and worker, and the JSON bytes answered.

Run: flock /tmp/engine-tests.lock .venv/bin/python -m benchmarks.num_mc_cost [--repeats 3] [--setting 32x8]
     [--task evalkit_bench_num_mc] [--profile /tmp/served.prof] [--variants 10]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import EMBEDDED
from benchmarks.common.served_side import SETTINGS, evalkit_task, lm_eval_task, num_mc, reset_prefix_cache

MEASURES = ("wall s", "client CPU s", "server CPU s", "requests", "prompt tokens", "response kB", "in engine s",
            "client CPU in engine s")


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) of the process pid and every process under it, so far."""
    return sum(server_parts(pid).values())


def server_parts(pid: int) -> dict[str, float]:
    """The same by part: vLLM's worker (the model), its engine core (the scheduler), the rest (the API server)."""
    import psutil

    root, found = psutil.Process(pid), {"api": 0.0, "engine core": 0.0, "worker": 0.0}
    for process in [root, *root.children(recursive=True)]:
        name = process.name()
        part = "worker" if "Worker" in name else "engine core" if "EngineCore" in name else "api"
        found[part] += sum(process.cpu_times()[:2])
    return found


def variants_table(served: Any, pid: int, repeats: int) -> str:
    """The whole reads of evalkit_bench_num_mc sent each way in turn (see the module's docstring)."""
    import json

    import evalkit.engine.served.http as http
    from evalkit.engine.served.batch import joined
    from evalkit.engine.served.body import prompt_logprobs_body, salt
    from evalkit.engine.served.concurrency import Window

    requests, root, kept = num_mc(served), served.client.root(), http.Window

    def bodies(top: int | None, bundle: int) -> list[dict]:
        made = [prompt_logprobs_body(r.ids, served.model, salt(), top or 0) for r in requests]
        made = [{k: v for k, v in b.items() if k != "prompt_logprobs" or top is not None} for b in made]
        return [joined(made, list(range(i, min(i + bundle, len(made))))) for i in range(0, len(made), bundle)]

    ways = {"evalkit's: prompt_logprobs 1, 16 a request, window from 32": (1, 16, 32),
            "window from 128": (1, 16, 128), "prompt_logprobs 0, window from 128": (0, 16, 128),
            "all 120 in one request": (1, 120, 128), "no prompt_logprobs (no rows), window from 128": (None, 16, 128)}
    found: dict[str, list[tuple]] = {way: [] for way in ways}
    try:
        for _ in range(repeats):
            for way, (top, bundle, start) in ways.items():
                http.Window = lambda cap, start=start: Window(cap=cap, limit=min(cap, start))
                sent = bodies(top, bundle)
                reset_prefix_cache(root)
                before, started = server_parts(pid), time.perf_counter()
                answers = served.client.post_many("/completions", sent)
                wall, after = time.perf_counter() - started, server_parts(pid)
                if not all(isinstance(a, dict) and len(a.get("choices") or ()) == http.prompts_in(b)
                           for a, b in zip(answers, sent)):
                    raise RuntimeError(f"{way}: an answer is not the request's: {answers[0]}")
                found[way].append((wall, *(after[k] - before[k] for k in after),
                                   sum(len(json.dumps(a)) for a in answers) / 1000))
    finally:
        http.Window = kept
    from tabulate import tabulate

    rows = [[way, *(f"{statistics.median(r[i] for r in runs):.2f}" for i in range(5)),
             " ".join(f"{r[0]:.2f}" for r in runs)] for way, runs in found.items()]
    return tabulate(rows, headers=["120 whole reads sent", "wall s (median)", "API CPU s", "engine core CPU s",
                                   "worker CPU s", "JSON kB", "every wall, in turn"], tablefmt="github",
                    disable_numparse=True)


def metrics(root: str) -> dict[str, float]:
    """/v1/completions requests and response bytes, and prompt tokens, counted by the server so far."""
    import urllib.request

    with urllib.request.urlopen(f"{root}/metrics", timeout=60) as answer:
        lines = answer.read().decode().splitlines()
    found = {"requests": 0.0, "prompt tokens": 0.0, "response kB": 0.0}
    for line in lines:
        value = line.rsplit(" ", 1)[-1]
        if 'handler="/v1/completions"' in line and line.startswith("http_requests_total{"):
            found["requests"] += float(value)
        elif 'handler="/v1/completions"' in line and line.startswith("http_response_size_bytes_sum{"):
            found["response kB"] += float(value) / 1000
        elif line.startswith("vllm:prompt_tokens_total{"):
            found["prompt tokens"] += float(value)
    return found


def measured(root: str, pid: int, run: Callable[[], Any]) -> dict[str, float]:
    """run()'s wall, this process's CPU, the server's CPU and /metrics counts, from a cold prefix cache."""
    reset_prefix_cache(root)
    before, server_before, cpu_before, started = metrics(root), server_cpu(pid), cpu(), time.perf_counter()
    run()
    wall, cpu_after, server_after, after = time.perf_counter() - started, cpu(), server_cpu(pid), metrics(root)
    return {"wall s": wall, "client CPU s": cpu_after - cpu_before, "server CPU s": server_after - server_before,
            **{k: after[k] - before[k] for k in after}}


def cpu() -> float:
    """This process's CPU seconds so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Timed:
    """Adds up the wall and this process's CPU seconds of the calls clocked: the served engine's score/generate
    calls (``engine``, the engine protocol around it), or lm-eval's TemplateAPI request methods (``patched``)."""

    def __init__(self, engine: Any = None) -> None:
        from evalkit.engine.wrapper import KeptRunning

        self.seconds, self.cpu = 0.0, 0.0
        timer = self

        class Clocked(KeptRunning):
            def score(self, *args: Any, **kwargs: Any) -> Any:
                return timer.clock(lambda: self.engine.score(*args, **kwargs))

            def generate(self, *args: Any, **kwargs: Any) -> Any:
                return timer.clock(lambda: self.engine.generate(*args, **kwargs))

        self.engine = Clocked(engine) if engine is not None else None

    def clock(self, call: Callable[[], Any]) -> Any:
        started, cpu_started = time.perf_counter(), cpu()
        try:
            return call()
        finally:
            self.seconds += time.perf_counter() - started
            self.cpu += cpu() - cpu_started

    def patched(self) -> Any:
        """A context in which lm-eval's TemplateAPI (local-completions) request methods are clocked."""
        import contextlib

        from lm_eval.models.api_models import TemplateAPI

        @contextlib.contextmanager
        def context() -> Any:
            kept = {name: getattr(TemplateAPI, name) for name in ("_loglikelihood_tokens", "generate_until")}
            for name, method in kept.items():
                setattr(TemplateAPI, name, lambda lm, *a, _m=method, **k: self.clock(lambda: _m(lm, *a, **k)))
            try:
                yield
            finally:
                for name, method in kept.items():
                    setattr(TemplateAPI, name, method)

        return context()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="evalkit_bench_num_mc")
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--setting", default="32x8", help="local-completions' num_concurrent x batch_size")
    parser.add_argument("--profile", default="", help="cProfile file of evalkit's last run")
    parser.add_argument("--variants", type=int, default=0, help="time the whole reads' ways this many times instead")
    options = parser.parse_args(argv)

    import cProfile
    import pstats

    from evalkit.config import compose_config
    from evalkit.engine.factory import start_served
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.run import evaluate as evaluate_module

    load = os.getloadavg()
    model_dir = resolve_model_path(EMBEDDED)
    out = Path(tempfile.mkdtemp(prefix="evalkit-num-mc-cost-"))
    base = [f"vllm_path={model_dir}", f"limit={options.limit}", *SETTINGS]
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    served = start_served(compose_config([*base, "engine=served", "endpoint.serve=true", "gpu_memory_utilization=0.15",
                                          f"output_dir={out / 'server'}"]), model_dir)
    root, pid = served.client.root(), served.server.process.pid
    concurrent, batch = map(int, options.setting.split("x"))
    cfg = [*base, "engine=served", f"endpoint.url={served.client.url}", f"output_dir={out / 'served'}"]
    runs: dict[str, list[dict[str, float]]] = {"evalkit served": [], "local-completions": []}
    profiler = cProfile.Profile()
    if options.variants:
        try:
            table = variants_table(served, pid, options.variants)
        finally:
            served.close()
        print(f"load average at start {load[0]:.2f}, at the end {os.getloadavg()[0]:.2f}\n{table}")
        return
    try:
        for side in runs:  # one warm-up each: the server's first reads of a shape, lm-eval's first task build
            measured(root, pid, lambda: (evalkit_task(cfg, served, options.task) if side == "evalkit served" else
                                         lm_eval_task(served.client.url, served.model, model_dir, options.task,
                                                      options.limit, concurrent, batch)))
        for repeat in range(options.repeats):
            timed = Timed(served)
            last = options.profile and repeat == options.repeats - 1

            def ours() -> Any:
                return (profiler.runcall if last else (lambda f, *a, **k: f(*a, **k)))(
                    evaluate_module.evaluate, compose_config([*cfg, f"tasks=[{options.task}]"]),
                    engine_factory=lambda c, d: timed.engine)

            runs["evalkit served"].append({**measured(root, pid, ours), "in engine s": timed.seconds,
                                           "client CPU in engine s": timed.cpu})
            theirs = Timed()
            with theirs.patched():
                runs["local-completions"].append(measured(root, pid, lambda: lm_eval_task(
                    served.client.url, served.model, model_dir, options.task, options.limit, concurrent, batch)))
            runs["local-completions"][-1].update({"in engine s": theirs.seconds, "client CPU in engine s": theirs.cpu})
            print(repeat, {s: f"{r[-1]['wall s']:.2f} s" for s, r in runs.items()}, flush=True)
    finally:
        served.close()
    from tabulate import tabulate

    rows = [[m, *(" / ".join(f"{r.get(m, float('nan')):.2f}" for r in runs[s]) + f" (median "
                  f"{statistics.median(r.get(m, float('nan')) for r in runs[s]):.2f})" for s in runs)]
            for m in MEASURES]
    print(f"task {options.task}, limit {options.limit}, local-completions {options.setting}; load average at start "
          f"{load[0]:.2f}, at the end {os.getloadavg()[0]:.2f}; counters: {dict(served.scoring_counts())}")
    print(tabulate(rows, headers=["per run", *runs], tablefmt="github", disable_numparse=True))
    if options.profile:
        profiler.dump_stats(options.profile)
        pstats.Stats(options.profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main(sys.argv[1:])
