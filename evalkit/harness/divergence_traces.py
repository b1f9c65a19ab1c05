"""Traces of a run's scored positions, for its divergence record (docs/divergence.md, "What a run records").

With ``divergence_top_k`` > 0 the harness asks each engine call for its answers' traces too (``top_k`` of
``Engine.score`` and ``Engine.generate``): at each position, the text token's log-probability and the engine's
top-k entries. An engine that reads both in one pass (vLLM: its scores come from the trace reads, its greedy
generations return the top-k of each step) answers them there; what an engine leaves without a trace is traced
in one more batched ``trace`` call. The positions recorded per kind are :data:`RECORDED`. Each trace is checked
against what was asked before it is kept (docs/architecture.md, "A reader of an engine's or a server's output"): one
log-probability and one top list per position, at most k distinct entries, best first, the text token's value
agreeing with its own entry, and no entry missing that the text token outranks (a read of the wrong position or token
shows as one). A log-likelihood's traced tokens must also sum to what the engine scored: from one pass they are the
same numbers; from separate reads (other batches, prefixes computed apart) they differ by the engine's own noise,
which is measured and recorded, and a gap beyond :func:`gross_gap` fails the run in one line.

Values that may come from two engine calls (a text token read apart from its top list, a reference's id read
apart) may disagree by the engine's rounding from call to call: a value above the top list that left it out cannot
come from that list's own row. Such positions are counted (``TraceLog.apart``, results.json's
``evalkit.divergence.between_calls``). A reference's id read apart never ends a run on its value: its position
keeps its own top list (the first read) and its ids read apart are left out, and those beyond the rounding of the
engine's logits dtype between calls (``contracts.apart_tolerance``: 1 nat in bfloat16, 1e-4 in float32) are
counted apart. A text token reaches the harness within that rounding (the engine's
reader sends a token read beyond it again, in one call with its list); beyond it, the trace is no engine's
answer. What is exact stays fatal: the number of values and positions, a NaN, a value above 0.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Sequence

from evalkit.contracts import (ENTRY_TOLERANCE, Generation, GenRequest, IdsRead, RequestRecord, Scored, ScoreRequest,
                               TokenTrace, apart_tolerance, top_list_fault)

# a reference run's top ids at each scored position of a request (ids[max(start, 1):]), None where the reference
# recorded no such context (evalkit/run/reference.py)
ReferenceIds = Callable[[ScoreRequest], Sequence[tuple[int, ...] | None]]

# what the harness traces: the record it belongs to, its request number in its document (lm-eval's index of a
# choice or a generation, a rolling window's number), the request, and its score where it was scored
Item = tuple[RequestRecord, int, ScoreRequest, Scored | None]

RECORDED = {
    "loglikelihood": "the continuation tokens of every request (each choice)",
    "loglikelihood_rolling": "every token of every window",
    "generate_until": "each greedy generation's own output tokens after its prompt; sampled draws are not recorded",
}


def gross_gap(positions: int, dtype: str) -> float:
    """The largest |Σ trace − score| (nats) a request of this many scored positions may show before the run
    fails, for an engine computing its logits in dtype: 0.5 nats, and at each position the larger of 0.01 and the
    rounding between two calls (``apart_tolerance``), far above the noise between the engine's scoring paths
    (largest measured: docs/divergence.md)."""
    return 0.5 + max(0.01, apart_tolerance(dtype)) * positions


class TraceError(RuntimeError):
    """An engine's trace that does not answer what was asked."""


def scored_positions(request: ScoreRequest) -> int:
    """Positions of ids[start:] that have a context (position 0 never does)."""
    return max(len(request.ids) - max(request.start, 1), 0)


