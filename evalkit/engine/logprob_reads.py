"""Reading vLLM's log-probabilities, every read checked against the request it answers (STYLE 14).

Pure functions over the structures vLLM 0.32 returns; nothing here imports vLLM. Two model runners build
prompt log-probabilities differently (tests/test_logprob_reads.py builds both as vLLM's code does):

* **V1** (``vllm/v1/worker/gpu_model_runner.py`` ``_get_prompt_logprobs_dict``, the CPU build's runner): one
  row per prompt position after the first, allocated uninitialised (``LogprobsTensors.empty_cpu``) and filled
  from ``request.num_computed_tokens`` on; rows of a prefix read from the cache are never written.
* **V2** (``vllm/v1/worker/gpu/sample/prompt_logprob.py`` ``compute_prompt_logprobs``, CUDA with Triton): only
  the rows of the positions computed in this request's steps, concatenated: a cache hit of k tokens leaves
  rows for positions k+1 .. len-1 only.

Both reach the output as a ``FlatLogprobs`` whose entry 0 is ``None`` (``vllm/logprobs.py``
``create_prompt_logprobs``) and whose every row holds the target token first, then the top-k
(``append_logprobs_for_next_position``). So the rows always cover the *last* positions of the prompt: they
are read by offset from the end, and each is accepted only if its first token id is the request's token at
that position, its log-probability a finite value <= 0 and no larger than the row's top-1. A read that fails
raises :class:`BadRead`; the engine asks again without the cache, and a second failure stops the run.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from evalkit.contracts import Scored, ScoreRequest

TIE = 1e-6  # a target within this of the row's top-1 is the top-1 (floats read back from one tensor row)


class BadRead(ValueError):
    """What vLLM returned does not answer the request that was sent (wrong rows, tokens or values)."""


def scored_positions(request: ScoreRequest) -> range:
    """Prompt positions whose log-probability a score needs: ids[start:], but never position 0 (no context)."""
    return range(max(request.start, 1), len(request.ids))


def _checked(value: float, position: int, where: str) -> float:
    if not (math.isfinite(value) and value <= TIE):
        raise BadRead(f"{where}: position {position} has log-probability {value!r}, not a finite value <= 0")
    return value


def read_prompt_rows(request: ScoreRequest, flat: Any) -> Scored:
    """Sum and greediness of ids[start:] from prompt log-probabilities (``prompt_logprobs=1``, flat), in either
    runner's layout: ``len(flat) - 1`` rows covering the last positions of the prompt."""
    if flat is None:
        raise BadRead("no prompt log-probabilities returned")
    ids, rows = request.ids, len(flat.start_indices) - 1
    first_covered = len(ids) - rows  # V1: 1; V2 after a cache hit of k tokens: k + 1
    if rows < 0 or first_covered < 1 or first_covered > max(request.start, 1):
        raise BadRead(f"{rows} prompt rows for a {len(ids)}-token prompt scored from position {request.start}")
    total, greedy = 0.0, True
    for position in scored_positions(request):
        index = position - first_covered + 1  # entry 0 of the flat list is the first token's None
        first, end = flat.start_indices[index], flat.end_indices[index]
        if end <= first or flat.token_ids[first] != ids[position]:
            got = flat.token_ids[first] if end > first else None
            raise BadRead(f"row of position {position} is for token {got}, the request has {ids[position]}")
        value = _checked(flat.logprobs[first], position, "prompt row")
        best = max(flat.logprobs[first:end])
        total += value
        greedy = greedy and value >= best
    return Scored(logprob=total, is_greedy=greedy)


def read_token_id_rows(request: ScoreRequest, scores: Any, first_row: int, greedy: bool) -> Scored:
    """The sum of ids[start:] from V2's ``prompt_token_id_logprobs`` (``prompt_logprob_start=first_row`` and one
    id per row, the request's own token): shaped [len - 1 - first_row, 1], row i the token at first_row + i + 1.
    greedy comes from the verified prompt rows of the same output."""
    expected = len(request.ids) - 1 - first_row
    shape = tuple(getattr(scores, "shape", ()))
    if scores is None or shape[:1] != (expected,) or (len(shape) > 1 and shape[1] < 1):
        raise BadRead(f"token-id scores shaped {shape or None}, the request asked for {expected} rows from row "
                      f"{first_row}")
    total = 0.0
    for row, position in enumerate(range(first_row + 1, len(request.ids))):
        if position >= max(request.start, 1):
            total += _checked(float(scores[row][0]), position, "token-id scores")
    return Scored(logprob=total, is_greedy=greedy)


def read_next_token(context: Sequence[int], asked: Sequence[int], flat: Any) -> dict[int, float]:
    """{token id: log-probability} of the next token after context, from one generated step with
    ``logprob_token_ids=asked``: the sampled (greedy) token first, then every asked id. Raises unless exactly
    one step came back holding every asked id with a finite log-probability <= 0."""
    if flat is None or len(flat.start_indices) != 1:
        steps = None if flat is None else len(flat.start_indices)
        raise BadRead(f"{steps} generated steps of log-probabilities, one was asked for")
    span = range(flat.start_indices[0], flat.end_indices[0])
    entries = {flat.token_ids[k]: _checked(flat.logprobs[k], len(context), "next-token") for k in span}
    missing = sorted(set(asked) - set(entries))
    if missing:
        raise BadRead(f"next-token log-probabilities lack the asked ids {missing[:5]}")
    return entries


def next_token_scores(requests: Sequence[ScoreRequest], entries: dict[tuple[int, ...], dict[int, float]]
                      ) -> list[Scored]:
    """One-token continuations scored from their contexts' next-token entries; greedy as lm-eval reads it (a
    tie with the best counts as greedy)."""
    scored = []
    for r in requests:
        found = entries[r.ids[:r.start]]
        value = found[r.ids[r.start]]
        scored.append(Scored(logprob=value, is_greedy=value >= max(found.values())))
    return scored


def chunked(items: Sequence[int], size: int) -> list[list[int]]:
    """items in lists of at most size (vLLM takes at most 128 ``logprob_token_ids`` per request)."""
    return [list(items[i:i + size]) for i in range(0, len(items), size)] or [[]]


def token_steps(requests: Sequence[ScoreRequest]) -> tuple[dict[ScoreRequest, list[ScoreRequest]], list[ScoreRequest]]:
    """Each request's continuation as one-token requests, one per token, of everything before it; and those
    steps once each (choices that share their first tokens share those steps)."""
    steps = {r: [ScoreRequest(ids=r.ids[:p + 1], start=p) for p in range(r.start, len(r.ids))] for r in requests}
    return steps, list(dict.fromkeys(step for chain in steps.values() for step in chain))


def chained_score(steps: Sequence[ScoreRequest], found: dict[ScoreRequest, Scored | None]) -> Scored | None:
    """A continuation from its steps' scores: their sum, greedy where every step is; None if a step has none."""
    scores = [found.get(step) for step in steps]
    if any(s is None for s in scores):
        return None
    return Scored(logprob=sum(s.logprob for s in scores), is_greedy=all(s.is_greedy for s in scores))
