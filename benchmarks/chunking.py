"""What the size of a generate call costs: generations sent to one vLLM engine in chunks of a quarter of the
sequences it runs at once (as evalkit's old chunk_size=256 did to an H100's max_num_seqs=1024), of as many, and
of the FILL times as many that evalkit now sends (evalkit/store/requests.py ``generation_chunk``).

One engine as ``python -m evalkit`` starts it (the embedded model, evalkit's choices for the machine), with
``batch_size`` (max_num_seqs) sequences at once; the requests: random prompts, greedy, each running to its
``max_tokens`` (``ignore_eos``), one in eight a long "runaway" answer, the rest short, as a task without
``max_gen_toks`` meets them. Each chunking answers the same requests through evalkit's request store (a fresh one
each), timed. Prints one table.

    .venv/bin/python -m benchmarks.chunking [--requests 128] [--batch-size 16] [--short 8] [--long 96]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128, help="generations")
    parser.add_argument("--batch-size", type=int, default=16, help="the engine's max_num_seqs")
    parser.add_argument("--short", type=int, default=8, help="tokens of most answers")
    parser.add_argument("--long", type=int, default=96, help="tokens of one answer in eight")
    parser.add_argument("--prompt", type=int, default=32, help="tokens per prompt")
    options = parser.parse_args(argv)

    from tabulate import tabulate

    from evalkit.config import compose_config
    from evalkit.contracts import GenRequest
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.engine.vllm.start import start_vllm
    from evalkit.store.requests import FILL, RequestStore, ResumableEngine, generation_chunk

    cfg = compose_config([f"batch_size={options.batch_size}"])
    engine = start_vllm(cfg, resolve_model_path(cfg.vllm_path), sole_engine=True)
    rng = random.Random(0)
    vocabulary = engine.tokenizer.vocab_size
    requests = [GenRequest(prompt_ids=tuple(rng.randrange(100, vocabulary) for _ in range(options.prompt)),
                           max_tokens=options.long if i % 8 == 7 else options.short,
                           sampling=(("temperature", 0.0), ("ignore_eos", True)))
                for i in range(options.requests)]
    seqs = engine.describe()["scheduling"]["max_num_seqs"]
    now = generation_chunk(1, engine.describe())
    chunkings = [("a quarter of max_num_seqs (before)", max(1, seqs // 4)), ("max_num_seqs", seqs),
                 (f"{FILL} x max_num_seqs (evalkit)", now)]
    started = time.perf_counter()
    engine.generate(requests[:options.batch_size])  # warm-up: the first call's one-off costs
    print(f"chunking: warm-up {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for name, chunk in chunkings:
        with tempfile.TemporaryDirectory() as folder:
            store = ResumableEngine(engine, RequestStore(Path(folder) / "store.jsonl"), chunk_size=chunk)
            started = time.perf_counter()
            answers = store.generate(requests)
            seconds = time.perf_counter() - started
            store.store.close()
        tokens = sum(a.output_tokens for a in answers)
        rows.append([name, chunk, -(-len(requests) // chunk), f"{seconds:.1f}", f"{tokens / seconds:.0f}"])
        print(f"chunking: {name}: {seconds:.1f} s", file=sys.stderr, flush=True)
    engine.close()
    print(f"{options.requests} generations ({options.short} tokens, one in eight {options.long}), max_num_seqs={seqs}")
    print(tabulate(rows, headers=["chunks of", "requests", "generate calls", "seconds", "tokens/s"]))


if __name__ == "__main__":
    main(sys.argv[1:])