def check(request: ScoreRequest, trace: TokenTrace, top_k: int, *, dtype: str) -> list[int]:
    """The trace answers the request: see the module docstring (dtype: the engine's logits dtype). TraceError in
    one line where it does not. Returns the positions whose text token lies above the top list that left it out,
    within the rounding between two calls (an engine's reader reads such a token in another call than the list,
    and sends it again in one call beyond that rounding: trace_rows.next_token_trace)."""
    start = max(request.start, 1)
    n = len(request.ids) - start
    apart: list[int] = []
    if len(trace.logprobs) != n or len(trace.top) != n:
        raise TraceError(f"the engine's trace of a {len(request.ids)}-token request has {len(trace.logprobs)} "
                         f"log-probabilities and {len(trace.top)} top lists for its {n} scored positions")
    for p, (value, top) in enumerate(zip(trace.logprobs, trace.top), start=start):
        token = request.ids[p]
        where = f"the engine's trace at position {p} (token {token})"
        if not top or len(top) > top_k:
            raise TraceError(f"{where} has {len(top)} top entries; divergence_top_k={top_k} asks for 1 to {top_k}")
        if math.isnan(value) or any(math.isnan(v) for _, v in top):
            raise TraceError(f"{where} holds a NaN log-probability")
        fault = top_list_fault(token, value, top, ENTRY_TOLERANCE, unlisted=apart_tolerance(dtype))
        if fault:
            raise TraceError(f"{where} {fault}")
        if token not in dict(top) and value > top[-1][1] + ENTRY_TOLERANCE:
            apart.append(p)
    return apart


def score_gap(request: ScoreRequest, trace: TokenTrace, scored: Scored, *, dtype: str) -> float:
    """|Σ trace − score| of one request; TraceError where it is gross (:func:`gross_gap`, dtype: the engine's
    logits dtype)."""
    gap = abs(math.fsum(trace.logprobs) - scored.logprob)
    allowed = gross_gap(len(trace.logprobs), dtype)
    if gap > allowed:
        raise TraceError(f"the engine's trace of a {len(trace.logprobs)}-token continuation sums to "
                         f"{math.fsum(trace.logprobs):.4f} but it scored {scored.logprob:.4f}, {gap:.3g} nats apart "
                         f"where {allowed:.3g} are allowed (0.5 and {max(0.01, apart_tolerance(dtype)):.3g} a position: "
                         f"far above {dtype or 'any dtype'}'s rounding between two reads): its trace and its scores read different tokens or positions (pass "
                         "divergence_top_k=0 to run without the record, and report the engine)")
    return gap


class TraceLog:
    """What the run's traces did, kind by kind, for results.json's ``evalkit.divergence``."""

    def __init__(self, top_k: int, *, dtype: str) -> None:
        self.top_k = top_k
        self.dtype = dtype  # the engine's logits dtype: what its checks allow between two calls
        self.requests: Counter[str] = Counter()  # kind -> distinct requests traced
        self.positions: Counter[str] = Counter()  # kind -> positions of those
        self.not_recorded: Counter[str] = Counter()  # why -> requests left out
        self.max_gap: dict[str, float] = {}  # kind -> largest |Σ trace − score| over its requests
        self.second_pass: Counter[str] = Counter()  # kind -> requests the engine traced in a call of their own
        # with a reference: positions whose context it recorded, positions among them that read ids apart, the
        # ids read (Engine.read_ids), and why none were read where the engine cannot
        self.reference: Counter[str] = Counter()
        self.reference_not_read = ""
        # positions whose values read in two engine calls disagree (a value above the top list that left it
        # out), by what showed it: text_token, reference_ids; beyond_tolerance: reference ids' positions that
        # parted by more than the rounding between calls (apart_tolerance); reads_left_out: the reference ids
        # read at such positions and left out. Each position counted once in positions
        self.apart: Counter[str] = Counter()
        self._apart_at: set[tuple[ScoreRequest, int]] = set()

    def disagree(self, request: ScoreRequest, position: int, shown_by: str) -> None:
        """One position of request whose values from two engine calls disagree, shown by shown_by."""
        self.apart[shown_by] += 1
        if (request, position) not in self._apart_at:
            self._apart_at.add((request, position))
            self.apart["positions"] += 1

    def traced(self, kind: str, requests: Sequence[ScoreRequest]) -> None:
        self.requests[kind] += len(requests)
        self.positions[kind] += sum(scored_positions(r) for r in requests)

    def gap(self, kind: str, gap: float) -> None:
        self.max_gap[kind] = max(self.max_gap.get(kind, 0.0), gap)

    def summary(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "logits_dtype": self.dtype,
                "recorded": {kind: RECORDED[kind] for kind in RECORDED if self.requests[kind]},
                "traced_requests": dict(self.requests), "traced_positions": dict(self.positions),
                "traced_apart": {kind: n for kind, n in self.second_pass.items() if self.requests[kind]},
                "not_recorded": {why: n for why, n in self.not_recorded.items() if n},
                "max_score_gap": {kind: float(f"{gap:.3g}") for kind, gap in self.max_gap.items()},
                "between_calls": {"positions": self.apart["positions"], "text_token": self.apart["text_token"],
                                  "reference_ids": self.apart["reference_ids"],
                                  "beyond_tolerance": self.apart["beyond_tolerance"],
                                  "reads_left_out": self.apart["reads_left_out"],
                                  "tolerance": float(f"{apart_tolerance(self.dtype):.3g}")},
                **({"reference": {**self.reference, **({"not_read": self.reference_not_read}
                                                       if self.reference_not_read else {})}}
                   if self.reference or self.reference_not_read else {})}


