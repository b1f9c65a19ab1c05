"""Token traces: each scored token's log-probability and the top-k beside it, from prompt rows computed with
no prefix cache, to show where two engines' outputs diverge (evalkit/compare/locate.py)."""

from __future__ import annotations

from typing import Any, Sequence

from evalkit.contracts import ScoreRequest, TokenTrace
from evalkit.engine.logprob_reads import scored_positions
from evalkit.engine.vllm.second_read import ScoringError


def token_traces(llm: Any, requests: Sequence[ScoreRequest], top_k: int) -> list[TokenTrace]:
    """The trace of each request's scored positions on llm (a ``vllm.LLM``); rows that do not cover the
    request raise ScoringError."""
    from vllm import SamplingParams

    if not requests:
        return []
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top_k, detokenize=False,
                            skip_reading_prefix_cache=True)
    outputs = llm.generate([{"prompt_token_ids": list(r.ids)} for r in requests], params, use_tqdm=False)
    traces = []
    for r, out in zip(requests, outputs):
        if out.prompt_logprobs is None or len(out.prompt_logprobs) != len(r.ids):
            raise ScoringError(f"vLLM returned {len(out.prompt_logprobs or [])} prompt rows for a "
                               f"{len(r.ids)}-token trace request (no cache was read)")
        rows = [out.prompt_logprobs[p] for p in scored_positions(r)]
        traces.append(TokenTrace(
            logprobs=tuple(row[token].logprob for row, token in zip(rows, r.ids[max(r.start, 1):])),
            top=tuple(tuple(sorted(((t, lp.logprob) for t, lp in row.items()), key=lambda e: -e[1])[:top_k])
                      for row in rows)))
    return traces
