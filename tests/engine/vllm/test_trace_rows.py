"""evalkit/engine/vllm/trace_rows.py (and the planning of vllm/trace_from_cache.py) on top-k log-probabilities built
as vLLM 0.32 builds them: prompt rows with ``prompt_logprobs=k`` in both model runners' layouts, and one generated
step with ``logprobs=k``. No engine is started.

V1's rows come from vLLM's own code (the V1 sampler's ``compute_logprobs`` and ``gather_logprobs`` written into
``LogprobsTensors.empty_cpu`` as ``gpu_model_runner._get_prompt_logprobs_dict`` writes them, then the output
side's ``LogprobsProcessor``); V2's Triton kernels do not run on a CPU, so their arithmetic is torch's while the
layout follows ``vllm/v1/worker/gpu/sample/prompt_logprob.py`` (``compute_prompt_logprobs``: one row per computed
position, the target then ``compute_topk_scores``' top-k, the last prompt row dropped). Each case either gives
the exact trace of a reference computed from the logits, or raises BadRead: never a wrong one.
Run: pytest tests/engine/vllm/test_trace_rows.py
"""

from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.sampler import Sampler

from evalkit.contracts import ScoreRequest
from evalkit.engine.logprob_reads import BadRead
from evalkit.engine.vllm.trace_from_cache import plan_rows
from evalkit.engine.vllm.trace_rows import next_token_trace, next_top, trace_from_rows, unlisted
from evalkit.harness.divergence_traces import check
from tests.engine.test_logprob_reads import concatenated

K = 5
VOCAB = 40
IDS = (3, 17, 5, 22, 9, 31, 14, 8, 26, 11, 35, 2)
REQUEST = ScoreRequest(ids=IDS, start=8)
LOGITS = torch.randn(len(IDS), VOCAB, generator=torch.Generator().manual_seed(1)) * 3  # row h predicts ids[h+1]


def reference(request=REQUEST, k=K):
    """The trace computed straight from the logits: each scored token's value and the top-k, best first."""
    table = LOGITS.log_softmax(-1)
    values, tops = [], []
    for p in range(max(request.start, 1), len(request.ids)):
        best = table[p - 1].topk(k)
        values.append(table[p - 1, request.ids[p]].item())
        tops.append(tuple(zip(best.indices.tolist(), best.values.tolist())))
    return values, tops


def flat(tensors, k=K):
    """What reaches RequestOutput.prompt_logprobs with flat_logprobs=True (vllm/v1/engine/logprobs.py)."""
    request = SimpleNamespace(sampling_params=SamplingParams(prompt_logprobs=k, flat_logprobs=True, max_tokens=1))
    processor = LogprobsProcessor.from_new_request(None, request)
    if tensors is not None:
        processor._update_prompt_logprobs(tensors)
    return processor.pop_prompt_logprobs()


def v1_layout(steps, k=K):
    """gpu_model_runner._get_prompt_logprobs_dict: empty_cpu(len - 1, k + 1), rows written from
    num_computed_tokens on per step; rows no step writes stay as allocated (zeros here)."""
    tensors = LogprobsTensors.empty_cpu(len(IDS) - 1, k + 1)
    for t in tensors[:3]:
        t.zero_()
    tokens = torch.tensor(IDS)
    for computed, scheduled in steps:
        n = min(scheduled, len(IDS) - computed - 1)
        if n <= 0:
            continue
        scores = Sampler.compute_logprobs(LOGITS[computed:computed + n])
        token_ids, logprobs, ranks, *_ = Sampler.gather_logprobs(scores, k, tokens[computed + 1:computed + 1 + n])
        tensors.logprob_token_ids[computed:computed + n].copy_(token_ids)
        tensors.logprobs[computed:computed + n].copy_(logprobs)
        tensors.selected_token_ranks[computed:computed + n].copy_(ranks)
    return flat(tensors, k)


