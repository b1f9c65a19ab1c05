"""Path reads: one vLLM request that reads several steps of a continuation, planned against vLLM's prefix cache,
sent, checked and, where the check fails, sent again without the cache.

A :class:`evalkit.engine.read_plan.PathRead` reads the prompt rows of ``prompt[start:]`` and the next-token
log-probabilities of its asked ids after the whole prompt. The chained path (``chained.py``) and the prompt
path (``prompt_logprobs.py``) both send theirs here. Two limits of vLLM 0.32 shape how they are sent:

* a request asks for at most ``MAX_LOGPROB_TOKEN_IDS`` next-token ids (``vllm/sampling_params.py``
  ``_validate_logprobs``): more go in further requests of the same prompt (``split_asked``);
* a row needs the logits of the position before it, which a prefix-cache hit never computes. vLLM hits
  whole blocks only, and never a prompt's last token (``kv_cache_manager.get_computed_blocks``:
  ``max_cache_hit_length = num_tokens - 1``). A hit past a read's first row leaves V1's rows unwritten and
  makes V2 drop the token-id scores (``vllm/v1/worker/gpu/sample/prompt_logprob.py``
  ``compute_prompt_token_id_logprobs``: "This prefill starts past the first scored row"; vLLM 0.23, which has
  no token-id scores, leaves the rows out), so the read would be sent twice. ``block_safe`` cuts each read where
  other requests may share its blocks: a read whose prompt ends inside the block that holds its first row's
  logits cannot be hit past that row, whatever is cached.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import replace
from typing import Any, Iterable, Sequence

from evalkit.contracts import Scored, ScoreRequest
from evalkit.engine.logprob_reads import BadRead, path_scores, read_path
from evalkit.engine.read_plan import MAX_LOGPROB_TOKEN_IDS, PathRead
from evalkit.engine.vllm.second_read import second_read


def shared_lengths(prompts: Sequence[tuple[int, ...]], others: Iterable[tuple[int, ...]]) -> list[int]:
    """For each of prompts, the longest prefix it shares with another sequence of prompts + others (the blocks
    of which another request may put in vLLM's prefix cache): found between neighbours in sorted order."""
    pool = sorted([*prompts, *others])

    def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    shared = []
    for p in prompts:
        i = bisect_left(pool, p)  # p itself is at i; a copy of it, if any, right after
        neighbours = [pool[j] for j in (i - 1, i + 1) if 0 <= j < len(pool)]
        shared.append(max((common(p, q) for q in neighbours), default=0))
    return shared


def _cut(read: PathRead, shared: int, block: int) -> list[PathRead]:
    """read as reads that no cache hit can reach past their first row, given that whole blocks up to shared
    tokens may be cached: one per block boundary c in [start, reach] (prompt[:c], its rows inside the block
    before c, asking the token at c), then the rest of the prompt with rows from reach + 1."""
    prompt, start = read.prompt, read.start
    if start is None:
        return [read]
    reach = min(max(shared, start) // block * block, (len(prompt) - 1) // block * block)
    first = -(-start // block) * block  # the first block boundary at or after start
    pieces = [PathRead(prompt=prompt[:c], start=max(start, c - block + 1) if max(start, c - block + 1) < c else None,
                       asked=(prompt[c],)) for c in range(first, reach + 1, block)]
    tail = max(start, reach + 1)
    if tail < len(prompt) or read.asked:
        pieces.append(PathRead(prompt=prompt, start=tail if tail < len(prompt) else None, asked=read.asked))
    return pieces


def _merged(reads: Iterable[PathRead]) -> list[PathRead]:
    """Reads of one prompt as one: rows from the earliest start, every asked id."""
    by_prompt: dict[tuple[int, ...], PathRead] = {}
    for r in reads:
        was = by_prompt.get(r.prompt)
        if was is None:
            by_prompt[r.prompt] = r
            continue
        starts = [s for s in (was.start, r.start) if s is not None]
        by_prompt[r.prompt] = PathRead(prompt=r.prompt, start=min(starts) if starts else None,
                                       asked=tuple(sorted({*was.asked, *r.asked})))
    return list(by_prompt.values())


def block_safe(reads: Sequence[PathRead], block: int, others: Iterable[tuple[int, ...]] = ()) -> list[PathRead]:
    """reads cut so that vLLM's prefix cache cannot reach past any read's first row (the module docstring): a
    read's prompt is cut at each block boundary from its first row up to the longest prefix it shares with
    another read or with others (the prompts of the call's other requests; a read's own context counts as
    shared, as the other choices of its question share it), each cut read asking the token at the cut as its
    next token. Cut reads of one prompt are merged; every step of reads is answered by the result."""
    shared = shared_lengths([r.prompt for r in reads], others)
    return _merged(piece for read, length in zip(reads, shared) for piece in _cut(read, length, block))


def split_asked(reads: Sequence[PathRead], most: int = MAX_LOGPROB_TOKEN_IDS) -> list[PathRead]:
    """Each read asking more than most next-token ids as several reads of its prompt: the first with its rows and
    the first most ids, the others with the next ones and no rows."""
    split = []
    for r in reads:
        parts = [r.asked[i:i + most] for i in range(0, len(r.asked), most)] or [()]
        split += [replace(r, asked=parts[0])] + [PathRead(prompt=r.prompt, start=None, asked=p) for p in parts[1:]]
    return split


def whole_blocks_before_rows(reads: Sequence[PathRead], block: int) -> list[tuple[int, ...]]:
    """The prefixes of whole KV-cache blocks that lie before each read's first row (whose logits come from the
    position before it), once each. Prefilled first with no rows asked, they are in vLLM's prefix cache when
    the reads come, so the reads compute rows only past them (both runners compute a prompt row for every
    position they compute)."""
    prefixes: dict[tuple[int, ...], None] = {}
    for r in reads:
        whole = (r.start - 1) // block * block if r.start is not None else 0
        if whole:
            prefixes[r.prompt[:whole]] = None
    return list(prefixes)


def path_params(read: PathRead, *, token_id_scores: bool, read_cache: bool) -> Any:
    """Rows of prompt[start:] (prompt_logprobs=1: the token and the top-1; with token_id_scores, V2's fixed-id
    scores of the prompt's own tokens from start on beside them: launch.token_id_scores) and the asked ids'
    next-token log-probabilities."""
    from vllm import SamplingParams

    extra: dict[str, Any] = {}
    if read.start is not None:
        extra["prompt_logprobs"] = 1
        if token_id_scores:
            extra.update(prompt_logprob_start=read.start - 1,
                         prompt_logprob_token_ids=[[t] for t in read.prompt[read.start:]])
    return SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, flat_logprobs=True,
                          logprob_token_ids=list(read.asked) or None, skip_reading_prefix_cache=not read_cache,
                          **extra)


def _read(read: PathRead, out: Any, token_id_scores: bool) -> tuple[list[tuple[float, bool]], dict[int, float]]:
    """What one vLLM output answers of read, checked (logprob_reads.read_path)."""
    return read_path(read, token_ids_asked=token_id_scores, prompt_rows=out.prompt_logprobs,
                     token_id_scores=getattr(out, "prompt_token_id_logprobs", None),
                     next_token=out.outputs[0].logprobs)


def send_reads(llm: Any, planned: Sequence[PathRead], *, runner: str, token_id_scores: bool, block_size: int,
               read_cache: bool, others: Sequence[tuple[int, ...]] = ()
               ) -> tuple[dict[ScoreRequest, Scored], Counter[str]]:
    """Every step of the planned reads (PathRead.steps), scored on llm (a ``vllm.LLM`` of this runner and
    KV-cache block size; V2's fixed-id scores asked where token_id_scores). Sent in one call, cut by block_safe
    when the cache is read (no hit can reach past a read's first row: counted ``cut_reads``; others are the
    prompts of the call's other reads), split past 128 asked ids (``split_reads``), after the whole blocks before
    their rows (``prefilled_blocks``); ``cache_hits`` counts the reads that found a cached prefix. Each answer is
    checked (logprob_reads.read_path); one whose rows the V1 cache covered (never written: ``resubmitted``) or
    that fails its check (``mismatched``) is sent again without the cache (both ``resent``); a second failure
    stops the run."""
    if not planned:
        return {}, Counter()
    from vllm import SamplingParams

    cut = block_safe(planned, block_size, others) if read_cache else list(planned)
    reads = split_asked(cut)
    prompts = [{"prompt_token_ids": list(r.prompt)} for r in reads]
    # both runners compute a row for every prompt position they compute: the whole blocks before each read's
    # rows go first, in the same call and with no rows, so that the reads compute rows only past them
    warm = whole_blocks_before_rows(reads, block_size) if read_cache else []
    outputs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in warm] + prompts,
        [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)] * len(warm) +
        [path_params(r, token_id_scores=token_id_scores, read_cache=read_cache) for r in reads],
        use_tqdm=False)[len(warm):]
    found: list[Any] = [None] * len(reads)
    uncached, mismatched = [], []
    for i, (read, out) in enumerate(zip(reads, outputs)):
        if runner == "v1" and read.start is not None and (out.num_cached_tokens or 0) >= read.start:
            uncached.append(i)  # V1 never wrote the rows the cache covered
            continue
        try:
            found[i] = _read(read, out, token_id_scores)
        except BadRead:
            mismatched.append(i)
    again = uncached + mismatched
    if again:
        resent = llm.generate([prompts[i] for i in again],
                              [path_params(reads[i], token_id_scores=token_id_scores, read_cache=False) for i in again],
                              use_tqdm=False)
        for i, out in zip(again, resent):
            found[i] = second_read(lambda: _read(reads[i], out, token_id_scores), len(reads[i].prompt))
    counts = Counter(resubmitted=len(uncached), mismatched=len(mismatched), resent=len(again),
                     prefilled_blocks=len(warm), cut_reads=len(cut) - len(planned),
                     split_reads=len(reads) - len(cut), cache_hits=sum(1 for out in outputs if out.num_cached_tokens))
    return {step: value for read, answer in zip(reads, found)
            for step, value in path_scores(read, *answer).items()}, counts
