"""The divergence record's engine calls (evalkit/harness/trace_calls.py) on the deterministic fake engine: what is
traced apart, once, and the reference's ids read apart. Run: pytest tests/test_trace_calls.py"""

from evalkit.contracts import RequestRecord, ScoreRequest
from evalkit.harness.calls import Calls
from evalkit.harness.trace_calls import Tracer
from tests.fake_engine import FakeEngine
from tests.test_recording import TracingEngine

A = ScoreRequest(ids=(1, 104, 105, 106), start=2)
B = ScoreRequest(ids=(1, 104, 111), start=2)
EMPTY = ScoreRequest(ids=(1, 104), start=2)  # nothing to score


def items(*requests):
    return [(RequestRecord(kind="loglikelihood", prompt_tokens=len(r.ids)), n, r, None) for n, r in enumerate(requests)]


def test_what_the_engine_did_not_trace_in_its_pass_is_traced_apart_each_request_once():
    engine = TracingEngine()
    tracer = Tracer(engine, 3, submit=Calls().submit)
    given = {B: engine.trace([B], 3)[0]}
    engine.traced.clear()
    kept = items(A, A, B, EMPTY)
    tracer.trace("loglikelihood", kept, given)
    assert engine.traced == [[A]]  # A once; B came with its scores; EMPTY has no position
    assert [len(record.traced) for record, _, _, _ in kept] == [1, 1, 1, 0]
    summary = tracer.log.summary()
    assert summary["traced_requests"] == {"loglikelihood": 2} and summary["traced_apart"] == {"loglikelihood": 1}


def test_top_k_zero_traces_nothing():
    engine = TracingEngine()
    kept = items(A)
    Tracer(engine, 0, submit=Calls().submit).trace("loglikelihood", kept, {})
    assert engine.traced == [] and kept[0][0].traced == []


def test_the_reference_ids_a_trace_left_out_are_read_apart_once():
    engine = FakeEngine()
    wanted = (7, 105)  # 105 is A's own token at position 2: known, not read
    tracer = Tracer(engine, 2, submit=Calls().submit, reference=lambda r: [wanted] * (len(r.ids) - r.start))
    kept = items(A)
    tracer.trace("loglikelihood", kept, {})
    assert [(read.context, read.ids) for read in engine.id_reads] == [(A.ids[:2], (7,)), (A.ids[:3], (7, 105))]
    (_, _, trace), = kept[0][0].traced
    assert [dict(g) for g in trace.given] == [{7: -5.07}, {7: -5.07, 105: -5.05}]
    assert tracer.log.summary()["reference"]["reads"] == 2
