"""Reading vLLM's log-probabilities, every read checked against the request it answers (docs/architecture.md, "A
reader of an engine's or a server's output").

Pure functions over the structures vLLM 0.32 returns, which 0.23 lays out the same; nothing here imports vLLM.
Two model runners build prompt log-probabilities differently (tests/engine/test_logprob_reads.py builds both as
vLLM's code does):

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
raises :class:`BadRead`; the engine asks again without the cache, and a second failure stops the run. On V2,
vLLM 0.32 also scores the prompt's own tokens by id from a given row (``prompt_logprob_start``,
``prompt_logprob_token_ids``); a read that asked for them is checked against them too (``read_path``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from evalkit.contracts import IdsRead, Scored, ScoreRequest
from evalkit.engine.read_plan import PathRead

TIE = 1e-6  # a target within this of the row's top-1 is the top-1 (floats read back from one tensor row)


class BadRead(ValueError):
    """What vLLM returned does not answer the request that was sent (wrong rows, tokens or values)."""


def scored_positions(request: ScoreRequest) -> range:
    """Prompt positions whose log-probability a score needs: ids[start:], but never position 0 (no context)."""
    return range(max(request.start, 1), len(request.ids))


NOTHING_SCORED = Scored(logprob=0.0, is_greedy=True)  # a continuation with no scored position, as lm-eval sums it


def unscored(requests: Sequence[ScoreRequest]) -> list[int]:
    """Indices of requests with no scored position (an empty continuation): answered NOTHING_SCORED without
    asking the engine (vLLM refuses ``prompt_logprob_token_ids=[]``, and lm-eval returns (0, True) for them)."""
    return [i for i, r in enumerate(requests) if not scored_positions(r)]


def _checked(value: float, position: int, where: str) -> float:
    if not (math.isfinite(value) and value <= TIE):
        raise BadRead(f"{where}: position {position} has log-probability {value!r}, not a finite value <= 0")
    return value


def summed(rows: Sequence[tuple[float, bool]]) -> Scored:
    """A continuation from the (log-probability, greedy) of each of its positions: the sum, greedy where all are."""
    return Scored(logprob=sum(v for v, _ in rows), is_greedy=all(g for _, g in rows))


def prompt_row_values(request: ScoreRequest, flat: Any) -> list[tuple[float, bool]]:
    """(log-probability, greedy) of each scored position of request from prompt log-probabilities
    (``prompt_logprobs=1``, flat), in either runner's layout: ``len(flat) - 1`` rows covering the last positions
    of the prompt."""
    if flat is None:
        raise BadRead("no prompt log-probabilities returned")
    ids, rows = request.ids, len(flat.start_indices) - 1
    first_covered = len(ids) - rows  # V1: 1; V2 after a cache hit of k tokens: k + 1
    if rows < 0 or first_covered < 1 or first_covered > max(request.start, 1):
        raise BadRead(f"{rows} prompt rows for a {len(ids)}-token prompt scored from position {request.start}")
    values = []
    for position in scored_positions(request):
        index = position - first_covered + 1  # entry 0 of the flat list is the first token's None
        first, end = flat.start_indices[index], flat.end_indices[index]
        if end <= first or flat.token_ids[first] != ids[position]:
            got = flat.token_ids[first] if end > first else None
            raise BadRead(f"row of position {position} is for token {got}, the request has {ids[position]}")
        value = _checked(flat.logprobs[first], position, "prompt row")
        values.append((value, value >= _top(flat.logprobs[first + 1:end], value, position)))
    return values


def _top(others: Sequence[float], value: float, position: int) -> float:
    """The top-1 of a prompt row (the entries after its target), checked to be no smaller than the target's
    value: a target above the row's best (beyond TIE) is no row vLLM computes."""
    if not others:
        raise BadRead(f"row of position {position} holds no top-1 entry beside its token")
    top = max(others)
    if value > top + TIE:
        raise BadRead(f"row of position {position}: the token's log-probability {value!r} is above the row's top-1 "
                      f"{top!r}")
    return top


