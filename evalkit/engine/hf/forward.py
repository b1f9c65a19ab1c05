"""engine=hf, log-likelihoods and token traces: the scored positions of each request read from one forward pass,
as lm-eval's own ``hf`` backend computes them (``HFLM._loglikelihood_tokens``): the whole sequence but its last
token, right-padded, no attention mask, log_softmax in the model's dtype; is_greedy when every scored token is
the argmax. tests/engine/hf/test_hf_engine.py holds the numbers equal to lm-eval's. The traces (the divergence
record) and ``read_ids`` take their log-probabilities from the same logits log_softmax'ed in float32, so each
position's entries are those of one normalised distribution: in bfloat16, the model-dtype rows a score sums
put up to 1.005 of probability on a position's top-20, which made the bound's rest term explode.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

from evalkit.contracts import IdsRead, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.hf.model import Loaded
from evalkit.engine.logprob_reads import id_asks, id_values

LOGIT_ROWS = 4096  # rows of logits (batch x longest input) one scoring pass may hold; 49152 x 4 bytes each here


def score_batches(requests: Sequence[ScoreRequest], batch_size: int, logit_rows: int = LOGIT_ROWS) -> list[list[int]]:
    """Indices of requests in forward passes, in lm-eval's hf order (longest first, then by token ids), at most
    batch_size each and at most logit_rows rows of logits (batch times its longest input; one request at least)."""
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].ids), requests[i].ids))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and \
                (len(batches[-1]) + 1) * (len(requests[batches[-1][0]].ids) - 1) <= logit_rows:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def score(loaded: Loaded, requests: Sequence[ScoreRequest], progress: Progress | None, *,
          batch_size: int, top_k: int = 0) -> list[Scored]:
    """Log-probabilities of ids[start:] given ids[:start] (from position 1 when start is 0, as vLLM), and
    is_greedy as lm-eval's hf backend reads it: each scored token is the argmax. With top_k > 0, each answer's
    trace too, read from the same rows (one forward pass: the numbers ``trace`` reads)."""

    def read(r: ScoreRequest, rows: Rows) -> Scored:
        return Scored(**_scored(r, rows.scored()), trace=_trace(r, rows.traced(), top_k) if top_k else None)

    return _each_batch(loaded, requests, read, Scored(logprob=0.0, is_greedy=True), progress, batch_size)


def trace(loaded: Loaded, requests: Sequence[ScoreRequest], top_k: int, *, batch_size: int) -> list[TokenTrace]:
    """Each scored position's token log-probability and its top_k (token, log-probability) entries."""
    return _each_batch(loaded, requests, lambda r, rows: _trace(r, rows.traced(), top_k),
                       TokenTrace(logprobs=(), top=()),
                       None, batch_size)


def read_ids(loaded: Loaded, reads: Sequence[IdsRead], *, batch_size: int) -> list[tuple[float, ...]]:
    """Each read's log-probability of every asked id after its context, in the order asked: one forward pass
    over each distinct context, batched as scoring batches them (a context is the input of a one-token
    continuation), the last position's logits log_softmax'ed in float32 and the ids gathered. A read that asks
    no id is answered (); one that asks ids after an empty context, or an id outside the vocabulary, raises
    ValueError."""
    import torch

    by_context: dict[tuple[int, ...], list[int]] = {}
    for n, _ in id_asks(reads, sys.maxsize):  # checked; one ask a read (no limit on the ids it asks here)
        by_context.setdefault(reads[n].context, []).append(n)
    contexts = list(by_context)
    entries: list[dict[int, float]] = [{} for _ in reads]
    for batch in score_batches([ScoreRequest(ids=(*c, 0), start=len(c)) for c in contexts], batch_size):
        chosen = [contexts[b] for b in batch]
        ids, _ = loaded.padded(chosen, left=False)
        with torch.inference_mode():
            logits = loaded.model(input_ids=ids).logits
            ends = torch.tensor([len(c) - 1 for c in chosen], device=logits.device)
            rows = torch.log_softmax(logits[torch.arange(len(chosen), device=logits.device), ends].float(), dim=-1)
        for context, row in zip(chosen, rows):
            for n in by_context[context]:
                entries[n] = _gathered(row, reads[n].ids)
    return id_values(reads, entries)


def _gathered(row: Any, ids: Sequence[int]) -> dict[int, float]:
    """{id: row[id]} for each distinct id, each checked to be a row's index (a negative one would read another)."""
    import torch

    wanted = list(dict.fromkeys(ids))
    outside = [t for t in wanted if not 0 <= t < row.shape[0]]
    if outside:
        raise ValueError(f"read_ids: ids {outside[:5]} are outside the model's {row.shape[0]} logits")
    return dict(zip(wanted, row[torch.tensor(wanted, device=row.device)].tolist()))


