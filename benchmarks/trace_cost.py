"""Where a traced score's time goes on one task (issue 32: evalkit_bench_mc, +81 % with divergence_top_k=20):
the task's score requests, as a run hands them to the engine, scored with top_k=0 (the scoring paths) and
top_k=k (one pass by traces, evalkit/engine/vllm/trace_from_cache.py) on one vLLM engine, prefix cache cold each time.

The requests come from one run of the task at k=0 (its score calls, recorded). Then, for each repeat and each
side in turn, the score call alone is timed, and every ``llm.generate`` call inside it is recorded: its
requests, the prompt tokens sent, the tokens vLLM computed (prompt length less ``num_cached_tokens``), the
prompt rows asked (the tokens computed by the requests that ask ``prompt_logprobs``: V1 writes a row at each),
and its seconds; then the largest difference between the two sides' scores. ``--profile FILE`` writes a
cProfile of the last traced call (vLLM runs in this process) and prints its top functions by cumulative time.
Run: flock /tmp/engine-tests.lock .venv/bin/python -m benchmarks.trace_cost [--task evalkit_bench_mc]
     [--limit 30] [--repeats 3] [--k 20] [--profile /tmp/trace.prof]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import EMBEDDED
from benchmarks.common.evalkit_side import OFFLINE_SETTINGS, RecordingEngine, environment_restored, warm_up


def recorded_requests(base: list[str], engine: Any, task: str, out: Path) -> list[Any]:
    """The score requests one run of task at divergence_top_k=0 hands the engine, in order."""
    from evalkit.config import compose_config
    from evalkit.engine.wrapper import KeptRunning
    from evalkit.run.evaluate import evaluate

    recorder = RecordingEngine(KeptRunning(engine))
    evaluate(compose_config([*base, f"tasks=[{task}]", "divergence_top_k=0", "resume=false", f"output_dir={out}"]),
             engine_factory=lambda c, d: recorder)
    return [r for call in recorder.calls if call.kind == "score" for r in call.requests]


class Counted:
    """llm.generate wrapped: each call's requests, tokens sent and computed, prompt rows and seconds."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.generate, self.calls = llm, llm.generate, []

    def __call__(self, prompts: Any, params: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        outputs = self.generate(prompts, params, **kwargs)
        seconds = time.perf_counter() - started
        many = params if isinstance(params, list) else [params] * len(outputs)
        computed = [len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outputs]
        self.calls.append({"requests": len(outputs), "sent": sum(len(o.prompt_token_ids) for o in outputs),
                           "computed": sum(computed), "seconds": seconds,
                           "rows": sum(c for c, p in zip(computed, many) if p.prompt_logprobs is not None),
                           "kinds": sorted({kind(p) for p in many})})
        return outputs


def kind(params: Any) -> str:
    if params.prompt_logprobs is not None:
        return f"prompt_logprobs={params.prompt_logprobs}"
    if params.logprob_token_ids:
        return "logprob_token_ids"
    return f"logprobs={params.logprobs}" if params.logprobs is not None else "no rows"


def timed(engine: Any, requests: list[Any], k: int, profile: str | None = None) -> tuple[float, list[dict], list]:
    """The seconds of engine.score(requests, top_k=k) from a cold prefix cache, its generate calls, its answers."""
    engine.llm.reset_prefix_cache()
    counted = Counted(engine.llm)
    engine.llm.generate = counted
    profiler = cProfile.Profile() if profile else None
    try:
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        answers = engine.score(requests, top_k=k)
        if profiler:
            profiler.disable()
        seconds = time.perf_counter() - started
    finally:
        del engine.llm.generate
    if profiler:
        profiler.dump_stats(profile)
    return seconds, counted.calls, answers


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="evalkit_bench_mc")
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--profile", default=None)
    args = parser.parse_args(argv)
    from evalkit.config import compose_config
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.vllm.start import start_vllm

    model_dir = resolve_model_path(EMBEDDED)
    base = [f"vllm_path={model_dir}", f"limit={args.limit}", *OFFLINE_SETTINGS]
    with environment_restored(), tempfile.TemporaryDirectory() as tmp:
        engine = start_vllm(compose_config(base), model_dir, sole_engine=True)
        try:
            warm_up(engine.llm)
            requests = recorded_requests(base, engine, args.task, Path(tmp))
            lengths = [len(r.ids) - r.start for r in requests]
            print(f"{args.task}: {len(requests)} requests, continuations of {min(lengths)} to {max(lengths)} "
                  f"tokens ({sum(lengths)} positions), contexts of {min(r.start for r in requests)} to "
                  f"{max(r.start for r in requests)} tokens, block {engine.block_size}, runner {engine.runner}")
            best: dict[int, tuple[float, list[dict], list]] = {}
            for repeat in range(args.repeats):
                for k in (0, args.k):
                    last = repeat == args.repeats - 1 and k == args.k
                    seconds, calls, answers = timed(engine, requests, k, args.profile if last else None)
                    print(f"k={k}: {seconds:.2f} s", flush=True)
                    if k not in best or seconds < best[k][0]:
                        best[k] = (seconds, calls, answers)
        finally:
            engine.close()
    plain, traced = best[0][2], best[args.k][2]
    print(f"\nscores of k={args.k} against k=0: max abs difference "
          f"{max(abs(a.logprob - b.logprob) for a, b in zip(plain, traced)):.2e}, is_greedy differs in "
          f"{sum(a.is_greedy != b.is_greedy for a, b in zip(plain, traced))} of {len(plain)}")
    for k, (seconds, calls, _) in best.items():
        print(f"\nk={k}, fastest {seconds:.2f} s: generate calls")
        print("| requests | kinds | tokens sent | computed | prompt rows | s |\n|---|---|---|---|---|---|")
        for c in calls:
            print(f"| {c['requests']} | {', '.join(c['kinds'])} | {c['sent']} | {c['computed']} | {c['rows']} | "
                  f"{c['seconds']:.2f} |")
    if args.profile:
        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main(sys.argv[1:])