def v2_layout(steps, k=K):
    """compute_prompt_logprobs: per step one row per computed position (the target, then the top-k), the last
    prompt row dropped when the prompt ends, the steps' rows concatenated."""
    rows = []
    for computed, scheduled in steps:
        last = computed + scheduled
        positions = list(range(computed, last if last < len(IDS) else len(IDS) - 1))
        if not positions:
            continue
        table = LOGITS[positions].log_softmax(-1)
        targets = torch.tensor([IDS[p + 1] for p in positions])
        top = table.topk(k)
        ids = torch.cat([targets[:, None], top.indices], -1)
        rows.append(LogprobsTensors(logprob_token_ids=ids.to(torch.int32), logprobs=table.gather(-1, ids),
                                    selected_token_ranks=(table > table.gather(-1, targets[:, None])).sum(-1) + 1))
    return flat(concatenated(rows) if rows else None, k)


NO_HIT = [(0, 12)]
HIT_BEFORE_ROWS = [(4, 8)]  # the warm blocks: cached up to before the position the first row needs
HIT_INTO_ROWS = [(10, 2)]
CHUNKED = [(0, 5), (5, 4), (9, 3)]


@pytest.mark.parametrize("steps", [NO_HIT, HIT_BEFORE_ROWS, CHUNKED, [(7, 5)]],
                         ids=["no hit", "hit before rows", "chunked", "hit up to the row before"])
@pytest.mark.parametrize("layout", [v1_layout, v2_layout], ids=["V1", "V2"])
def test_prompt_rows_give_the_exact_trace_in_both_layouts(layout, steps):
    trace = trace_from_rows(REQUEST, layout(steps), K)
    values, tops = reference()
    assert trace.logprobs == pytest.approx(values, abs=1e-5)
    assert [[t for t, _ in top] for top in trace.top] == [[t for t, _ in top] for top in tops]
    assert [v for top in trace.top for _, v in top] == pytest.approx([v for top in tops for _, v in top], abs=1e-5)
    check(REQUEST, trace, K, dtype="float32")  # and the harness's own check passes it


def test_v2_rows_after_a_hit_into_the_rows_are_refused():
    """V2 leaves out the rows its cache hit skipped: too few rows, never a shifted read."""
    with pytest.raises(BadRead, match="prompt rows for a 12-token prompt"):
        trace_from_rows(REQUEST, v2_layout(HIT_INTO_ROWS), K)


def test_v1_rows_left_unwritten_are_refused():
    """V1 keeps a row per position; those its cache hit skipped hold whatever was allocated (zeros): not the
    request's token, so refused (the engine also resends any read whose num_cached_tokens reached a row)."""
    with pytest.raises(BadRead):
        trace_from_rows(REQUEST, v1_layout(HIT_INTO_ROWS), K)


def test_a_whole_prompt_is_traced_from_position_one():
    whole = ScoreRequest(ids=IDS, start=0)
    trace = trace_from_rows(whole, v1_layout(NO_HIT), K)
    assert len(trace.logprobs) == len(IDS) - 1
    assert trace.logprobs == pytest.approx(reference(whole)[0], abs=1e-5)


def test_rows_of_another_request_or_another_k_are_refused():
    shifted = ScoreRequest(ids=IDS[:-1] + (IDS[-1] + 1,), start=8)
    with pytest.raises(BadRead, match="is for token"):
        trace_from_rows(shifted, v1_layout(NO_HIT), K)
    with pytest.raises(BadRead, match="1 to 3 top ones"):
        trace_from_rows(REQUEST, v1_layout(NO_HIT), 3)
    with pytest.raises(BadRead, match="no prompt log-probabilities"):
        trace_from_rows(REQUEST, None, K)


def rows(entries):
    """A FlatLogprobs of rows given as [(target, value, target rank), [(id, value), ...]] as vLLM appends them."""
    result = create_sample_logprobs(True)
    for (target, value, rank), top in entries:
        append_logprobs_for_next_position(result, [target, *(t for t, _ in top)], [value, *(v for _, v in top)],
                                          [None] * (len(top) + 1), rank, len(top))
    return result


@pytest.mark.parametrize("top, why", [
    ([(7, -0.5), (7, -0.9)], "repeats"),
    ([(7, -0.9), (8, -0.5)], "not best first"),
    ([(7, -0.5), (8, float("nan"))], "not a finite value"),
    ([(7, -0.5), (8, 0.5)], "not a finite value"),
])
def test_a_bad_top_list_is_refused(top, why):
    with pytest.raises(BadRead, match=why):
        next_top(rows([((7, -0.5, 1), top)]), K)


