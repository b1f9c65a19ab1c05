"""One-token continuations (the common multiple-choice case), scored from their context's next token.

Each distinct context is sent once, every choice's token in ``logprob_token_ids`` (at most
``MAX_LOGPROB_TOKEN_IDS`` a request, more are split: ``logprob_reads.next_token_asks``); one generated step
gives them all and the greedy token beside them (``logprob_reads.read_next_token`` checks it). The chained
path also reads here the last tokens no path read covers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import Scored, ScoreRequest
from evalkit.engine.logprob_reads import BadRead, next_token_asks, next_token_scores, read_next_token
from evalkit.engine.read_plan import MAX_LOGPROB_TOKEN_IDS
from evalkit.engine.vllm.second_read import second_read


def takes(request: ScoreRequest) -> bool:
    """Whether request is a one-token continuation of a non-empty context."""
    return len(request.ids) - request.start == 1 and request.start >= 1


def score_next_token(llm: Any, requests: Sequence[ScoreRequest]) -> tuple[list[Scored], Counter[str]]:
    """requests (one-token continuations) scored on llm (a ``vllm.LLM``), and what it took: single_token,
    contexts, context_requests, and the reads that failed their check and were sent again without the cache
    (mismatched, resent; a second failure raises ScoringError)."""
    from vllm import SamplingParams

    asks = next_token_asks(requests, MAX_LOGPROB_TOKEN_IDS)

    def send(batch, read_cache: bool):
        params = [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, flat_logprobs=True,
                                 logprob_token_ids=ids, skip_reading_prefix_cache=not read_cache)
                  for _, ids in batch]
        return llm.generate([{"prompt_token_ids": list(c)} for c, _ in batch], params, use_tqdm=False)

    entries: dict[tuple[int, ...], dict[int, float]] = {}
    again = []
    for (context, ids), out in zip(asks, send(asks, True)):
        try:
            entries.setdefault(context, {}).update(read_next_token(context, ids, out.outputs[0].logprobs))
        except BadRead:
            again.append((context, ids))
    for (context, ids), out in zip(again, send(again, False) if again else []):
        entries.setdefault(context, {}).update(second_read(
            lambda: read_next_token(context, ids, out.outputs[0].logprobs), len(context)))
    counts = Counter(single_token=len(requests), contexts=len({c for c, _ in asks}), context_requests=len(asks),
                     mismatched=len(again), resent=len(again))
    return next_token_scores(requests, entries), counts
