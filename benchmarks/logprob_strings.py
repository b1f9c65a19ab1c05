"""What the strings of a traced generation's top-k ids cost vLLM's front end, and what evalkit saves by not asking
for them (evalkit/engine/vllm/ids_only.py).

Two figures, each with vLLM's own code and the embedded model's tokenizer:

* the front end alone: vLLM's ``LogprobsProcessor`` fed the k + 1 ids and log-probabilities of one decode step
  for each of ``--sequences`` sequences, as its output processor feeds it, with the tokenizer (every id made a
  string, as vLLM does for a detokenized request) and without (evalkit's ids-only requests); milliseconds a step
  and a sequence-step;
* with ``--engine``, whole greedy generations traced at top ``--top-k`` on one engine as ``python -m evalkit``
  starts it (``--requests`` prompts, ``--tokens`` tokens each, ``ignore_eos``), asked with and without the
  ids-only mark, each twice, in alternation; the seconds of each.

    .venv/bin/python -m benchmarks.logprob_strings [--sequences 256] [--steps 40] [--top-k 20]
        [--engine --requests 64 --tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import time


def front_end(tokenizer: object, *, sequences: int, steps: int, top_k: int) -> float:
    """Seconds a decode step of sequences costs vLLM's LogprobsProcessor, with tokenizer (or None)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    class Request:  # what from_new_request reads of an EngineCoreRequest
        sampling_params = SamplingParams(logprobs=top_k, flat_logprobs=True)

    rng = np.random.default_rng(0)
    vocabulary = len(tokenizer) if tokenizer is not None else 49152
    processors = [LogprobsProcessor.from_new_request(tokenizer, Request()) for _ in range(sequences)]
    steps_fed = [[LogprobsLists([rng.integers(0, vocabulary, top_k + 1)], [-rng.random(top_k + 1)],
                                [np.array(1)], None) for _ in range(sequences)] for _ in range(steps)]
    started = time.perf_counter()
    for step in steps_fed:
        for processor, lists in zip(processors, step):
            processor._update_sample_logprobs(lists)
    return (time.perf_counter() - started) / steps


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=256, help="sequences decoded at once")
    parser.add_argument("--steps", type=int, default=40, help="decode steps fed to the front end")
    parser.add_argument("--top-k", type=int, default=20, help="top entries traced a step (evalkit's default)")
    parser.add_argument("--engine", action="store_true", help="also time whole traced generations on the engine")
    parser.add_argument("--requests", type=int, default=64, help="generations (--engine)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of each generation (--engine)")
    options = parser.parse_args(argv)

    from vllm.tokenizers import get_tokenizer

    from evalkit.config import compose_config
    from evalkit.engine.machine.preflight import resolve_model_path

    cfg = compose_config([])
    path = resolve_model_path(cfg.vllm_path)
    tokenizer = get_tokenizer(path)
    print(f"front end, {options.sequences} sequences, top {options.top_k} (+ the sampled id) a step:")
    for name, given in (("strings made (vLLM, detokenized request)", tokenizer), ("ids only (evalkit)", None)):
        seconds = front_end(given, sequences=options.sequences, steps=options.steps, top_k=options.top_k)
        print(f"  {name}: {1000 * seconds:.2f} ms a step, {1000 * seconds / options.sequences:.4f} ms a "
              "sequence-step", flush=True)
    if not options.engine:
        return

    import random

    from vllm import SamplingParams

    from evalkit.engine.vllm import ids_only
    from evalkit.engine.vllm.start import start_vllm

    engine = start_vllm(cfg, path, sole_engine=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, engine.tokenizer.vocab_size) for _ in range(32)]}
               for _ in range(options.requests)]

    def generate(extra: dict | None) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=options.tokens, ignore_eos=True, logprobs=options.top_k,
                                flat_logprobs=True, extra_args=extra)
        started = time.perf_counter()
        engine.llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        return time.perf_counter() - started

    generate(None)  # warm-up
    timed: dict[str, list[float]] = {"strings made": [], "ids only": []}
    for _ in range(2):
        timed["strings made"].append(generate(None))
        timed["ids only"].append(generate({ids_only.IDS_ONLY: True}))
    print(f"engine, {options.requests} generations of {options.tokens} tokens, top {options.top_k}, "
          f"max_num_seqs {engine.describe()['scheduling']['max_num_seqs']}:")
    for name, seconds in timed.items():
        print(f"  {name}: {' / '.join(f'{s:.2f}' for s in seconds)} s", flush=True)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
