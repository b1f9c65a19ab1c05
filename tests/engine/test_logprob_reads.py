"""evalkit/engine/logprob_reads.py on prompt log-probabilities built as vLLM 0.32's two model runners build them.

The rows come from vLLM's own code where it runs on a CPU (the V1 sampler's ``compute_logprobs`` and
``gather_logprobs``, ``LogprobsTensors``, the output side's ``LogprobsProcessor``); V2's are recreated in torch,
the layout (which rows, in which order, when emitted) following the lines cited, and held to vLLM's own V2 code
run under Triton's interpreter in tests/engine/test_v2_kernels.py (where a preempted request's rows are vLLM's:
those of its first chunk are dropped with its state, which RESUMED's recreation here keeps; either is refused).
Each case is read by the same function the engine uses, and either gives the exact sum and greediness of a
reference computed from the logits, or raises BadRead: never a wrong number.
Run: pytest tests/engine/test_logprob_reads.py
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.sampler import Sampler

from evalkit.contracts import ScoreRequest
from evalkit.engine.logprob_reads import (BadRead, chunked, next_token_scores, read_next_token, read_path,
                                          scored_positions, summed)
from evalkit.engine.read_plan import PathRead

VOCAB = 40
IDS = (3, 17, 5, 22, 9, 31, 14, 8, 26, 11, 35, 2)  # distinct and never 0, the id of never-written rows
REQUEST = ScoreRequest(ids=IDS, start=8)  # context 8 tokens, continuation 4
LOGITS = torch.randn(len(IDS), VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # row h predicts ids[h+1]


def expected(request=REQUEST):
    table = LOGITS.log_softmax(-1)
    values = [table[p - 1, request.ids[p]].item() for p in range(max(request.start, 1), len(request.ids))]
    greedy = all(table[p - 1].argmax().item() == request.ids[p] for p in range(max(request.start, 1), len(request.ids)))
    return sum(values), greedy


def read_prompt_rows(request, flat, runner="v1", token_id_scores=None):
    """request scored from its own prompt rows as the engine reads it (vllm/prompt_logprobs.score_prompts: a path read with
    no next token; on V2 the values from ``prompt_token_id_logprobs``, asked from row start - 1). runner "v1" reads
    the rows alone, as the engine reads either runner's rows where vLLM has no fixed-id scores (0.23)."""
    read = PathRead(prompt=request.ids, start=scored_positions(request).start, asked=())
    rows, _ = read_path(read, token_ids_asked=runner == "v2", prompt_rows=flat, token_id_scores=token_id_scores,
                        next_token=None)
    return summed(rows)


def flat_prompt_logprobs(tensors: LogprobsTensors | None):
    """What reaches RequestOutput.prompt_logprobs: vLLM's LogprobsProcessor with flat_logprobs=True
    (vllm/v1/engine/logprobs.py from_new_request, _update_prompt_logprobs, pop_prompt_logprobs)."""
    request = SimpleNamespace(sampling_params=SamplingParams(prompt_logprobs=1, flat_logprobs=True, max_tokens=1))
    processor = LogprobsProcessor.from_new_request(None, request)
    if tensors is not None:
        processor._update_prompt_logprobs(tensors)
    return processor.pop_prompt_logprobs()


