"""Does the shape of scoring requests change what vLLM's prompt log-probabilities cost? One engine, as
``python -m evalkit`` starts it (the embedded model, float32, evalkit's choices for the machine), the same
prompt tokens sent in different shapes, each timed twice with the prefix cache reset before each:

* with and without ``prompt_logprobs`` (the difference is vLLM's own prompt-logprob work);
* all requests in one ``LLM.generate`` call (vLLM batches them) against one call per request;
* the same tokens as many short prompts or fewer long ones;
* ``prompt_logprobs`` 1 against 5 (top entries per row), and ``flat_logprobs`` on (evalkit's) or off.

Prompts are random token ids (the forward's cost does not depend on which tokens). Prints one table.
Run: .venv/bin/python -m benchmarks.request_shape [--requests 200] [--tokens 60]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(llm, prompts: list[list[int]], params, one_by_one: bool) -> float:
    llm.reset_prefix_cache()
    started = time.perf_counter()
    if one_by_one:
        for prompt in prompts:
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    else:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - started


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="short prompts per shape")
    parser.add_argument("--tokens", type=int, default=60, help="tokens per short prompt")
    options = parser.parse_args(argv)

    from tabulate import tabulate
    from vllm import SamplingParams

    from evalkit.config import compose_config
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.vllm.start import start_vllm

    cfg = compose_config([])
    engine = start_vllm(cfg, resolve_model_path(cfg.vllm_path), sole_engine=True)
    vocabulary = engine.tokenizer.vocab_size
    rng = random.Random(0)
    n, length = options.requests, options.tokens
    short = [[rng.randrange(100, vocabulary) for _ in range(length)] for _ in range(n)]
    long = [sum(short[i:i + 4], []) for i in range(0, n, 4)]  # the same tokens, four prompts to one

    def params(prompt_logprobs: int | None, flat: bool = True) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=prompt_logprobs, detokenize=False,
                              flat_logprobs=flat, skip_reading_prefix_cache=True)

    shapes = [
        (f"{n} x {length} tokens, one call, no prompt_logprobs", short, params(None), False),
        (f"{n} x {length} tokens, one call, prompt_logprobs=1 (evalkit's)", short, params(1), False),
        (f"{n} x {length} tokens, one call per request, no prompt_logprobs", short, params(None), True),
        (f"{n} x {length} tokens, one call per request, prompt_logprobs=1", short, params(1), True),
        (f"{n // 4} x {4 * length} tokens, one call, no prompt_logprobs", long, params(None), False),
        (f"{n // 4} x {4 * length} tokens, one call, prompt_logprobs=1", long, params(1), False),
        (f"{n} x {length} tokens, one call, prompt_logprobs=5", short, params(5), False),
        (f"{n} x {length} tokens, one call, prompt_logprobs=1, flat_logprobs off", short, params(1, False), False),
    ]
    timed(engine.llm, short[:8], params(1), False)  # warm-up
    rows = []
    try:
        for label, prompts, sampling, one_by_one in shapes:
            seconds = [timed(engine.llm, prompts, sampling, one_by_one) for _ in range(2)]
            tokens = sum(len(p) for p in prompts)
            rows.append([label, f"{min(seconds):.2f}", f"{max(seconds):.2f}", f"{tokens / min(seconds):,.0f}"])
            print(rows[-1], flush=True)
    finally:
        engine.close()
    print(tabulate(rows, headers=["shape", "best s", "other s", "prompt tokens/s (best)"], tablefmt="github",
                   disable_numparse=True))


if __name__ == "__main__":
    main(sys.argv[1:])
