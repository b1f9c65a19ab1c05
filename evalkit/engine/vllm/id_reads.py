"""``Engine.read_ids`` on vLLM: the log-probabilities of asked token ids as the next token after a context, from
the raw logits (a candidate's record reads the reference's top ids its own top-k left out, docs/divergence.md).

Each read's distinct ids go in one-token greedy generations with ``logprob_token_ids``, at most
``MAX_LOGPROB_TOKEN_IDS`` a request (more split, their answers merged: ``logprob_reads.id_asks``), as
``trace_from_cache.py`` reads the text tokens a top-k leaves out. They read the prefix cache: the row after a context is
never taken from it (a hit stops before the prompt's last token), only the blocks before. Every request of the
call asks for ids, so vLLM 0.32's V1 sampler, which gives the whole batch the ``logprob_token_ids`` columns when
any request asks for them, gives each its own; V2 reads the asked ids on any sampled step. Each answer is
checked (``logprob_reads.read_next_token``: one step, holding every asked id at a finite value <= 0); one that
fails is sent once more alone, without the cache, and a second failure raises ScoringError (second_read.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import IdsRead
from evalkit.engine.logprob_reads import BadRead, id_asks, id_values, read_next_token
from evalkit.engine.read_plan import MAX_LOGPROB_TOKEN_IDS
from evalkit.engine.vllm.second_read import second_read
from evalkit.engine.vllm.trace_from_cache import _params


def read_ids(llm: Any, reads: Sequence[IdsRead]) -> tuple[list[tuple[float, ...]], Counter[str]]:
    """Each read's log-probability of every asked id after its context, in the order asked, on llm (a
    ``vllm.LLM``); and what it took: id_reads, id_read_requests, and the requests whose answer failed its
    check and were sent again alone (id_read_resent). A read that asks no id is answered () unsent; one that
    asks ids after an empty context raises ValueError before anything is sent."""
    asks = id_asks(reads, MAX_LOGPROB_TOKEN_IDS)
    outputs = llm.generate([{"prompt_token_ids": list(reads[n].context)} for n, _ in asks],
                           [_params(logprob_token_ids=ids) for _, ids in asks], use_tqdm=False) if asks else []
    entries: list[dict[int, float]] = [{} for _ in reads]
    resent = 0
    for (n, ids), out in zip(asks, outputs):
        context = reads[n].context
        try:
            entries[n].update(read_next_token(context, ids, out.outputs[0].logprobs))
        except BadRead:
            resent += 1
            entries[n].update(_alone(llm, context, ids))
    counts = Counter(id_reads=len(reads), id_read_requests=len(asks), id_read_resent=resent)
    return id_values(reads, entries), counts


def _alone(llm: Any, context: Sequence[int], ids: Sequence[int]) -> dict[int, float]:
    """One request's second try: sent alone, without the prefix cache; a second failure as ScoringError."""
    (out,) = llm.generate([{"prompt_token_ids": list(context)}],
                          [_params(logprob_token_ids=list(ids), skip_reading_prefix_cache=True)], use_tqdm=False)
    return second_read(lambda: read_next_token(context, ids, out.outputs[0].logprobs), len(context))