def v1_layout(steps, prompt_len=len(IDS), ids=IDS, logits=LOGITS):
    """vllm/v1/worker/gpu_model_runner.py _get_prompt_logprobs_dict (lines 5306-5413), the CPU build's runner:
    one LogprobsTensors.empty_cpu(prompt_len - 1, k + 1) per request (5342), then per scheduled step
    (num_computed_tokens, num_scheduled) the rows start_idx = num_computed_tokens on (5348-5361) are written
    through the V1 sampler (5388-5391) into chunk_slice (5394-5401). Rows no step writes are left as
    allocated: fresh pages, read here as zeros (the log-prob 0, is_greedy-true rows the issue saw)."""
    tensors = LogprobsTensors.empty_cpu(prompt_len - 1, 2)
    for t in tensors[:3]:
        t.zero_()
    tokens = torch.tensor(ids[:prompt_len])
    for computed, scheduled in steps:
        start_tok = computed + 1
        num_logits = min(scheduled, prompt_len - start_tok)
        if num_logits <= 0:
            continue
        scores = Sampler.compute_logprobs(logits[computed:computed + num_logits])
        token_ids, logprobs, ranks, *_ = Sampler.gather_logprobs(scores, 1, tokens[start_tok:start_tok + num_logits])
        chunk = slice(computed, computed + num_logits)
        tensors.logprob_token_ids[chunk].copy_(token_ids)
        tensors.logprobs[chunk].copy_(logprobs)
        tensors.selected_token_ranks[chunk].copy_(ranks)
    return flat_prompt_logprobs(tensors)


def v2_rows(computed, scheduled, prompt_len=len(IDS), ids=IDS, logits=LOGITS):
    """The rows of one step of vllm/v1/worker/gpu/sample/prompt_logprob.py compute_prompt_logprobs (120-222):
    one per computed position, each scoring the token after it (target_pos = num_computed_tokens + 1 + block,
    line 252), the token's own log-probability first, then the top-1 (compute_topk_scores; Triton there, torch
    here); the last prompt row dropped when the prompt ends in this step (lines 175-192)."""
    last = computed + scheduled
    positions = range(computed, last if last < prompt_len else prompt_len - 1)
    if not positions:
        return None
    logprobs = logits[list(positions)].log_softmax(-1)
    targets = torch.tensor([ids[p + 1] for p in positions])
    own = logprobs.gather(-1, targets[:, None])
    top = logprobs.max(-1)
    ranks = (logprobs > own).sum(-1) + 1
    return LogprobsTensors(logprob_token_ids=torch.stack([targets, top.indices], -1).to(torch.int32),
                           logprobs=torch.cat([own, top.values[:, None]], -1), selected_token_ranks=ranks)


def concatenated(rows):
    """The steps' rows as one LogprobsTensors, each field concatenated as the V2 runner merges a chunked prompt's
    rows (``torch.cat`` of each field in vLLM 0.23, ``LogprobsTensors.cat`` in 0.32: the same tensors)."""
    return LogprobsTensors(logprob_token_ids=torch.cat([r.logprob_token_ids for r in rows]),
                           logprobs=torch.cat([r.logprobs for r in rows]),
                           selected_token_ranks=torch.cat([r.selected_token_ranks for r in rows]))


def v2_layout(steps, prompt_len=len(IDS), ids=IDS, logits=LOGITS):
    """Every step's rows, kept while the prompt is chunked and concatenated when it ends (lines 208-222)."""
    rows = [r for r in (v2_rows(c, n, prompt_len, ids, logits) for c, n in steps) if r is not None]
    return flat_prompt_logprobs(concatenated(rows) if rows else None)


def v2_token_id_scores(steps, first_row, prompt_len=len(IDS), ids=IDS, logits=LOGITS):
    """compute_prompt_token_id_logprobs (lines 69-118) with prompt_logprob_token_ids = the request's own tokens
    from prompt_logprob_start = first_row: None when the first prefill starts past first_row (lines 92-98, a
    prefix-cache hit into the scored rows), else rows first_row .. prompt_len - 2."""
    scores = None
    for computed, scheduled in steps:
        if scores is None:
            if computed > first_row:
                return None
            scores = np.full((prompt_len - 1 - first_row, 1), np.nan, dtype=np.float32)
        lo, hi = max(first_row, computed), min(computed + scheduled, prompt_len - 1)
        for row in range(lo, hi):
            scores[row - first_row, 0] = logits[row].log_softmax(-1)[ids[row + 1]].item()
    return scores


