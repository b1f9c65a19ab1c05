"""What next-token chains cost a vLLM server against reading each continuation whole (``served/body.py``'s
``chaining_pays``), with the chains' reads bundled into requests (``served/batch.py``) or sent one a request.

One ``vllm.entrypoints.openai.api_server`` of the embedded model, started by evalkit's ``endpoint.serve`` as
benchmarks/served.py starts it. For each shape (questions x context tokens x choices x tokens a choice, random
token ids: the forward's cost does not depend on which), the same continuations are scored three ways through
the engine's own reader (``VLLMApi``), each from a cold prefix cache, ``--repeats`` times (the median kept):

* **prompt reads**: each continuation's prompt log-probabilities, 16 prompts a request (``_prompt_logprobs``);
* **chains, bundled**: the next-token read of every distinct context, 16 a request (``_chained``);
* **chains, one a request**: the same reads, each its own request (as before issue 31's bundling of them).

Prints one table with each way's requests, prompts, prompt tokens the server computed (its /metrics: prompt
tokens less those its prefix cache held) and rows of prompt log-probabilities, and the seconds per request, per
prompt, per computed token and per prompt row that a non-negative least-squares fit over the medians finds (the constants
``chaining_pays`` uses). A warm-up of each way runs first and is not counted (vLLM's first reads of a shape).
Run: .venv/bin/python -m benchmarks.chain_cost [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import EMBEDDED
from benchmarks.common.served_side import SETTINGS, num_mc, reset_prefix_cache

# (questions, context tokens, choices a question, tokens a choice); "num_mc": evalkit_bench_num_mc's first 30 docs
SHAPES = ["num_mc", (30, 15, 4, 6), (30, 15, 4, 1), (30, 15, 4, 3), (30, 60, 4, 6), (10, 250, 4, 6), (10, 250, 4, 1)]


def shaped(questions: int, context: int, choices: int, length: int, seed: int) -> list:
    """ScoreRequests of random token ids: choices of a question share their first token half the time (as
    numbers of several digits do), so chains share some contexts."""
    from evalkit.contracts import ScoreRequest

    rng = random.Random(seed)
    requests = []
    for _ in range(questions):
        ids = tuple(rng.randrange(1000, 40000) for _ in range(context))
        head = rng.randrange(1000, 40000)
        for c in range(choices):
            first = head if c % 2 else rng.randrange(1000, 40000)
            tail = [first] + [rng.randrange(1000, 40000) for _ in range(length - 1)]
            requests.append(ScoreRequest(ids=ids + tuple(tail[:length]), start=context))
    return requests


def computed(root: str) -> float:
    """Prompt tokens the server has computed so far: prompt tokens less those its prefix cache held."""
    import urllib.request

    with urllib.request.urlopen(f"{root}/metrics", timeout=60) as answer:
        lines = answer.read().decode().splitlines()
    total = 0.0
    for line in lines:
        if line.startswith(("vllm:prompt_tokens_total{", "vllm:prompt_tokens_cached_total{")):
            total += float(line.rsplit(" ", 1)[1]) * (1 if line.startswith("vllm:prompt_tokens_total") else -1)
    return total


def timed(served, way: str, requests: list) -> dict:
    """Seconds of one way over requests from a cold cache, with the requests, prompts, computed prompt tokens
    and prompt log-probability rows it cost."""
    from evalkit.engine.logprob_reads import next_token_asks, token_steps
    from evalkit.engine.served.batch import bundles
    from evalkit.engine.served.body import MAX_LOGPROB_TOKEN_IDS, next_token_body, prompt_logprobs_body

    reader, sender = served.reader, served.reader.sender
    sender.most = 1 if way == "chains, one a request" else 16
    if way == "prompt reads":
        bodies = [prompt_logprobs_body(r.ids, "m", str(i)) for i, r in enumerate(requests)]
        rows = sum(len(r.ids) for r in requests)
    else:
        _, unique = token_steps(requests)
        asks = next_token_asks(unique, MAX_LOGPROB_TOKEN_IDS)
        bodies = [next_token_body(c, ids, "m", "s") for c, ids in asks]
        rows = 0
    root = served.client.root()
    reset_prefix_cache(root)
    before = computed(root)
    started = time.perf_counter()
    scored = (reader._prompt_logprobs if way == "prompt reads" else reader._chained)(requests, None)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "requests": len(bundles(bodies, sender.bundle)), "prompts": len(bodies),
            "tokens": int(computed(root) - before), "rows": rows, "scored": scored}


def fit(runs: list[dict]) -> list[float]:
    """Seconds per request, per prompt, per computed token, per prompt row: non-negative least squares over
    each way's median (no intercept)."""
    import numpy as np
    from scipy.optimize import nnls

    design = np.array([[r["requests"], r["prompts"], r["tokens"], r["rows"]] for r in runs], dtype=float)
    return list(nnls(design, np.array([r["seconds"] for r in runs]))[0])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way on each shape")
    options = parser.parse_args(argv)

    from tabulate import tabulate

    from evalkit.config import compose_config
    from evalkit.engine.factory import start_served
    from evalkit.engine.machine.preflight import resolve_model_path

    load = os.getloadavg()
    model_dir = resolve_model_path(EMBEDDED)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    out = Path(tempfile.mkdtemp(prefix="evalkit-chain-cost-"))
    served = start_served(compose_config([f"vllm_path={model_dir}", *SETTINGS, "engine=served", "endpoint.serve=true",
                                          "gpu_memory_utilization=0.15", f"output_dir={out}"]), model_dir)
    ways = ("prompt reads", "chains, bundled", "chains, one a request")
    rows, every = [], []
    try:
        for way in ways:  # warm-up, not counted
            timed(served, way, shaped(*SHAPES[1], 99))
        for seed, shape in enumerate(SHAPES):
            requests = num_mc(served) if shape == "num_mc" else shaped(*shape, seed)
            found = {way: [timed(served, way, requests) for _ in range(options.repeats)] for way in ways}
            worst = max(abs(a.logprob - b.logprob) for way in ways[1:] for run in found[way]
                        for a, b in zip(run["scored"], found[ways[0]][0]["scored"]))
            for way in ways:
                first = found[way][0]
                every.append({**first, "seconds": statistics.median(r["seconds"] for r in found[way])})
                name = shape if shape == "num_mc" else "x".join(map(str, shape))
                rows.append([name, way, f"{statistics.median(r['seconds'] for r in found[way]):.2f}",
                             first["requests"], first["prompts"], first["tokens"], first["rows"], f"{worst:.1e}",
                             " ".join(f"{r['seconds']:.2f}" for r in found[way])])
                print(rows[-1], flush=True)
    finally:
        served.close()
    per = fit(every)
    print(f"- load average at start {load[0]:.2f}, at the end {os.getloadavg()[0]:.2f}; {options.repeats} runs a way")
    print(tabulate(rows, headers=["questions x context x choices x tokens", "way", "median s", "requests", "prompts",
                                  "computed tokens", "prompt rows", "max |Δ| vs prompt reads", "every run s"],
                   tablefmt="github"))
    print(f"fit: {per[0] * 1000:.1f} ms a request, {per[1] * 1000:.2f} ms a prompt, {per[2] * 1000:.3f} ms a computed "
          f"token, {per[3] * 1000:.3f} ms a prompt row")


if __name__ == "__main__":
    main(sys.argv[1:])