def test_a_target_that_disagrees_with_its_top_entries_is_refused():
    with pytest.raises(BadRead, match="among its top entries"):  # listed with another value
        next_top(rows([((7, -0.5, 1), [(7, -0.4), (8, -1.5)])]), K)
    with pytest.raises(BadRead, match="yet leaves it out"):  # above the last entry, yet not listed
        next_top(rows([((9, -0.6, 2), [(7, -0.5), (8, -1.5)])]), K)
    with pytest.raises(BadRead, match="below its top-1"):  # a greedy step that did not sample its best
        next_top(rows([((8, -1.5, 2), [(7, -0.5), (8, -1.5)])]), K)
    with pytest.raises(BadRead, match="2 generated steps"):
        next_top(rows([((7, -0.5, 1), [(7, -0.5)])] * 2), K)


def test_a_one_token_trace_takes_its_value_from_the_top_or_from_its_own_read():
    context = IDS[:3]
    top = next_top(rows([((7, -0.5, 1), [(7, -0.5), (8, -1.5), (9, -2.0)])]), K)
    listed, left_out = ScoreRequest(ids=(*context, 8), start=3), ScoreRequest(ids=(*context, 30), start=3)
    assert unlisted([listed, left_out], {context: top}) == [left_out]
    assert next_token_trace(listed, top, {}, dtype="float32").logprobs == (-1.5,)
    trace = next_token_trace(left_out, top, {30: -4.25}, dtype="float32")
    assert trace.logprobs == (-4.25,) and trace.top == (top,)
    check(left_out, trace, K, dtype="float32")
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(BadRead, match="above the last of the top entries"):  # it would have been listed
            next_token_trace(left_out, top, {30: -0.6}, dtype=dtype)
        with pytest.raises(BadRead, match="no log-probability read"):
            next_token_trace(left_out, top, {}, dtype=dtype)
    # the text token and the top list come from two calls: in bfloat16 a rounding of the logits above the last
    # entry is noise (up to 1 nat: 4 steps of bfloat16 below a logit of 64); sent again in one call beyond it
    assert next_token_trace(left_out, top, {30: -1.01}, dtype="bfloat16").logprobs == (-1.01,)
    with pytest.raises(BadRead, match=r"by more than 0.0001 nats between two engine calls \(4 rounding "
                                      r"steps of float32 logits below 64\)"):
        next_token_trace(left_out, top, {30: -1.99}, dtype="float32")


def test_row_reads_read_the_cache_unsalted_where_no_hit_can_reach_their_rows_else_share_a_salt():
    """Block 4, choices behind a 6-token context. A prompt whose last whole block before its last token starts
    before its first row (d: 8 tokens, blocks up to 4) reads the cache unsalted, after its context's first
    block warmed unsalted. The others warm that block under the call's salt; a choice that shares 8 tokens
    (two whole blocks, past the position before its first row at 6) with another is sent under a salt of its
    own; one that shares the context only cannot be hit past its rows."""
    context = (1, 2, 3, 4, 5, 6)
    a = ScoreRequest(ids=context + (7, 8, 9, 10), start=6)
    b = ScoreRequest(ids=context + (7, 8, 9, 11), start=6)  # shares 9 tokens with a: both alone
    c = ScoreRequest(ids=context + (12, 13, 14), start=6)  # shares the context only
    d = ScoreRequest(ids=context + (12, 15), start=6)  # 8 tokens: a hit stops at 4
    reads = plan_rows([a, b, c, d], block=4, salt="s")
    assert [(r.salt, r.warm) for r in reads] == [("s.0", 4), ("s.1", 4), ("s", 4), (None, 4)]
    whole = ScoreRequest(ids=(1, 2, 3, 4, 5, 6), start=0)  # rows from position 1: salted, nothing to warm
    assert [(r.salt, r.warm) for r in plan_rows([whole], block=4, salt="s")] == [("s", 0)]
    assert plan_rows([ScoreRequest(ids=(1, 2, 3), start=0)], block=4, salt="s")[0].salt is None