# steps as (num_computed_tokens when scheduled, tokens scheduled)
NO_HIT = [(0, 12)]
HIT_IN_CONTEXT = [(4, 8)]  # 4 tokens from the prefix cache, all before the continuation (start 8)
HIT_INTO_CONTINUATION = [(10, 2)]  # the cache reached two scored positions
CHUNKED = [(0, 5), (5, 4), (9, 3)]
RESUMED = [(2, 3), (9, 3)]  # preempted after 5 tokens; resumed from a larger cache hit (9): rows 5-8 never computed


@pytest.mark.parametrize("steps", [NO_HIT, HIT_IN_CONTEXT, CHUNKED], ids=["no hit", "hit in context", "chunked"])
@pytest.mark.parametrize("layout", [v1_layout, v2_layout], ids=["V1", "V2"])
def test_rows_that_answer_the_request_give_the_exact_sum(layout, steps):
    scored = read_prompt_rows(REQUEST, layout(steps))
    total, greedy = expected()
    assert scored.logprob == pytest.approx(total, abs=1e-5) and scored.is_greedy == greedy


@pytest.mark.parametrize("steps", [HIT_INTO_CONTINUATION, RESUMED], ids=["hit into continuation", "resumed"])
@pytest.mark.parametrize("layout", [v1_layout, v2_layout], ids=["V1", "V2"])
def test_rows_never_computed_or_shifted_are_refused(layout, steps):
    with pytest.raises(BadRead):
        read_prompt_rows(REQUEST, layout(steps))


def test_the_old_read_by_absolute_position_was_wrong_on_v2_after_a_cache_hit():
    """What evalkit read before: flat.start_indices[position] on V2's rows after a hit inside the context
    takes other positions' values (or runs off the end), while the offset read is exact."""
    flat = v2_layout(HIT_IN_CONTEXT)
    absolute = [flat.logprobs[flat.start_indices[p]] for p in range(8, 12) if p < len(flat.start_indices)]
    assert len(absolute) < 4 or sum(absolute) != pytest.approx(expected()[0], abs=1e-5)
    assert read_prompt_rows(REQUEST, flat).logprob == pytest.approx(expected()[0], abs=1e-5)


@pytest.mark.parametrize("steps", [NO_HIT, HIT_IN_CONTEXT, CHUNKED, [(7, 5)]])
def test_v2_token_id_scores_read_by_offset(steps):
    first_row = REQUEST.start - 1
    scores = v2_token_id_scores(steps, first_row)
    scored = read_prompt_rows(REQUEST, v2_layout(steps), "v2", scores)
    assert scored.logprob == pytest.approx(expected()[0], abs=1e-5) and scored.is_greedy == expected()[1]


def test_v2_token_id_scores_dropped_or_misshapen_are_refused():
    first_row = REQUEST.start - 1
    assert v2_token_id_scores(HIT_INTO_CONTINUATION, first_row) is None
    rows = v2_layout(NO_HIT)  # prompt rows that pass their check; the token-id scores beside them do not
    with pytest.raises(BadRead, match="asked for 4 rows"):
        read_prompt_rows(REQUEST, rows, "v2", None)
    with pytest.raises(BadRead):
        read_prompt_rows(REQUEST, rows, "v2", v2_token_id_scores(NO_HIT, 0))
    with pytest.raises(BadRead, match="not a finite value"):  # a row no chunk wrote
        read_prompt_rows(REQUEST, rows, "v2", v2_token_id_scores(RESUMED[:1], first_row))


def test_a_whole_prompt_scored_from_position_one():
    whole = ScoreRequest(ids=IDS, start=0)
    for flat in (v1_layout(NO_HIT), v2_layout(CHUNKED)):
        assert read_prompt_rows(whole, flat).logprob == pytest.approx(expected(whole)[0], abs=1e-5)
    with pytest.raises(BadRead):
        read_prompt_rows(whole, v2_layout(HIT_IN_CONTEXT))
    with pytest.raises(BadRead, match="no prompt log-probabilities"):
        read_prompt_rows(whole, None)


def sample_logprobs(steps):
    """Generated-token log-probabilities as vllm/v1/engine/logprobs.py _update_sample_logprobs appends them:
    the sampled token first, then the asked ids (append_logprobs_for_next_position)."""
    flat = create_sample_logprobs(True)
    for ids, values in steps:
        append_logprobs_for_next_position(flat, ids, values, [None] * len(ids), 1, len(ids) - 1)
    return flat