def _scored(r: ScoreRequest, rows: Any) -> dict[str, Any]:
    """The sum of the scored tokens' log-probabilities in the model's dtype (as lm-eval's hf backend sums them),
    and whether each is its row's argmax."""
    import torch

    target = torch.tensor(r.ids[max(r.start, 1):], device=rows.device)
    return {"logprob": float(rows.gather(1, target[:, None]).sum()),
            "is_greedy": bool((rows.argmax(dim=-1) == target).all())}


def _trace(r: ScoreRequest, rows: Any, top_k: int) -> TokenTrace:
    """The trace from float32 log-probabilities (Rows.traced): the text tokens and the top_k of each row."""
    import torch

    target = torch.tensor(r.ids[max(r.start, 1):], device=rows.device)
    values, tokens = rows.topk(top_k, dim=-1)
    return TokenTrace(logprobs=tuple(rows.gather(1, target[:, None])[:, 0].tolist()),
                      top=tuple(tuple(zip(t, v)) for t, v in zip(tokens.tolist(), values.tolist())))


class Rows:
    """The positions of one request that a forward pass computed, from position first on: its logits, read as
    lm-eval's hf backend reads them for a score (``scored``: log_softmax in the model's dtype over the whole
    batch, kept in it) and as the divergence record reads them (``traced``: log_softmax in float32, computed
    only when asked)."""

    def __init__(self, logits: Any, logprobs: Any, first: int = 0) -> None:
        self.logits, self.logprobs, self.first = logits, logprobs, first

    def scored(self) -> Any:
        return self.logprobs[self.first:]

    def traced(self) -> Any:
        import torch

        if self.logits.dtype == torch.float32:
            return self.logprobs[self.first:]
        with torch.inference_mode():
            return torch.log_softmax(self.logits[self.first:].float(), dim=-1)

    def after(self, skip: int) -> "Rows":
        return Rows(self.logits, self.logprobs, self.first + skip)


def _each_batch(loaded: Loaded, requests: Sequence[ScoreRequest], read: Callable[[ScoreRequest, Rows], Any],
                empty: Any, progress: Progress | None, batch_size: int) -> list[Any]:
    """read(request, the log-probabilities of its scored positions) for each request, in request order; empty
    for a request that scores no token.

    Requests with the same input (ids[:-1]: the choices of a question with one-token answers) share one
    forward pass, that of the one with the longest continuation, as lm-eval's hf backend shares them."""
    results: list[Any] = [empty] * len(requests)
    shared: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(requests):
        if len(r.ids) > max(r.start, 1):  # the others score no token
            shared.setdefault(r.ids[:-1], []).append(i)
    first = {i: max(requests[i].start, 1) for members in shared.values() for i in members}
    heads = [min(members, key=lambda i: first[i]) for members in shared.values()]
    if progress and len(first) < len(requests):
        progress.advance(len(requests) - len(first))
    for batch in score_batches([requests[i] for i in heads], batch_size):
        chosen = [requests[heads[b]] for b in batch]
        answered = 0
        for b, rows in zip(batch, _logprobs(loaded, chosen)):
            for i in shared[requests[heads[b]].ids[:-1]]:
                results[i] = read(requests[i], rows.after(first[i] - first[heads[b]]))
                answered += 1
        if progress:
            progress.advance(answered, sum(len(r.ids) for r in chosen))
    return results


def _logprobs(loaded: Loaded, batch: Sequence[ScoreRequest]) -> list[Rows]:
    """Per request, the rows [positions, vocab] of the positions predicting ids[max(start, 1):], as
    lm-eval's hf backend computes them: one forward pass of the batch, right-padded, over each sequence but its
    last token, with no attention mask (right padding comes after every position a causal model reads),
    log_softmax in the model's dtype, and kept in it (lm-eval sums a continuation's values in that dtype). All
    logits are computed: asking for the scored positions only (logits_to_keep) would change them by rounding
    (measured: up to 8e-6 nats per request in float32). In bfloat16, a float32 log_softmax and sum moved a
    continuation by up to 3.6e-2 nats from lm-eval's (tests/engine/hf/test_hf_engine.py holds the two equal in
    bfloat16)."""
    import torch

    ids, _ = loaded.padded([r.ids[:-1] for r in batch], left=False)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits
        rows = torch.log_softmax(logits, dim=-1)
        return [Rows(logits[row, max(r.start, 1) - 1:len(r.ids) - 1], rows[row, max(r.start, 1) - 1:len(r.ids) - 1])
                for row, r in enumerate(batch)]
