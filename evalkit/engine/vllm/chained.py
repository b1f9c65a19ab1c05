"""Continuations of 2 to ``CHAIN_TOKENS`` tokens, scored token by token and read by path.

Each token of a continuation is a one-token continuation of everything before it (``logprob_reads.token_steps``);
the request's log-probability is their sum, greedy where every token is. The steps are planned into path reads
(``plan_paths``): one request per distinct last context, whose prompt rows give the tokens before the last and
whose next-token read gives the last token of every choice that ends there. They are sent by
``path_reads.send_reads`` (cut where other requests may share their blocks, split past 128 asked ids); the steps
no read covers are read as one-token continuations (``next_token.py``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import Scored, ScoreRequest
from evalkit.engine.logprob_reads import chained_score, token_steps
from evalkit.engine.read_plan import PathRead
from evalkit.engine.vllm.next_token import score_next_token
from evalkit.engine.vllm.path_reads import send_reads

CHAIN_TOKENS = 16  # continuations up to this long are scored token by token, read by path (fast)


def takes(request: ScoreRequest) -> bool:
    """Whether request is a continuation of 2 to CHAIN_TOKENS tokens of a non-empty context."""
    return request.start >= 1 and 1 < len(request.ids) - request.start <= CHAIN_TOKENS


def plan_paths(requests: Sequence[ScoreRequest]) -> tuple[list[PathRead], list[ScoreRequest]]:
    """Path reads for the steps of these continuations (token_steps), each as long as the continuations go: a
    step whose next token lies on a longer prompt is read from that prompt's rows, the last token of each
    continuation from the next-token log-probabilities after its own context. Choices of 2+ tokens behind one
    question then need one request per distinct last context, not one per step, and each request prefills
    the question's tail (the part past vLLM's last full cached block) once. Returns the reads and the steps
    no read covers (to be read as one-token continuations)."""
    inner: dict[tuple[int, ...], tuple[int, ...]] = {}  # a context that a longer one extends -> that one
    for r in requests:
        for p in range(r.start, len(r.ids) - 1):
            inner.setdefault(r.ids[:p], r.ids[:-1])

    def longest(context: tuple[int, ...]) -> tuple[int, ...]:
        while context in inner:
            context = inner[context]
        return context

    starts: dict[tuple[int, ...], int | None] = {}
    asked: dict[tuple[int, ...], dict[int, None]] = {}
    rest: list[ScoreRequest] = []

    def rows_from(prompt: tuple[int, ...], position: int) -> None:
        current = starts[prompt]
        starts[prompt] = position if current is None else min(current, position)

    for r in requests:
        last, prompt = r.ids[:-1], longest(r.ids[:-1])
        starts.setdefault(prompt, None)
        if len(r.ids) - 1 > r.start:  # steps before the last: rows of the prompt that extends them
            rows_from(prompt, r.start)
        if prompt == last:
            asked.setdefault(prompt, {})[r.ids[-1]] = None
        elif prompt[len(last)] == r.ids[-1]:
            rows_from(prompt, len(last))
        else:
            rest.append(ScoreRequest(ids=r.ids, start=len(r.ids) - 1))
    reads = [PathRead(prompt=p, start=s, asked=tuple(sorted(asked.get(p, {})))) for p, s in starts.items()]
    return reads, list(dict.fromkeys(rest))


def score_chained(llm: Any, requests: Sequence[ScoreRequest], others: Sequence[tuple[int, ...]], *, runner: str,
                  token_id_scores: bool, block_size: int) -> tuple[list[Scored], Counter[str]]:
    """requests scored on llm from their steps, read by path (cut where these or others, the prompts of the
    call's other reads, may share cached blocks past a read's first row); and what it took: chained,
    chain_steps, path_reads and the counts of send_reads and score_next_token (but single_token)."""
    if not requests:
        return [], Counter()
    steps, unique = token_steps(requests)
    reads, rest = plan_paths(requests)
    found, counts = send_reads(llm, reads, runner=runner, token_id_scores=token_id_scores, block_size=block_size,
                               read_cache=True, others=others)
    counts.update(path_reads=len(reads))
    left, rest_counts = score_next_token(llm, rest)
    found.update(zip(rest, left))
    scored = [chained_score(steps[r], found) for r in requests]
    counts.update({k: v for k, v in rest_counts.items() if k != "single_token"})
    counts.update(chained=len(requests), chain_steps=len(unique))
    return scored, counts