def test_next_token_entries_must_hold_every_asked_id_from_one_step():
    context = IDS[:3]
    flat = sample_logprobs([([7, 5, 7, 9], [-0.1, -2.0, -0.1, -3.5])])
    entries = read_next_token(context, [5, 7, 9], flat)
    assert entries == {7: -0.1, 5: -2.0, 9: -3.5}
    scored = next_token_scores([ScoreRequest(ids=(*context, 5), start=3), ScoreRequest(ids=(*context, 7), start=3)],
                               {context: entries})
    assert [(s.logprob, s.is_greedy) for s in scored] == [(-2.0, False), (-0.1, True)]
    with pytest.raises(BadRead, match="lack the asked ids"):
        read_next_token(context, [5, 7, 9, 11], flat)
    with pytest.raises(BadRead, match="2 generated steps"):
        read_next_token(context, [5], sample_logprobs([([5, 5], [-1.0, -1.0])] * 2))
    with pytest.raises(BadRead, match="not a finite value"):
        read_next_token(context, [5], sample_logprobs([([5, 5], [float("nan"), float("nan")])]))


def test_more_than_128_ids_go_in_several_requests():
    parts = chunked(list(range(300)), 128)
    assert [len(p) for p in parts] == [128, 128, 44] and sum(parts, []) == list(range(300))


def test_ids_reads_are_split_per_read_and_answered_in_the_order_asked():
    """Engine.read_ids' plan: each read's distinct ids in chunks of at most 128, none for a read that asks none;
    the answer in the order asked, a repeated id repeated; an empty context refused in one line."""
    from evalkit.contracts import IdsRead
    from evalkit.engine.logprob_reads import id_asks, id_values

    reads = [IdsRead(context=(1, 2), ids=tuple(range(299, -1, -1))), IdsRead(context=(1,), ids=()),
             IdsRead(context=(3,), ids=(9, 4, 9))]
    asks = id_asks(reads, 128)
    assert [(n, len(ids)) for n, ids in asks] == [(0, 128), (0, 128), (0, 44), (2, 2)] and asks[-1] == (2, [9, 4])
    entries = [{t: -t / 100 for t in range(300)}, {}, {4: -0.4, 9: -0.9, 7: -0.05}]  # 7: the greedy token
    assert id_values(reads, entries) == [tuple(-t / 100 for t in range(299, -1, -1)), (), (-0.9, -0.4, -0.9)]
    assert id_asks([IdsRead(context=(), ids=())], 128) == []
    with pytest.raises(ValueError, match=r"^read_ids: read 1 asks for 2 ids after an empty context") as error:
        id_asks([reads[0], IdsRead(context=(), ids=(5, 6))], 128)
    assert "\n" not in str(error.value)


def test_a_continuation_is_chained_from_one_step_per_token_shared_between_choices():
    from evalkit.contracts import Scored
    from evalkit.engine.logprob_reads import chained_score, token_steps

    a, b = ScoreRequest(ids=(1, 5, 6, 7), start=2), ScoreRequest(ids=(1, 5, 6, 8), start=2)
    steps, unique = token_steps([a, b])
    assert steps[a] == [ScoreRequest(ids=(1, 5, 6), start=2), ScoreRequest(ids=(1, 5, 6, 7), start=3)]
    assert unique == [steps[a][0], steps[a][1], steps[b][1]]  # the shared first token is read once
    found = {unique[0]: Scored(-1.0, True), unique[1]: Scored(-0.5, False), unique[2]: Scored(-0.25, True)}
    assert chained_score(steps[a], found) == Scored(-1.5, False)
    assert chained_score(steps[b], found) == Scored(-1.25, True)
    assert chained_score(steps[b], {**found, unique[2]: None}) is None


