"""Continuations scored from their own prompt rows: the shared-prefix path and the plain one.

Each request is one path read with rows from its continuation on and no next token (never position 0). The
shared-prefix path reads vLLM's prefix cache, so the choices of one question (kept adjacent, as lm-eval orders
them) prefill their common context once; its reads are cut as the chained ones are (``path_reads.block_safe``).
On the V2 runner of a vLLM that has it (0.32; ``launch.token_id_scores``) a read also asks vLLM's own API for
rows from the continuation on (``prompt_logprob_start``, ``prompt_logprob_token_ids``); on 0.23's V2 the prompt
rows alone are read. On V1 a result whose cache reached the continuation (``num_cached_tokens``) is resubmitted
without the cache, as its rows there were never written. The plain path reads no cache.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import Scored, ScoreRequest
from evalkit.engine.logprob_reads import chained_score, scored_positions
from evalkit.engine.read_plan import PathRead
from evalkit.engine.vllm.path_reads import send_reads


def score_prompts(llm: Any, requests: Sequence[ScoreRequest], *, runner: str, token_id_scores: bool,
                  block_size: int, read_cache: bool, others: Sequence[tuple[int, ...]]
                  ) -> tuple[list[Scored], Counter[str]]:
    """Each request from its own prompt rows, ids[start:] (never position 0), on llm; the cache read only where
    read_cache (the shared-prefix path). Counts: prompt_logprobs, runner_v1 / runner_v2 and send_reads'."""
    reads = [PathRead(prompt=r.ids, start=scored_positions(r).start, asked=()) for r in requests]
    found, counts = send_reads(llm, reads, runner=runner, token_id_scores=token_id_scores, block_size=block_size,
                               read_cache=read_cache, others=others)
    scored = [chained_score(read.steps(), found) for read in reads]
    if requests:
        counts.update({"prompt_logprobs": len(requests), f"runner_{runner}": len(requests)})
    return scored, counts