def given_traces(requests: Sequence[ScoreRequest], answers: Sequence[Scored]) -> dict[ScoreRequest, TokenTrace]:
    """The traces the engine answered beside its scores (``Scored.trace``: one pass), by request."""
    return {r: a.trace for r, a in zip(requests, answers) if a is not None and a.trace is not None}


def outputs(instances: Sequence[Any], records: Sequence[RequestRecord], batch: Sequence[GenRequest],
            generations: Sequence[Generation], *, max_model_len: int, log: TraceLog
            ) -> tuple[list[Item], dict[ScoreRequest, TokenTrace]]:
    """Each greedy generation's prompt + its own output ids, scored from the first output token: two runs'
    contexts are then the same up to and including the first token where their outputs part. A greedy
    request lm-eval repeats is traced once; sampled draws are left out (they share one request number and
    their first context, and part by chance), and so is an output whose ids the engine did not give. Returns
    the items and, where the engine's generation carried the trace of its steps (one pass), that trace cut to
    the item's positions."""
    items: list[Item] = []
    given: dict[ScoreRequest, TokenTrace] = {}
    seen = set()
    for instance, record, request, generation in zip(instances, records, batch, generations):
        if not request.greedy or not generation.token_ids:
            why = "sampled generations" if not request.greedy else "generations without token ids"
            log.not_recorded[why] += bool(generation.output_tokens)
            continue
        ids = request.prompt_ids + tuple(generation.token_ids)
        room = max_model_len - 1  # a read needs one free position after its ids (budget.plan_score)
        log.not_recorded["output tokens past max_model_len - 1"] += max(len(ids) - room, 0)
        traced = ScoreRequest(ids=ids[:room], start=len(request.prompt_ids))
        if (instance.task_name, instance.doc_id, instance.idx, traced) not in seen:
            seen.add((instance.task_name, instance.doc_id, instance.idx, traced))
            items.append((record, instance.idx, traced, None))
            if generation.trace is not None:
                given[traced] = steps_trace(traced, generation.trace)
    return items, given


def steps_trace(traced: ScoreRequest, steps: TokenTrace) -> TokenTrace:
    """The part of a generation's step trace (one entry per output token) that covers traced's positions."""
    first = max(traced.start, 1) - traced.start  # an output token at position 0 has no context
    n = scored_positions(traced)
    if len(steps.logprobs) < first + n:
        raise TraceError(f"the engine's trace of a generation has {len(steps.logprobs)} steps for its "
                         f"{first + n} output tokens")
    return TokenTrace(logprobs=steps.logprobs[first:first + n], top=steps.top[first:first + n])