def test_numeric_choices_are_read_with_one_request_per_last_context():
    """Four two-digit answers behind one question (" 34", " 30", " 25", " 24", each a space and two digits):
    two path reads, each prompt's rows giving the space and the first digit, its next-token read the last
    digits; the step of the space is in both (either answers it)."""
    from evalkit.engine.logprob_reads import token_steps
    from evalkit.engine.vllm.chained import plan_paths

    question = (3, 17, 5)
    choices = [(42, 30, 31), (42, 30, 32), (42, 33, 34), (42, 33, 35)]
    requests = [ScoreRequest(ids=question + c, start=3) for c in choices]
    reads, rest = plan_paths(requests)
    assert reads == [PathRead(prompt=question + (42, 30), start=3, asked=(31, 32)),
                     PathRead(prompt=question + (42, 33), start=3, asked=(34, 35))]
    assert rest == []
    _, unique = token_steps(requests)
    assert set(unique) <= {s for r in reads for s in r.steps()}


@pytest.mark.parametrize("seed", range(20))
def test_every_step_of_any_choices_is_read_by_a_path_or_left_for_a_next_token_read(seed):
    """Random choices of 2 to 5 tokens over a small vocabulary behind two contexts, some choices prefixes of
    others and contexts of different lengths: each step of token_steps is answered by a path read or left
    over, never lost; there are never more reads than distinct last contexts."""
    import random

    from evalkit.engine.logprob_reads import token_steps
    from evalkit.engine.vllm.chained import plan_paths

    rng = random.Random(seed)
    contexts = [(1, 2, 3), (1, 2, 3, 4, 5)]
    requests = list(dict.fromkeys(
        ScoreRequest(ids=c + tuple(rng.choice((6, 7, 8)) for _ in range(rng.randint(2, 5))), start=len(c))
        for c in contexts for _ in range(rng.randint(1, 8))))
    reads, rest = plan_paths(requests)
    _, unique = token_steps(requests)
    covered = {s for r in reads for s in r.steps()} | set(rest)
    assert set(unique) <= covered
    assert len(reads) <= len({r.ids[:-1] for r in requests})
    for read in reads:  # every row a read asks for lies on its prompt, after its first scored position
        assert read.start is None or 1 <= read.start < len(read.prompt)


