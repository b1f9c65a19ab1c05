"""engine=served through vLLM's fields, with the divergence record's traces read in the same requests as the
answers (``Engine.score`` / ``Engine.generate`` asked with ``top_k`` > 0): :class:`TracedVLLMApi`.

* A greedy **generation** asks the server for ``logprobs: k`` with ``return_tokens_as_token_ids``: vLLM 0.32
  (``completion/serving.py``, ``_create_completion_logprobs``) writes one top list per output token, keyed
  ``token_id:N``, the sampled token first, then the top-k in rank order without it (k + 1 entries where the
  token is not among them, k where it is). :func:`read_steps` reads one trace row per output token id, each
  checked against that token (docs/architecture.md, "A reader of an engine's or a server's output"): one list per
  token, the token named and listed, its value its own entry's, at most k distinct others best first, and the token
  not above the last where it is not among them (``contracts.top_list_fault``). A sampled generation is asked nothing
  more: it is not traced.
* A **score** reads the whole prompt's log-probabilities at ``prompt_logprobs: k``, the request ``trace`` sends,
  and takes both its score and its trace from those rows: the two are the same numbers, and the second call the
  harness made for the traces is not sent. Chained next-token reads (``fast``) give no top list, so a traced
  score never chains.

The server refuses k above its ``--max-logprobs`` (20 by default), as it refuses such a ``trace``. The record's
reads of another run's top ids (``Engine.read_ids``) are next-token reads of given ids, or prompt rows where the
server ignores ``logprob_token_ids``: ``served/id_reads.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from evalkit.contracts import (Generation, GenRequest, IdsRead, Progress, Scored, ScoreRequest, TokenTrace,
                               top_list_fault)
from evalkit.engine.logprob_reads import TIE
from evalkit.engine.served.body import (ServedReadError, VLLMApi, checked_value, choice_of, generate_body,
                                        prompt_logprobs_body, read_generation, read_prompt_logprobs, read_trace,
                                        salt)
from evalkit.engine.served.id_reads import read_ids


def traced_generate_body(request: GenRequest, model: str, top_k: int) -> dict[str, Any]:
    """The generation's body, asking a greedy request's top_k entries at each step, keyed by token id."""
    extra = {"logprobs": top_k, "return_tokens_as_token_ids": True} if top_k and request.greedy else {}
    return {**generate_body(request, model), **extra}


def read_steps(logprobs: Mapping[str, Any] | None, token_ids: Sequence[int], top_k: int) -> TokenTrace:
    """The trace of a generation's output tokens from its completion ``logprobs`` (one step per token id)."""
    logprobs = logprobs or {}
    tokens, values, tops = (logprobs.get(k) or [] for k in ("tokens", "token_logprobs", "top_logprobs"))
    if not len(tokens) == len(values) == len(tops) == len(token_ids):
        raise ServedReadError(f"{len(tops)} generated steps of log-probabilities ({len(tokens)} tokens, "
                              f"{len(values)} values) for {len(token_ids)} output tokens")
    found, rows = [], []
    for step, (token, name, value, row) in enumerate(zip(token_ids, tokens, values, tops)):
        where = f"generated step {step}"
        if name != f"token_id:{token}":
            raise ServedReadError(f"{where} names {name!r}, the output has token {token} (the server must honour "
                                  "return_tokens_as_token_ids)")
        value = checked_value(value, step, where)
        found.append(value)
        rows.append(_step_top(row, token, value, top_k, step))
    return TokenTrace(logprobs=tuple(found), top=tuple(rows))


def _step_top(row: Any, token: int, value: float, top_k: int, step: int) -> tuple[tuple[int, float], ...]:
    """One step's top entries, best first, from the server's list (the token first, then the rest by rank)."""
    where = f"generated step {step}"
    if not isinstance(row, dict) or not 1 <= len(row) <= top_k + 1:
        raise ServedReadError(f"{where}: {len(row) if isinstance(row, dict) else row!r} top entries, the output "
                              f"token and {top_k} best were asked for")
    entries = []
    for key, entry in row.items():
        if not (isinstance(key, str) and key.startswith("token_id:") and key[9:].isdigit()):
            raise ServedReadError(f"{where}: a top entry keyed {key!r}, not token_id:N")
        entries.append((int(key[9:]), checked_value(entry, step, where)))
    if len({t for t, _ in entries}) != len(entries):
        raise ServedReadError(f"{where}: a token repeats among the top entries")
    own = dict(entries).get(token)
    if own is None or abs(own - value) > TIE:
        raise ServedReadError(f"{where}: the output token {token} ({value!r}) is listed as {own!r}")
    rest = [(t, v) for t, v in entries if t != token]  # the server's top-k, by rank, the token taken out
    if any(later > earlier + TIE for (_, earlier), (_, later) in zip(rest, rest[1:])):
        raise ServedReadError(f"{where}: top entries not best first")
    top = rest if len(entries) == top_k + 1 else sorted(entries, key=lambda e: -e[1])  # the token out, or in
    fault = top_list_fault(token, value, top, TIE)
    if fault:
        raise ServedReadError(f"{where} {fault}")
    return tuple(top)


def read_traced_generation(request: GenRequest, response: dict[str, Any], top_k: int) -> Generation:
    """The generation, with the trace of its steps where it was asked for one (a greedy request, top_k > 0)."""
    generation = read_generation(request, response)
    if not (top_k and request.greedy):
        return generation
    steps = read_steps(choice_of(response, request.prompt_ids).get("logprobs"), generation.token_ids, top_k)
    return dataclasses.replace(generation, trace=steps)


def read_traced_score(request: ScoreRequest, response: dict[str, Any], top_k: int) -> Scored:
    """The score of the request and its trace, both read from one response's prompt rows."""
    return dataclasses.replace(read_prompt_logprobs(request, response), trace=read_trace(request, response, top_k))


class TracedVLLMApi(VLLMApi):
    """:class:`VLLMApi`, its answers asked with top_k > 0 carrying their traces, read from the same requests; and
    the record's ids reads (served/id_reads.py)."""

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None, top_k: int = 0) -> list[Generation]:
        if not top_k:
            return super().generate(requests, progress)
        return self.sender.built(requests, lambda r: traced_generate_body(r, self.model, top_k),
                                 lambda r, response: read_traced_generation(r, response, top_k), progress,
                                 lambda r: len(r.prompt_ids))

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None, fast: bool,
              top_k: int = 0) -> list[Scored]:
        if not top_k:
            return super().score(requests, progress, fast)
        self.counts.update(prompt_logprobs=len(requests))
        return self.sender.send(requests, lambda r: prompt_logprobs_body(r.ids, self.model, salt(), top_k),
                                lambda r, response: read_traced_score(r, response, top_k), progress,
                                lambda r: len(r.ids))

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        return read_ids(self.sender, reads, model=self.model, cache_salt=self.cache_salt, counts=self.counts,
                        asks_ids=self.asks_ids)