def keep(kind: str, items: Sequence[Item], traced: dict[ScoreRequest, TokenTrace], log: TraceLog) -> None:
    """Check each distinct request's trace, measure each scored item's |Σ trace − score|, and keep the trace
    on its item's record as (request number, request, trace)."""
    for request, trace in traced.items():
        for position in check(request, trace, log.top_k, dtype=log.dtype):
            log.disagree(request, position, "text_token")
    log.traced(kind, list(traced))
    for record, number, request, scored in items:
        if scored is not None:
            log.gap(kind, score_gap(request, traced[request], scored, dtype=log.dtype))
        record.traced.append((number, request, traced[request]))


def reference_reads(traced: dict[ScoreRequest, TokenTrace], reference: ReferenceIds, log: TraceLog
                    ) -> dict[ScoreRequest, list[IdsRead | None]]:
    """Per traced request and scored position, the read of the reference's top ids that the trace's own top
    list and text token leave out (None where it names them all, or the reference has no such context)."""
    asks: dict[ScoreRequest, list[IdsRead | None]] = {}
    for request, trace in traced.items():
        wanted = list(reference(request))
        if len(wanted) != len(trace.top):
            raise TraceError(f"the reference gave {len(wanted)} positions for a request of {len(trace.top)}")
        start, reads = max(request.start, 1), []
        for p, (ids, top) in enumerate(zip(wanted, trace.top), start=start):
            known = {t for t, _ in top} | {request.ids[p]}
            missing = tuple(t for t in ids or () if t not in known)
            log.reference["positions_in_reference"] += ids is not None
            log.reference["positions_read"] += bool(missing)
            reads.append(IdsRead(context=request.ids[:p], ids=missing) if missing else None)
        asks[request] = reads
    return asks


def with_given(traced: dict[ScoreRequest, TokenTrace], asks: dict[ScoreRequest, list[IdsRead | None]],
               answers: dict[IdsRead, tuple[float, ...]], log: TraceLog) -> dict[ScoreRequest, TokenTrace]:
    """Each trace with its ids read apart (``TokenTrace.given``), each value checked: one value per asked id, a
    log-probability (TraceError in one line where not). A value above the last entry of the position's own top
    list (an id that list left out cannot outrank it in the same row) shows the two calls disagreeing: the
    position is counted (``TraceLog.disagree``; beyond the rounding between two calls of the engine's logits
    dtype, apart) and keeps its own top list alone, the bound's one sound choice where the values of its ids read
    apart are of another rounding than the list's (capped at its last entry, one came out 0.003 nats above the
    exact KL: tests/test_divergence_dtypes.py)."""
    out = {}
    tolerance = apart_tolerance(log.dtype)
    for request, trace in traced.items():
        given = []
        for read, top, p in zip(asks[request], trace.top, range(max(request.start, 1), len(request.ids))):
            values = answers[read] if read is not None else ()
            if read is not None and len(values) != len(read.ids):
                raise TraceError(f"the engine read {len(values)} log-probabilities for {len(read.ids)} asked ids "
                                 f"at position {p}")
            for t, v in zip(read.ids if read else (), values):
                if math.isnan(v) or v > ENTRY_TOLERANCE:
                    raise TraceError(f"the engine reads the reference's id {t} at position {p} as {v:.6g}: not a "
                                     "log-probability")
            above = max(values, default=-math.inf) - (top[-1][1] if top else 0.0)
            if read is not None and above > ENTRY_TOLERANCE:
                log.disagree(request, p, "reference_ids")
                log.apart["beyond_tolerance"] += above > tolerance
                log.apart["reads_left_out"] += len(values)
                read = None
            given.append(tuple(zip(read.ids, values)) if read else ())
        out[request] = replace(trace, given=tuple(given)) if any(given) else trace
    return out