@pytest.mark.parametrize("steps", [[(0, 11)], [(4, 7)], [(0, 5), (5, 6)]], ids=["no hit", "hit in context", "chunked"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_path_read_gives_each_step_exactly_in_both_layouts(runner, steps):
    """The prompt IDS[:11] read from position 8, and the next token after it for two ids (IDS[11] and another):
    built as each runner builds the rows (and V2's fixed-id scores), each step's value and greediness equal a
    reference from the logits."""
    from evalkit.engine.logprob_reads import path_scores, prompt_row_values, token_id_values

    read = PathRead(prompt=IDS[:11], start=8, asked=(IDS[11], 4))
    table = LOGITS.log_softmax(-1)
    request = ScoreRequest(ids=read.prompt, start=read.start)
    if runner == "v1":
        rows = prompt_row_values(request, v1_layout(steps, prompt_len=11))
    else:
        greedy = [g for _, g in prompt_row_values(request, v2_layout(steps, prompt_len=11))]
        values = token_id_values(request, v2_token_id_scores(steps, read.start - 1, prompt_len=11), read.start - 1)
        rows = list(zip(values, greedy))
    top = table[10].argmax().item()
    entries = read_next_token(read.prompt, read.asked, sample_logprobs(
        [([top, *read.asked], [table[10, t].item() for t in (top, *read.asked)])]))
    scored = path_scores(read, rows, entries)
    for step, value in scored.items():
        row = table[step.start - 1]
        assert value.logprob == pytest.approx(row[step.ids[-1]].item(), abs=1e-5)
        assert value.is_greedy == (row.argmax().item() == step.ids[-1])
    assert len(scored) == 3 + 2


@pytest.mark.parametrize("layout", [v1_layout, v2_layout], ids=["V1", "V2"])
def test_a_path_read_whose_rows_were_never_computed_is_refused(layout):
    from evalkit.engine.logprob_reads import prompt_row_values

    with pytest.raises(BadRead):
        prompt_row_values(ScoreRequest(ids=IDS[:11], start=8), layout([(9, 2)], prompt_len=11))


def test_the_whole_blocks_before_each_reads_rows_are_prefilled_once():
    """Rows from position 8 need the logits of position 7, which must be computed: with 4-token blocks one
    whole block (4 tokens) may come from the cache; rows from position 9 leave two (8 tokens); a read whose rows
    start inside the first block gets none, and a read with no rows none."""
    from evalkit.engine.vllm.path_reads import whole_blocks_before_rows

    reads = [PathRead(prompt=IDS, start=8, asked=()), PathRead(prompt=IDS, start=9, asked=(4,)),
             PathRead(prompt=IDS, start=3, asked=()), PathRead(prompt=IDS[:6], start=None, asked=(4,))]
    assert whole_blocks_before_rows(reads, 4) == [IDS[:4], IDS[:8]]
    assert whole_blocks_before_rows(reads, 32) == []


def test_a_row_whose_token_is_above_its_top_1_is_refused():
    """The rows carry the token's own log-probability and the row's top-1 (vLLM's compute_topk_scores): a token
    above the top-1 is no row vLLM computes, and is refused; one within TIE of it is a tie, read as greedy."""
    from evalkit.engine.logprob_reads import TIE, prompt_row_values

    def with_row(row, own, top):
        tensors = v2_rows(0, len(IDS))
        tensors.logprobs[row, 0], tensors.logprobs[row, 1] = own, top
        tensors.logprob_token_ids[row, 1] = (IDS[row + 1] + 1) % VOCAB  # a top-1 that is another token
        return flat_prompt_logprobs(tensors)

    request = ScoreRequest(ids=IDS, start=8)
    with pytest.raises(BadRead, match="above the row's top-1"):
        prompt_row_values(request, with_row(9, -0.5, -2.0))
    values = prompt_row_values(request, with_row(9, -2.0 + TIE / 2, -2.0))
    assert values[2] == (pytest.approx(-2.0), True)
    assert prompt_row_values(request, with_row(9, -2.5, -2.0))[2] == (-2.5, False)
    with pytest.raises(BadRead, match="above the row's top-1"):  # V2: the same check on the prompt rows read there
        read_prompt_rows(request, with_row(8, -0.1, -0.3), "v2", v2_token_id_scores(NO_HIT, 7))


def test_an_empty_continuation_is_answered_without_a_read():
    """start == len(ids): nothing to score, (0.0, True) as lm-eval's sum over no tokens; never planned as a read
    (V2 would be sent prompt_logprob_token_ids=[], which vLLM refuses)."""
    from evalkit.engine.logprob_reads import NOTHING_SCORED, unscored

    requests = [ScoreRequest(ids=IDS, start=len(IDS)), ScoreRequest(ids=IDS, start=8), ScoreRequest(ids=IDS[:1], start=0)]
    assert unscored(requests) == [0, 2]
    assert (NOTHING_SCORED.logprob, NOTHING_SCORED.is_greedy) == (0.0, True)


def test_more_than_128_asked_ids_are_split_into_reads_of_the_same_prompt():
    """200 two-token choices " is " + word behind one question: one path read asking 200 last tokens, split
    into reads of at most 128 ids; the first keeps the rows; every step is still answered."""
    from evalkit.engine.logprob_reads import token_steps
    from evalkit.engine.read_plan import MAX_LOGPROB_TOKEN_IDS
    from evalkit.engine.vllm.chained import plan_paths
    from evalkit.engine.vllm.path_reads import split_asked

    question, is_ = (3, 17, 5), 9
    requests = [ScoreRequest(ids=question + (is_, 1000 + w), start=3) for w in range(200)]
    reads, rest = plan_paths(requests)
    assert len(reads) == 1 and len(reads[0].asked) == 200 and not rest
    split = split_asked(reads)
    assert [len(r.asked) for r in split] == [128, 72] and max(len(r.asked) for r in split) <= MAX_LOGPROB_TOKEN_IDS
    assert [r.start for r in split] == [3, None]
    _, unique = token_steps(requests)
    assert set(unique) == {s for r in split for s in r.steps()}


# --- the plan against vLLM's prefix cache (vllm/path_reads.block_safe) ---

def logits_of(ids):
    """Logits of a model whose row h depends on the whole prefix ids[:h + 1] (different texts, different rows)."""
    rows = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(hash(tuple(ids[:h + 1])) % 2**31)) * 3
            for h in range(len(ids))]
    return torch.stack(rows)


