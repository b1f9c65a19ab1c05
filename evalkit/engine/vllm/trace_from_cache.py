"""Token traces on vLLM (each scored token's log-probability and the top-k beside it, for the divergence record),
read at about what fast scoring costs: from the prefix cache, computing only what a row needs.

* **One-token continuations** (``next_token.takes``): the row is the next-token distribution after the context,
  which vLLM never takes from the cache (``kv_cache_manager.get_computed_blocks``: a hit stops before the
  prompt's last token). Each distinct context is read once with ``logprobs=k``, reading the cache the scoring
  pass filled; a text token outside its top-k is read in a second call with ``logprob_token_ids``. The two never
  share a call: vLLM 0.32's V1 sampler gives the whole batch the ``logprob_token_ids`` columns when any request
  asks for them (``vllm/v1/sample/sampler.py``: "prefer logprob_token_ids").
* **The rest** (longer continuations, rolling windows, greedy outputs after their prompts): prompt rows
  (``prompt_logprobs=k``, both runners compute a row at every position they compute) from the request's first
  scored position on, of as few prompts as cover the requests (``covering_reads.covering_reads``: choices that end
  after one context, or after one that another choice extends, share one prompt's rows; a last token that row
  leaves out of its top-k is read with the one-token ones' ``logprob_token_ids``). On evalkit_bench_mc (120
  choices of 2 or 3 tokens behind ~250-token contexts) that is 63 reads where one per choice took 120, each
  computing its question's tail past the last cached whole block with 20-entry rows: 4,259 tokens computed,
  2,770 now, against 2,707 for the scoring paths (``benchmarks/trace_cost.py``). The whole blocks before each
  read's first row are prefilled first with no rows, so a read computes rows only past them. A read must not
  find the position before its first row in the cache (V1 leaves those rows unwritten, V2 leaves them out), and
  an earlier call may have cached these very prompts. So a read that a hit could reach past its first row goes
  under a cache salt of its own call (``cache_salt``: vLLM hashes it into a prompt's first block, so salted
  blocks are shared only with the same salt), its warm blocks too, and one that another read of the call could
  cover past its first row (:func:`plan_rows`) gets a salt of its own; the others read the cache unsalted.

Every answer is checked (``evalkit.engine.vllm.trace_rows``). One that fails, or whose rows V1's cache covered
(``num_cached_tokens``), is read again as the plain trace: the whole prompt's rows with no cache; a second
failure raises :class:`evalkit.engine.vllm.second_read.ScoringError`. The counts (``trace_*``) say which
reads were sent.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from evalkit.contracts import ScoreRequest, TokenTrace
from evalkit.engine.logprob_reads import BadRead, next_token_asks, read_next_token, scored_positions
from evalkit.engine.read_plan import MAX_LOGPROB_TOKEN_IDS
from evalkit.engine.vllm.trace_rows import Top, next_token_trace, next_top, trace_from_rows, unlisted
from evalkit.engine.vllm import next_token
from evalkit.engine.vllm.path_reads import shared_lengths
from evalkit.engine.vllm.second_read import second_read
from evalkit.engine.vllm.covering_reads import covered_trace, covering_reads, last_step, unlisted_last_steps


@dataclass(frozen=True)
class RowRead:
    """One prompt-row read of a trace: the request, the cache salt it is sent under (None: none, it reads the
    cache the scoring pass filled), and the tokens of whole KV-cache blocks before its first row (prefilled
    first under that salt; 0: none)."""

    request: ScoreRequest
    salt: str | None
    warm: int


def plan_rows(requests: Sequence[ScoreRequest], *, block: int, salt: str) -> list[RowRead]:
    """Each request as a row read, after the whole blocks before its first row (prefilled with no rows: V1
    writes a row at every position it computes). vLLM hits whole blocks only and never a prompt's last token,
    so a read whose last whole block before its last token starts before its first row can never be hit past
    it: it reads the cache as it is, unsalted. The others go under salt; alone under a salt of their own where
    another salted read of the call shares their whole blocks up to and past the position before their first
    row."""
    salted = [r for r in requests if (len(r.ids) - 1) // block * block >= scored_positions(r).start]
    shared = dict(zip(salted, shared_lengths([r.ids for r in salted], ())))
    reads = []
    for i, r in enumerate(requests):
        warm = (scored_positions(r).start - 1) // block * block
        if r not in shared:
            reads.append(RowRead(request=r, salt=None, warm=warm))
            continue
        reach = warm + block  # the shortest hit that covers the position before the first row
        alone = shared[r] >= reach and len(r.ids) - 1 >= reach
        reads.append(RowRead(request=r, salt=f"{salt}.{i}" if alone else salt, warm=warm))
    return reads


def _prompt(ids: Sequence[int], salt: str | None) -> dict[str, Any]:
    return {"prompt_token_ids": list(ids), **({"cache_salt": salt} if salt is not None else {})}


def _params(**fields: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, flat_logprobs=True, **fields)


def _first_call(llm: Any, reads: Sequence[RowRead], contexts: Sequence[tuple[int, ...]], top_k: int) -> tuple[
        list[Any], list[Any], int]:
    """The warm blocks, the row reads and the next-token top-k reads in one call: (row answers, context
    answers, warm prefixes sent)."""
    warm = list(dict.fromkeys((r.salt, r.request.ids[:r.warm]) for r in reads if r.warm))
    prompts = ([_prompt(ids, salt) for salt, ids in warm] + [_prompt(r.request.ids, r.salt) for r in reads] +
               [{"prompt_token_ids": list(c)} for c in contexts])
    params = ([_params()] * len(warm) +
              [_params(prompt_logprobs=top_k, skip_reading_prefix_cache=False)] * len(reads) +
              [_params(logprobs=top_k, skip_reading_prefix_cache=False)] * len(contexts))
    outputs = llm.generate(prompts, params, use_tqdm=False)[len(warm):] if prompts else []
    return outputs[:len(reads)], outputs[len(reads):], len(warm)


def _text_tokens(llm: Any, requests: Sequence[ScoreRequest]) -> tuple[dict[tuple[int, ...], dict[int, float]],
                                                                       list[ScoreRequest], int]:
    """The log-probabilities of the tokens their contexts' top-k leave out (``logprob_token_ids``, a call of
    their own, reading the cache): (entries per context, requests whose read failed its check, reads sent)."""
    asks = next_token_asks(requests, MAX_LOGPROB_TOKEN_IDS) if requests else []
    outputs = llm.generate([{"prompt_token_ids": list(c)} for c, _ in asks],
                           [_params(logprob_token_ids=ids) for _, ids in asks], use_tqdm=False) if asks else []
    entries: dict[tuple[int, ...], dict[int, float]] = {}
    failed: set[tuple[int, ...]] = set()
    for (context, ids), out in zip(asks, outputs):
        try:
            entries.setdefault(context, {}).update(read_next_token(context, ids, out.outputs[0].logprobs))
        except BadRead:
            failed.add(context)
    return entries, [r for r in requests if r.ids[:r.start] in failed], len(asks)


def plain_traces(llm: Any, requests: Sequence[ScoreRequest], top_k: int) -> list[TokenTrace]:
    """The plain trace: every request's whole prompt with rows and no cache (what the trace cost before the
    cached reads; now the read of last resort), each answer checked; one that fails raises ScoringError."""
    if not requests:
        return []
    outputs = llm.generate([{"prompt_token_ids": list(r.ids)} for r in requests],
                           _params(prompt_logprobs=top_k, skip_reading_prefix_cache=True), use_tqdm=False)
    return [second_read(lambda: trace_from_rows(r, out.prompt_logprobs, top_k), len(r.ids))
            for r, out in zip(requests, outputs)]


def _row_traces(llm: Any, reads: Sequence[RowRead], outputs: Sequence[Any], top_k: int, runner: str) -> tuple[
        dict[ScoreRequest, TokenTrace], int, int]:
    """Each row read's trace, checked; one that fails, or whose rows V1's cache covered, read again as the plain
    trace (a second failure raises ScoringError): (traces by read, reads resubmitted, reads mismatched)."""
    rows: dict[ScoreRequest, TokenTrace] = {}
    again: list[ScoreRequest] = []
    uncached = 0
    for read, out in zip(reads, outputs):
        if runner == "v1" and (out.num_cached_tokens or 0) >= scored_positions(read.request).start:
            uncached += 1  # V1 never wrote the rows the cache covered
            again.append(read.request)
            continue
        try:
            rows[read.request] = trace_from_rows(read.request, out.prompt_logprobs, top_k)
        except BadRead:
            again.append(read.request)
    rows.update(zip(again, plain_traces(llm, again, top_k)))
    return rows, uncached, len(again) - uncached


def token_traces(llm: Any, requests: Sequence[ScoreRequest], top_k: int, *, runner: str, block_size: int,
                 salt: str, dtype: str) -> tuple[list[TokenTrace], Counter[str]]:
    """The trace of each request's scored positions on llm (a ``vllm.LLM`` of this runner, KV-cache block size
    and logits dtype), the row reads under cache salt salt (unique to this call); and what it took (the module
    docstring)."""
    single = [r for r in requests if next_token.takes(r)]
    cover = covering_reads([r for r in requests if not next_token.takes(r)])
    reads = plan_rows(list(dict.fromkeys(cover.values())), block=block_size, salt=salt)
    contexts = list(dict.fromkeys(r.ids[:r.start] for r in single))
    row_outs, context_outs, warm = _first_call(llm, reads, contexts, top_k)
    rows, uncached, mismatched = _row_traces(llm, reads, row_outs, top_k, runner)
    tops: dict[tuple[int, ...], Top] = {}
    for context, out in zip(contexts, context_outs):
        try:
            tops[context] = next_top(out.outputs[0].logprobs, top_k)
        except BadRead:
            pass
    again = [r for r in single if r.ids[:r.start] not in tops]
    listed = [r for r in single if r.ids[:r.start] in tops]
    entries, failed, text_reads = _text_tokens(llm, unlisted(listed, tops) + unlisted_last_steps(cover, rows))
    unread = set(failed)
    found: dict[ScoreRequest, TokenTrace] = {}
    for r in listed + list(cover):
        step = r if r not in cover else last_step(r, cover[r])
        try:
            if step in unread:
                raise BadRead("its text token's read failed")
            context = entries.get(r.ids[:-1], {})
            found[r] = (covered_trace(r, cover[r], rows[cover[r]], context, dtype=dtype) if r in cover else
                        next_token_trace(r, tops[r.ids[:r.start]], context, dtype=dtype))
        except BadRead:
            again.append(r)
    again = list(dict.fromkeys(again))
    found.update(zip(again, plain_traces(llm, again, top_k)))
    counts = Counter(trace_requests=len(requests), trace_next_token=len(single), trace_contexts=len(contexts),
                     trace_text_token_reads=text_reads, trace_row_requests=len(cover), trace_row_reads=len(reads),
                     trace_prefilled_blocks=warm, trace_unsalted=sum(1 for r in reads if r.salt is None),
                     trace_own_salt=sum(1 for r in reads if r.salt not in (None, salt)), trace_resubmitted=uncached,
                     trace_mismatched=mismatched + len(again), trace_resent=uncached + mismatched + len(again))
    return [found[r] for r in requests], counts