def token_id_values(request: ScoreRequest, scores: Any, first_row: int) -> list[float]:
    """The log-probability of each scored position of request from V2's ``prompt_token_id_logprobs``
    (``prompt_logprob_start=first_row`` and one id per row, the request's own token): shaped
    [len - 1 - first_row, 1], row i the token at first_row + i + 1. Greediness comes from the verified prompt
    rows of the same output (read_path)."""
    expected = len(request.ids) - 1 - first_row
    shape = tuple(getattr(scores, "shape", ()))
    if scores is None or shape[:1] != (expected,) or (len(shape) > 1 and shape[1] < 1):
        raise BadRead(f"token-id scores shaped {shape or None}, the request asked for {expected} rows from row "
                      f"{first_row}")
    return [_checked(float(scores[row][0]), position, "token-id scores")
            for row, position in enumerate(range(first_row + 1, len(request.ids)))
            if position >= max(request.start, 1)]


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


def next_token_asks(requests: Sequence[ScoreRequest], most: int) -> list[tuple[tuple[int, ...], list[int]]]:
    """(context, ids) per request to send for one-token continuations: each distinct context once, asking for
    every token that follows it there, at most most ids a request (more split into further requests)."""
    contexts: dict[tuple[int, ...], set[int]] = {}
    for r in requests:
        contexts.setdefault(r.ids[:r.start], set()).add(r.ids[r.start])
    return [(c, ids) for c in contexts for ids in chunked(sorted(contexts[c]), most)]


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


def id_asks(reads: Sequence[IdsRead], most: int) -> list[tuple[int, list[int]]]:
    """(read number, ids) to send for ``Engine.read_ids``: each read's distinct ids in chunks of at most most
    (vLLM's ``logprob_token_ids`` a request), none for a read that asks no id. A read that asks ids after an
    empty context raises ValueError (one line): there is no next-token row before the first token."""
    asks = []
    for n, read in enumerate(reads):
        if read.ids and not read.context:
            raise ValueError(f"read_ids: read {n} asks for {len(read.ids)} ids after an empty context, where no "
                             "engine has a next-token row; start its context with the prefix token "
                             "(Engine.prefix_token_id())")
        if read.ids:
            asks += [(n, chunk) for chunk in chunked(list(dict.fromkeys(read.ids)), most)]
    return asks


def id_values(reads: Sequence[IdsRead], entries: Sequence[dict[int, float]]) -> list[tuple[float, ...]]:
    """Each read's log-probabilities in the order its ids were asked (a repeated id repeated), from entries[n]:
    read n's {token id: log-probability}, its chunks' answers merged; () for a read that asks no id."""
    return [tuple(entries[n][t] for t in read.ids) for n, read in enumerate(reads)]


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


def path_scores(read: PathRead, rows: Sequence[tuple[float, bool]], entries: dict[int, float]
                ) -> dict[ScoreRequest, Scored]:
    """The steps a PathRead answers, from its verified prompt rows (prompt_row_values) and next-token entries
    (read_next_token); greedy as elsewhere (a tie with the best counts as greedy)."""
    steps = read.steps()
    best = max(entries.values()) if entries else 0.0
    values = [Scored(v, g) for v, g in rows] + [Scored(entries[t], entries[t] >= best) for t in read.asked]
    if len(values) != len(steps):
        raise BadRead(f"{len(values)} values for a path read of {len(steps)} steps")
    return dict(zip(steps, values))


def read_path(read: PathRead, *, token_ids_asked: bool, prompt_rows: Any, token_id_scores: Any, next_token: Any
              ) -> tuple[list[tuple[float, bool]], dict[int, float]]:
    """What one vLLM output answers of a PathRead, each part checked: (log-probability, greedy) of each row of
    prompt[start:] (greedy from the prompt rows; where the read asked V2 for them, token_ids_asked, the values
    from ``prompt_token_id_logprobs``, asked from row start - 1), and the next-token entries of the asked ids."""
    rows: list[tuple[float, bool]] = []
    if read.start is not None:
        request = ScoreRequest(ids=read.prompt, start=read.start)
        rows = prompt_row_values(request, prompt_rows)
        if token_ids_asked:
            values = token_id_values(request, token_id_scores, read.start - 1)
            if len(values) != len(rows):
                raise BadRead(f"{len(values)} token-id scores beside {len(rows)} prompt rows")
            rows = [(v, g) for v, (_, g) in zip(values, rows)]
    entries = read_next_token(read.prompt, read.asked, next_token) if read.asked else {}
    return rows, entries