# how each runner's answers are read: "v2 rows alone" is V2's layout read without its fixed-id scores, as the
# engine reads it on a vLLM that has none (0.23: no prompt_logprob_start; vllm/launch.token_id_scores)
RUNNERS = ["v1", "v2", "v2 rows alone"]


def sent_as_vllm_does(reads, warm, block, runner):
    """Each read answered as vLLM 0.32 answers it in one call, in order, the warm prefixes first: its cache hit
    the longest run of whole blocks that a request before it computed, never its last token
    (kv_cache_manager.get_computed_blocks: max_cache_hit_length = num_tokens - 1); its rows laid out by the
    runner for one step from that hit; then its whole blocks cached. What the engine reads of it (on V1 a hit
    that reached the first row is refused, as vllm/path_reads.send_reads refuses it): {step: Scored}, and the
    reads refused."""
    from evalkit.engine.logprob_reads import path_scores

    cached, found, refused = set(), {}, []

    def cache(prompt):
        cached.update(prompt[:end] for end in range(block, len(prompt) + 1, block))

    for prompt in warm:
        cache(prompt)
    for read in reads:
        hit = 0
        while hit + block <= len(read.prompt) - 1 and read.prompt[:hit + block] in cached:
            hit += block
        logits, steps, n = logits_of(read.prompt), [(hit, len(read.prompt) - hit)], len(read.prompt)
        cache(read.prompt)
        table = logits.log_softmax(-1)
        top = table[-1].argmax().item()
        next_token = sample_logprobs([([top, *read.asked], [table[-1, t].item() for t in (top, *read.asked)])])
        layout = v1_layout if runner == "v1" else v2_layout
        rows = layout(steps, n, read.prompt, logits) if read.start is not None else None
        scores = v2_token_id_scores(steps, read.start - 1, n, read.prompt, logits) \
            if read.start is not None and runner == "v2" else None
        try:
            if runner == "v1" and read.start is not None and hit >= read.start:
                raise BadRead("V1 rows the cache covered")
            found.update(path_scores(read, *read_path(read, token_ids_asked=runner == "v2", prompt_rows=rows,
                                                      token_id_scores=scores, next_token=next_token)))
        except BadRead:
            refused.append(read)
    return found, refused


def planned(requests, block, others=(), cut=True):
    """The reads the engine sends for these continuations, warm prefixes first (vllm/path_reads.send_reads)."""
    from evalkit.engine.vllm.chained import plan_paths
    from evalkit.engine.vllm.path_reads import block_safe, split_asked, whole_blocks_before_rows

    reads, _ = plan_paths(requests)
    sent = split_asked(block_safe(reads, block, others) if cut else reads)
    return reads, sent, whole_blocks_before_rows(sent, block)


