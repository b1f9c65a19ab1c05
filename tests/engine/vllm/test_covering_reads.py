"""evalkit/engine/vllm/covering_reads.py: which row reads trace which requests, and each request's trace taken from
the rows of the read that covers it, on rows built as vLLM 0.32 builds them in both runners' layouts
(tests/engine/vllm/test_trace_rows.py: a synthetic model whose distribution at each position is fixed, so a
covered request's exact trace is known). No engine is started.
Run: pytest tests/engine/vllm/test_covering_reads.py
"""

import pytest

from evalkit.contracts import ScoreRequest, TokenTrace
from evalkit.engine.logprob_reads import BadRead
from evalkit.engine.vllm.covering_reads import covered_trace, covering_reads, unlisted_last_steps
from evalkit.engine.vllm.trace_rows import trace_from_rows
from evalkit.harness.divergence_traces import check
from tests.engine.vllm.test_trace_rows import (HIT_BEFORE_ROWS, IDS, K, LOGITS, NO_HIT, reference, v1_layout,
                                               v2_layout)


def test_choices_of_one_question_share_a_read_per_last_context_that_none_extends():
    """Four choices behind one context (" 18", " 17", " 9", " 1" as tokens), one of them also scored whole, and
    a choice of another question: the first three share the read of " 18" (" 17" ends after the same context,
    " 9" and " 1" after " " which it extends) with rows from the earliest start; the other question reads its own."""
    context = (1, 2, 3)
    r18, r17 = ScoreRequest(ids=context + (9, 1, 8), start=3), ScoreRequest(ids=context + (9, 1, 7), start=3)
    r9, r1 = ScoreRequest(ids=context + (9, 5), start=3), ScoreRequest(ids=context + (9, 1), start=3)
    whole = ScoreRequest(ids=r18.ids, start=0)
    other = ScoreRequest(ids=(1, 2, 4, 9, 2), start=3)
    cover = covering_reads([r18, r17, r9, r1, whole, other])
    shared = ScoreRequest(ids=r18.ids, start=0)
    assert cover == {r18: shared, r17: shared, r9: shared, r1: shared, whole: shared, other: other}
    assert covering_reads([r17, r18])[r18] == ScoreRequest(ids=r17.ids, start=3)  # the first of a context reads


@pytest.mark.parametrize("layout,steps", [(v1_layout, NO_HIT), (v1_layout, HIT_BEFORE_ROWS),
                                          (v2_layout, HIT_BEFORE_ROWS)], ids=["V1", "V1 warm", "V2 warm"])
def test_a_covered_request_gets_its_exact_trace_from_the_rows_of_another(layout, steps):
    """Requests whose context before their last token the read's prompt holds: the read's own prefix, one
    ending in a token the row lists and one ending in a token it leaves out (its value read apart): each
    trace equals the one computed from the logits, and passes the harness's check."""
    read = ScoreRequest(ids=IDS, start=8)
    rows = trace_from_rows(read, layout(steps), K)
    table = LOGITS.log_softmax(-1)
    order = table[9].argsort(descending=True).tolist()  # the distribution after IDS[:10]
    listed, left_out = [t for t in order[:K] if t != IDS[10]][0], order[K + 3]
    requests = [ScoreRequest(ids=IDS[:11], start=9), ScoreRequest(ids=IDS[:10] + (listed,), start=8),
                ScoreRequest(ids=IDS[:10] + (left_out,), start=8)]
    cover = {r: read for r in requests}
    assert unlisted_last_steps(cover, {read: rows}) == [ScoreRequest(ids=requests[2].ids, start=10)]
    for request in requests:
        entries = {left_out: table[9, left_out].item()} if request is requests[2] else {}
        trace = covered_trace(request, read, rows, entries, dtype="float32")
        values, tops = reference(request)
        assert trace.logprobs == pytest.approx(values, abs=1e-5)
        assert [[t for t, _ in top] for top in trace.top] == [[t for t, _ in top] for top in tops]
        check(request, trace, K, dtype="float32")


def test_a_covered_last_token_without_its_own_value_or_outside_the_reads_rows_is_refused():
    read = ScoreRequest(ids=IDS, start=8)
    rows = trace_from_rows(read, v1_layout(NO_HIT), K)
    left_out = LOGITS[9].argsort(descending=True).tolist()[K + 3]
    request = ScoreRequest(ids=IDS[:10] + (left_out,), start=8)
    with pytest.raises(BadRead, match="no log-probability read"):
        covered_trace(request, read, rows, {}, dtype="float32")
    with pytest.raises(BadRead, match="above the last of the top entries"):  # it would have been listed
        covered_trace(request, read, rows, {left_out: -1e-3}, dtype="float32")
    for wrong in (ScoreRequest(ids=IDS[:9] + (IDS[9] + 1, IDS[10]), start=8), ScoreRequest(ids=IDS, start=7),
                  ScoreRequest(ids=IDS + (1,), start=8)):
        with pytest.raises(ValueError, match="does not cover"):
            covered_trace(wrong, read, rows, {}, dtype="float32")
    assert covered_trace(ScoreRequest(ids=IDS[:9], start=9), read, rows, {}, dtype="float32") == \
        TokenTrace(logprobs=(), top=())
