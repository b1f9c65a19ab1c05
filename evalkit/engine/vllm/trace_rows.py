"""Reading token traces (the text token's log-probability and the top-k beside it) from what vLLM 0.32 returns,
every read checked against the request it answers (docs/architecture.md, "A reader of an engine's or a server's
output"). Pure functions; nothing here imports vLLM.

Two structures carry a trace, both as a ``FlatLogprobs`` (``flat_logprobs=True``) whose every row holds the
target first, then the top-k (``vllm/logprobs.py`` ``append_logprobs_for_next_position``: ranks
``(rank, 1 .. k)``; a target inside the top-k appears twice):

* **prompt rows** (``prompt_logprobs=k``): the target is the prompt's own token at that position. The rows cover
  the prompt's last positions in either runner's layout (V1 writes one row per position after the first, but
  only those it computed; V2 returns only the computed ones: ``logprob_reads`` module docstring), so they are
  read by offset from the end, and a row is accepted only if its target is the request's token there;
* **one generated step** (``logprobs=k``, ``max_tokens=1``, greedy): the target is the sampled token, which
  greedy decoding makes the top-1. The text token comes from the top-k where it is listed, or else from a
  separate read of that id (``logprob_token_ids``, read by ``logprob_reads.read_next_token``).

A row is accepted when its top entries are ranked 1, 2, ... with at most k of them, distinct, finite, <= 0 and
best first, and the target agrees with them (its own entry's value where it is listed, no value above the last
entry where it is not). Anything else raises :class:`evalkit.engine.logprob_reads.BadRead`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from evalkit.contracts import Scored, ScoreRequest, TokenTrace, apart_tolerance, apart_words, top_list_fault
from evalkit.engine.logprob_reads import TIE, BadRead, scored_positions

Top = tuple[tuple[int, float], ...]


def _value(value: float, where: str) -> float:
    if not (math.isfinite(value) and value <= TIE):
        raise BadRead(f"{where}: log-probability {value!r}, not a finite value <= 0")
    return value


def row_top(flat: Any, index: int, top_k: int, where: str) -> tuple[int, float, Top]:
    """(target id, its log-probability, the top entries best first) of row index of flat, checked."""
    first, end = flat.start_indices[index], flat.end_indices[index]
    if end - first < 2 or end - first > top_k + 1:
        raise BadRead(f"{where}: {end - first} entries, a target and 1 to {top_k} top ones were asked for")
    target, value = flat.token_ids[first], _value(flat.logprobs[first], where)
    top = tuple((flat.token_ids[i], _value(flat.logprobs[i], where)) for i in range(first + 1, end))
    if list(flat.ranks[first + 1:end]) != list(range(1, len(top) + 1)):
        raise BadRead(f"{where}: top entries ranked {list(flat.ranks[first + 1:end])}, not 1 to {len(top)}")
    fault = top_list_fault(target, value, top, TIE)
    if fault:
        raise BadRead(f"{where}: the target {target} {fault}")
    return target, value, top


def trace_from_rows(request: ScoreRequest, flat: Any, top_k: int) -> TokenTrace:
    """The trace of request's scored positions (ids[start:], never position 0) from its prompt rows
    (``prompt_logprobs=top_k``) in either runner's layout: ``len(flat) - 1`` rows covering the prompt's last
    positions, each one's target the request's token there."""
    if flat is None:
        raise BadRead("no prompt log-probabilities returned")
    ids, rows = request.ids, len(flat.start_indices) - 1
    positions = scored_positions(request)
    first_covered = len(ids) - rows  # V1: 1; V2 after a cache hit of h tokens: h + 1
    if rows < 0 or first_covered < 1 or first_covered > positions.start:
        raise BadRead(f"{rows} prompt rows for a {len(ids)}-token prompt traced from position {positions.start}")
    values, tops = [], []
    for position in positions:
        where = f"prompt row of position {position}"
        target, value, top = row_top(flat, position - first_covered + 1, top_k, where)
        if target != ids[position]:
            raise BadRead(f"{where} is for token {target}, the request has {ids[position]}")
        values.append(value)
        tops.append(top)
    return TokenTrace(logprobs=tuple(values), top=tuple(tops))


def next_top(flat: Any, top_k: int) -> Top:
    """The top entries after a context, from one greedy generated step with ``logprobs=top_k``: exactly one
    step, whose sampled token is its top-1 (a tie with it counts)."""
    if flat is None or len(flat.start_indices) != 1:
        steps = None if flat is None else len(flat.start_indices)
        raise BadRead(f"{steps} generated steps of log-probabilities, one was asked for")
    sampled, value, top = row_top(flat, 0, top_k, "next-token step")
    if sampled != top[0][0] and value < top[0][1] - TIE:
        raise BadRead(f"the greedy step sampled {sampled} ({value!r}), below its top-1 {top[0]}")
    return top


def unlisted(requests: Sequence[ScoreRequest], tops: Mapping[tuple[int, ...], Top]) -> list[ScoreRequest]:
    """The one-token requests whose token is not among their context's top entries (their value needs a read
    of that id)."""
    return [r for r in requests if r.ids[r.start] not in dict(tops[r.ids[:r.start]])]


def next_token_trace(request: ScoreRequest, top: Top, entries: Mapping[int, float], *, dtype: str) -> TokenTrace:
    """The trace of a one-token request from its context's top entries, its token's value taken from them
    where listed, else from entries (its ``logprob_token_ids`` read, checked to lie at or below the last
    top entry: a token above it would have been listed). The two come from separate calls, so the check allows
    the rounding of an engine computing in dtype between them (``contracts.apart_tolerance``)."""
    token = request.ids[request.start]
    listed = dict(top)
    if token in listed:
        return TokenTrace(logprobs=(listed[token],), top=(top,))
    if token not in entries:
        raise BadRead(f"no log-probability read for token {token} after a {request.start}-token context")
    value = entries[token]
    if value > top[-1][1] + apart_tolerance(dtype):
        raise BadRead(f"token {token} read at {value!r}, above the last of the top entries {top[-1][1]!r} that "
                      f"leave it out, by more than {apart_words(dtype)}")
    return TokenTrace(logprobs=(value,), top=(top,))


def scored_from_trace(trace: TokenTrace) -> Scored:
    """The score of a request read by its trace alone (a single pass): the sum of its text tokens'
    log-probabilities in position order (as lm-eval sums them), greedy where each text token is its row's top-1
    (a tie with it counting as greedy, as vLLM's scoring paths count it), with the trace beside it."""
    greedy = all(value >= top[0][1] - TIE for value, top in zip(trace.logprobs, trace.top))
    return Scored(logprob=sum(trace.logprobs), is_greedy=greedy, trace=trace)


def trace_from_steps(token_ids: Sequence[int], flat: Any, top_k: int) -> TokenTrace:
    """The trace of a generation's output tokens from the log-probabilities of its generated steps
    (``logprobs=top_k``): one row per output token, each row's target that token."""
    if flat is None or len(flat.start_indices) != len(token_ids):
        steps = None if flat is None else len(flat.start_indices)
        raise BadRead(f"{steps} generated steps of log-probabilities for {len(token_ids)} output tokens")
    values, tops = [], []
    for step, token in enumerate(token_ids):
        target, value, top = row_top(flat, step, top_k, f"generated step {step}")
        if target != token:
            raise BadRead(f"generated step {step} holds token {target}, the output has {token}")
        values.append(value)
        tops.append(top)
    return TokenTrace(logprobs=tuple(values), top=tuple(tops))