def exact(found, steps):
    """Every step found, each equal to the reference from its logits."""
    for step in steps:
        row = logits_of(step.ids)[step.start - 1].log_softmax(-1)
        assert found[step].logprob == pytest.approx(row[step.ids[-1]].item(), abs=1e-5)
        assert found[step].is_greedy == (row.argmax().item() == step.ids[-1])


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_context_that_ends_on_a_block_boundary_is_read_once_not_twice(runner):
    """The one-read-in-sixteen case of the GPU runner (block 16): a context whose length is a multiple of the
    block, so its last block is whole and the second choice's read finds it cached, a hit past the read's first
    row's logits (V2 drops the token-id scores, V1 never writes the rows). Cut, no read is refused and every
    step is exact; as planned before, the second read was refused."""
    from evalkit.engine.logprob_reads import token_steps

    block, context = 4, (3, 17, 5, 22, 9, 31, 14, 8)
    requests = [ScoreRequest(ids=context + c, start=8) for c in [(26, 11, 35), (12, 2), (13, 6, 7)]]
    reads, sent, warm = planned(requests, block, cut=False)
    assert sent_as_vllm_does(sent, warm, block, runner)[1]
    _, sent, warm = planned(requests, block)
    found, refused = sent_as_vllm_does(sent, warm, block, runner)
    assert refused == []
    exact(found, token_steps(requests)[1])


@pytest.mark.parametrize("runner", RUNNERS)
def test_choices_that_share_leading_tokens_are_read_once_each(runner):
    """Long choices (the shared-prefix path) sharing their first five tokens past a block boundary: the second
    one's read found the first one's blocks cached into its continuation. Cut, the shared part is read once, in
    reads that end inside their first row's block, and nothing is refused."""
    from evalkit.engine.read_plan import PathRead
    from evalkit.engine.vllm.path_reads import block_safe, whole_blocks_before_rows

    block, context, shared = 4, (3, 17, 5, 22, 9, 31), (14, 8, 26, 11, 35)
    requests = [ScoreRequest(ids=context + shared + tail, start=6) for tail in [(2, 4, 6), (12, 13), (15, 16, 18, 19)]]
    reads = [PathRead(prompt=r.ids, start=r.start, asked=()) for r in requests]  # vllm/prompt_logprobs.score_prompts
    assert sent_as_vllm_does(reads, whole_blocks_before_rows(reads, block), block, runner)[1]
    cut = block_safe(reads, block)
    found, refused = sent_as_vllm_does(cut, whole_blocks_before_rows(cut, block), block, runner)
    assert refused == []
    exact(found, [s for r in reads for s in r.steps()])


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("runner", RUNNERS)
def test_no_plan_of_random_choices_is_refused_on_either_runner(runner, seed):
    """Random questions with random choices (1 to 7 tokens over a small vocabulary, so they share leading
    tokens), contexts of any length, blocks of 2 to 5 tokens, the requests in random order: the chained plan and
    the prompt reads of the long choices, cut, are never refused and give every step exactly."""
    import random

    from evalkit.engine.logprob_reads import token_steps
    from evalkit.engine.read_plan import PathRead
    from evalkit.engine.vllm.chained import plan_paths
    from evalkit.engine.vllm.path_reads import block_safe, whole_blocks_before_rows

    rng = random.Random(seed)
    block = rng.randint(2, 5)
    requests = []
    for _ in range(rng.randint(1, 3)):
        context = tuple(rng.randint(1, VOCAB - 1) for _ in range(rng.randint(1, 12)))
        requests += [ScoreRequest(ids=context + tuple(rng.choice((6, 7, 8)) for _ in range(rng.randint(2, 7))),
                                  start=len(context)) for _ in range(rng.randint(1, 6))]
    requests = list(dict.fromkeys(requests))
    rng.shuffle(requests)
    chain = [r for r in requests if len(r.ids) - r.start <= 4]
    long = [r for r in requests if len(r.ids) - r.start > 4]
    _, sent, warm = planned(chain, block, others=[r.ids for r in long])
    found, refused = sent_as_vllm_does(sent, warm, block, runner)
    assert refused == []
    one_token = set(plan_paths(chain)[1])  # steps left for next-token reads
    exact(found, [s for s in token_steps(chain)[1] if s not in one_token])
    reads = [PathRead(prompt=r.ids, start=r.start, asked=()) for r in long]
    cut = block_safe(reads, block, [r.ids[:-1] for r in chain])
    found, refused = sent_as_vllm_does(cut, whole_blocks_before_rows(cut, block), block, runner)
    assert refused == []
    exact(found, [s for r in reads for s in r.steps()])
