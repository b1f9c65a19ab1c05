"""engine=served, ``Engine.read_ids`` through vLLM's fields: the log-probabilities of asked token ids as the next
token after a context (a candidate's record reads the reference's top ids its own top-k left out,
docs/divergence.md).

Each read's distinct ids go in next-token bodies (``body.next_token_body``: ``logprob_token_ids``, keyed by token
id), at most MAX_LOGPROB_TOKEN_IDS a body (more split, their answers merged: ``logprob_reads.id_asks``), under the
engine's cache_salt as its other next-token reads. The sender bundles the bodies of several reads into one request
(their ids together, at most 128) and sends them with the client's concurrency; each answer is checked for
exactly its own ids (:func:`read_asked`), and one that fails is sent again alone (``batch.Sender``). A read none
of whose bodies failed is answered; the others fail the call with the finished reads (``ServedError``).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import IdsRead
from evalkit.engine.logprob_reads import id_asks, id_values
from evalkit.engine.served.batch import MAX_LOGPROB_TOKEN_IDS, Sender, ServedError, failed
from evalkit.engine.served.body import CLAMPED, checked_value, next_token_body, step_entries


def read_asked(context: Sequence[int], asked: Sequence[int], response: dict[str, Any]) -> dict[int, float]:
    """{asked id: log-probability} of the next token after context, from a next-token response: one generated
    step, keyed by token id, holding every asked id, each finite and <= 0 or -inf (the server writes it as -9999);
    the ids the step holds beyond these (the greedy token, another member's of a bundle) are left out."""
    entries = step_entries(context, asked, response)
    return {t: _value(entries[t], len(context)) for t in asked}


def _value(entry: Any, position: int) -> float:
    """An asked id's log-probability: -inf where the server clamped it to -9999, else checked finite and <= 0."""
    value = entry.get("logprob") if isinstance(entry, dict) else entry
    if isinstance(value, (int, float)) and (value == CLAMPED or value == -math.inf):
        return -math.inf
    return checked_value(value, position, "asked id")


def read_ids(sender: Sender, reads: Sequence[IdsRead], *, model: str, cache_salt: str, counts: Counter[str]
             ) -> list[tuple[float, ...]]:
    """Each read's log-probability of every asked id after its context, in the order asked; a read that asks no
    id is answered () unsent, one that asks ids after an empty context raises ValueError before anything is sent.
    Reads whose answers failed their check twice raise ServedError, holding the others' answers (None: failed).
    Counted in counts: id_reads, id_read_bodies (the sender counts the requests that carried them)."""
    asks = [(reads[n].context, tuple(ids), n) for n, ids in id_asks(reads, MAX_LOGPROB_TOKEN_IDS)]
    counts.update(id_reads=len(reads), id_read_bodies=len(asks))
    reason = None
    try:
        found = sender.send(asks, lambda a: next_token_body(a[0], a[1], model, cache_salt),
                            lambda a, response: read_asked(a[0], a[1], response), None, len) if asks else []
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
