"""The engine calls of a run's divergence record: the traces the engine did not give beside its answers, and a
reference's top ids those traces left out (docs/divergence.md, "What a run records").

With ``divergence_top_k`` > 0 each batch's items are traced: those the engine answered in the same pass as their
scores or generations keep that trace; the others are traced in one more call (each distinct request once, in
the run's order: a noise run's traces see other batches too). With a reference, the ids of its top lists that a
trace leaves out are read apart (``Engine.read_ids``), each distinct read once. Every trace and read is checked
and kept on its record by ``divergence_traces.py``.
"""

from __future__ import annotations

from typing import Callable

from evalkit.contracts import Engine, IdsRead, RequestProgress, ScoreRequest, TokenTrace
from evalkit.harness.divergence_traces import (Item, ReferenceIds, TraceError, TraceLog, keep, reference_reads,
                                               scored_positions, with_given)

# Calls.submit: (call, items, label) -> the call's answers in the order of items
Submit = Callable[[Callable[[list, RequestProgress | None], list], list, str], list]


class Tracer:
    """The traces of one run's items, asked of its engine through submit, and what they did (``log``)."""

    def __init__(self, engine: Engine, top_k: int, *, submit: Submit, reference: ReferenceIds | None = None) -> None:
        self.engine = engine
        self.top_k = top_k  # top entries traced at each scored position; 0: no traces
        self.submit = submit
        self.reference = reference  # a reference run's top ids per position, read where the trace left them out
        self.log = TraceLog(top_k, dtype=engine.logits_dtype)

    def trace(self, kind: str, items: list[Item], given: dict[ScoreRequest, TokenTrace]) -> None:
        """With top_k > 0: the items' traces, checked and kept on their records (divergence_traces.keep). given
        holds those the engine answered in the same pass as the scores or generations; the others are traced in
        one more call."""
        items = [item for item in items if scored_positions(item[2])]  # an empty continuation has no position
        if not self.top_k or not items:
            return
        traced = {request: given[request] for _, _, request, _ in items if request in given}
        distinct = list(dict.fromkeys(request for _, _, request, _ in items if request not in traced))

        def call(requests: list[ScoreRequest], progress: RequestProgress | None) -> list:
            answers = self.engine.trace(requests, self.top_k)
            if len(answers) != len(requests):
                raise TraceError(f"the engine answered {len(answers)} traces for {len(requests)} {kind} requests")
            if progress:
                progress.advance(len(requests), sum(len(r.ids) for r in requests))
            return answers

        if distinct:
            traced.update(zip(distinct, self.submit(call, distinct, f"trace_{kind}")))
        self.log.second_pass[kind] += len(distinct)
        if self.reference is not None and not self.log.reference_not_read:
            traced = self.read_reference(kind, traced, self.reference)
        keep(kind, items, traced, self.log)

    def read_reference(self, kind: str, traced: dict[ScoreRequest, TokenTrace], reference: ReferenceIds
                       ) -> dict[ScoreRequest, TokenTrace]:
        """The traces with the reference's top ids they left out read apart (Engine.read_ids), each distinct
        read once, in the run's order; unchanged where the engine cannot read given ids (said in the summary)."""
        asks = reference_reads(traced, reference, self.log)
        reads = list(dict.fromkeys(read for per in asks.values() for read in per if read is not None))

        def call(batch: list[IdsRead], progress: RequestProgress | None) -> list:
            answers = self.engine.read_ids(batch)
            if len(answers) != len(batch):
                raise TraceError(f"the engine answered {len(answers)} id reads for {len(batch)} asked")
            if progress:
                progress.advance(len(batch), sum(len(r.context) for r in batch))
            return answers

        try:
            answers = dict(zip(reads, self.submit(call, reads, f"reference_{kind}"))) if reads else {}
        except NotImplementedError as error:
            self.log.reference_not_read = str(error)
            return traced
        self.log.reference["reads"] += len(reads)
        self.log.reference["ids_read"] += sum(len(r.ids) for r in reads)
        return with_given(traced, asks, answers, self.log)
