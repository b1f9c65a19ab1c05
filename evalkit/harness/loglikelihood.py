"""lm-eval's log-likelihood requests as engine score requests, each with its :class:`RequestRecord`.

A (context, continuation) pair keeps its whole continuation and loses context from the left only as the length
budget allows (``budget.plan_score``). A rolling text is cut into disjoint windows of ``max_model_len - 2``
tokens, as lm-eval's vllm backend cuts them (its hf backend uses windows of max_length). Pure functions, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from evalkit.contracts import RequestRecord, Scored, ScoreRequest
from evalkit.harness.budget import plan_score
from evalkit.harness.divergence_traces import Item


def pair_requests(pairs: Sequence[tuple[object, Sequence[int], Sequence[int]]], *, max_model_len: int,
                  overflow: str) -> tuple[list[ScoreRequest], list[RequestRecord]]:
    """pairs: ((context, continuation), context ids, continuation ids). Each pair's score request (the context
    cut from the left where it does not fit) and its record."""
    requests, records = [], []
    for _, context_enc, continuation_enc in pairs:
        drop = plan_score(context_tokens=len(context_enc), continuation_tokens=len(continuation_enc),
                          max_model_len=max_model_len, overflow=overflow)
        ids = tuple(context_enc[drop:]) + tuple(continuation_enc)
        requests.append(ScoreRequest(ids=ids, start=len(context_enc) - drop))
        records.append(RequestRecord(kind="loglikelihood", prompt_tokens=len(ids), truncated_tokens=drop,
                                     extra={"continuation_tokens": len(continuation_enc)}))
    return requests, records


@dataclass(frozen=True)
class Windows:
    """Texts cut into windows: the windows' score requests, in text order, and one record per text."""

    requests: list[ScoreRequest]
    owners: list[int]  # each window's text
    numbers: list[int]  # each window's number in its text: its request in the divergence record
    records: list[RequestRecord]

    def totals(self, answers: Sequence[Scored]) -> list[float]:
        """Each text's log-likelihood: the sum over its windows' answers."""
        totals = [0.0] * len(self.records)
        for n, scored in zip(self.owners, answers):
            totals[n] += scored.logprob
        return totals

    def items(self, answers: Sequence[Scored]) -> list[Item]:
        """Each window as the divergence tracing takes it: its text's record, its number, request and answer."""
        return [(self.records[n], w, window, scored)
                for n, w, window, scored in zip(self.owners, self.numbers, self.requests, answers)]


def rolling_windows(texts: Sequence[Sequence[int]], *, prefix_token: int, max_model_len: int) -> Windows:
    """texts: each text's token ids (with the tokenizer's default special tokens, so a BOS is scored too), cut
    into disjoint windows of max_model_len - 2 tokens, each window's first token given by prefix_token or the
    token before it."""
    requests, owners, numbers, records = [], [], [], []
    for n, tokens in enumerate(texts):
        windows = map(make_disjoint_window, get_rolling_token_windows(
            token_list=list(tokens), prefix_token=prefix_token, max_seq_len=max_model_len - 2, context_len=1))
        for w, (context, continuation) in enumerate(windows):
            requests.append(ScoreRequest(ids=tuple(context) + tuple(continuation), start=len(context)))
            owners.append(n)
            numbers.append(w)
        records.append(RequestRecord(kind="loglikelihood_rolling", prompt_tokens=len(tokens),
                                     extra={"windows": owners.count(n)}))
    return Windows(requests=requests, owners=owners, numbers=numbers, records=records)
