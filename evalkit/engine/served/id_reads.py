"""engine=served, ``Engine.read_ids`` through vLLM's fields: the log-probabilities of asked token ids as the next
token after a context (a candidate's record reads the reference's top ids its own top-k left out,
docs/divergence.md).

Each read's distinct ids go in next-token bodies (``body.next_token_body``: ``logprob_token_ids``, keyed by token
id), at most MAX_LOGPROB_TOKEN_IDS a body (more split, their answers merged: ``logprob_reads.id_asks``), under the
engine's cache_salt as its other next-token reads. The sender bundles the bodies of several reads into one request
(their ids together, at most 128) and sends them with the client's concurrency; each answer is checked for
exactly its own ids (:func:`read_asked`), and one that fails is sent again alone (``batch.Sender``). A read none
of whose bodies failed is answered; the others fail the call with the finished reads (``ServedError``).

A server that ignores ``logprob_token_ids`` (vLLM 0.23's completions API has no such field; the probe finds it
out) is read through prompt rows instead: each asked id after its context as a prompt of its own, context + (id,),
whose last row is that id's log-probability given the context (``prompt_logprobs``, a fresh salt, and vLLM reads
no cache for prompt log-probabilities), checked to be the row of that id at that position (:func:`read_row`).
One prompt per id: a prefill each, where the next-token read asks 128 ids at once.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import IdsRead, ScoreRequest
from evalkit.engine.logprob_reads import id_asks, id_values
from evalkit.engine.served.batch import MAX_LOGPROB_TOKEN_IDS, Sender, ServedError, failed
from evalkit.engine.served.body import (CLAMPED, checked_value, next_token_body, prompt_logprobs_body, prompt_rows,
                                        salt, step_entries)


def read_asked(context: Sequence[int], asked: Sequence[int], response: dict[str, Any]) -> dict[int, float]:
    """{asked id: log-probability} of the next token after context, from a next-token response: one generated
    step, keyed by token id, holding every asked id, each finite and <= 0 or -inf (the server writes it as -9999);
    the ids the step holds beyond these (the greedy token, another member's of a bundle) are left out."""
    entries = step_entries(context, asked, response)
    return {t: _value(entries[t], len(context)) for t in asked}


def read_row(context: Sequence[int], token: int, response: dict[str, Any]) -> dict[int, float]:
    """{token: log-probability} after context, from the prompt rows of context + (token,): the prompt the server
    saw checked to be the one sent, and its last row to hold that token (``body.prompt_rows``)."""
    ((position, row),) = prompt_rows(ScoreRequest(ids=(*context, token), start=len(context)), response)
    return {token: _value(row[str(token)], position)}


def _value(entry: Any, position: int) -> float:
    """An asked id's log-probability: -inf where the server clamped it to -9999, else checked finite and <= 0."""
    value = entry.get("logprob") if isinstance(entry, dict) else entry
    if isinstance(value, (int, float)) and (value == CLAMPED or value == -math.inf):
        return -math.inf
    return checked_value(value, position, "asked id")


def read_ids(sender: Sender, reads: Sequence[IdsRead], *, model: str, cache_salt: str, counts: Counter[str],
             asks_ids: bool) -> list[tuple[float, ...]]:
    """Each read's log-probability of every asked id after its context, in the order asked: next-token reads
    where the server honours logprob_token_ids (asks_ids), else one prompt-row read per id. A read that asks no
    id is answered () unsent, one that asks ids after an empty context raises ValueError before anything is sent.
    Reads whose answers failed their check twice raise ServedError, holding the others' answers (None: failed).
    Counted in counts: id_reads, id_read_bodies (the sender counts the requests that carried them)."""
    asks = [(reads[n].context, tuple(ids), n) for n, ids in id_asks(reads, MAX_LOGPROB_TOKEN_IDS if asks_ids else 1)]
    counts.update(id_reads=len(reads), id_read_bodies=len(asks))
    make, read = ((lambda a: next_token_body(a[0], a[1], model, cache_salt),
                   lambda a, response: read_asked(a[0], a[1], response)) if asks_ids else
                  (lambda a: prompt_logprobs_body((*a[0], *a[1]), model, salt()),
                   lambda a, response: read_row(a[0], a[1][0], response)))
    reason = None
    try:
        found = sender.send(asks, make, read, None, len) if asks else []
    except ServedError as error:
        found, reason = error.answers, error.reason
    entries: list[dict[int, float]] = [{} for _ in reads]
    lost = set()
    for (_, _, n), entry in zip(asks, found):
        if entry is None:
            lost.add(n)
        else:
            entries[n].update(entry)
    values = id_values([IdsRead(r.context, () if n in lost else r.ids) for n, r in enumerate(reads)], entries)
    if reason:
        raise failed([None if n in lost else v for n, v in enumerate(values)], reason)
    return values
