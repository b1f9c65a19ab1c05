"""Which vLLM requests read which log-probabilities: the plan of the engine's path reads (pure, no vLLM).

A continuation's tokens are read from the prompt rows of a request that holds them and from the next-token
log-probabilities after its last context (``plan_paths``). Two limits of vLLM 0.32 shape the plan:

* a request asks for at most ``MAX_LOGPROB_TOKEN_IDS`` next-token ids (``vllm/sampling_params.py``
  ``_validate_logprobs``): more go in further requests of the same prompt (``split_asked``);
* a row needs the logits of the position before it, which a prefix-cache hit never computes. vLLM hits
  whole blocks only, and never a prompt's last token (``kv_cache_manager.get_computed_blocks``:
  ``max_cache_hit_length = num_tokens - 1``). A hit past a read's first row leaves V1's rows unwritten and
  makes V2 drop the token-id scores (``vllm/v1/worker/gpu/sample/prompt_logprob.py``
  ``compute_prompt_token_id_logprobs``: "This prefill starts past the first scored row"), so the read would be
  sent twice. ``block_safe`` cuts each read where other requests may share its blocks: a read whose prompt
  ends inside the block that holds its first row's logits cannot be hit past that row, whatever is cached.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from evalkit.contracts import ScoreRequest

MAX_LOGPROB_TOKEN_IDS = 128  # vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS in 0.32: ids one request may ask for


@dataclass(frozen=True)
class PathRead:
    """One request that reads several chain steps: the rows of prompt[start:] (None: no rows) and the next-token
    log-probabilities of the ids in asked after the whole prompt."""

    prompt: tuple[int, ...]
    start: int | None
    asked: tuple[int, ...]

    def steps(self) -> list[ScoreRequest]:
        """The steps this read answers, in the order read_path returns them."""
        rows = range(self.start, len(self.prompt)) if self.start is not None else range(0)
        return ([ScoreRequest(ids=self.prompt[:p + 1], start=p) for p in rows] +
                [ScoreRequest(ids=self.prompt + (t,), start=len(self.prompt)) for t in self.asked])


def plan_paths(requests: Sequence[ScoreRequest]) -> tuple[list[PathRead], list[ScoreRequest]]:
    """Path reads for the steps of these continuations (token_steps), each as long as the continuations go: a
    step whose next token lies on a longer prompt is read from that prompt's rows, the last token of each
    continuation from the next-token log-probabilities after its own context. Choices of 2+ tokens behind one
    question then need one request per distinct last context, not one per step, and each request prefills
    the question's tail (the part past vLLM's last full cached block) once. Returns the reads and the steps
    no read covers (to be read as one-token continuations)."""
    inner: dict[tuple[int, ...], tuple[int, ...]] = {}  # a context that a longer one extends -> that one
    for r in requests:
        for p in range(r.start, len(r.ids) - 1):
            inner.setdefault(r.ids[:p], r.ids[:-1])

    def longest(context: tuple[int, ...]) -> tuple[int, ...]:
        while context in inner:
            context = inner[context]
        return context

    starts: dict[tuple[int, ...], int | None] = {}
    asked: dict[tuple[int, ...], dict[int, None]] = {}
    rest: list[ScoreRequest] = []

    def rows_from(prompt: tuple[int, ...], position: int) -> None:
        current = starts[prompt]
        starts[prompt] = position if current is None else min(current, position)

    for r in requests:
        last, prompt = r.ids[:-1], longest(r.ids[:-1])
        starts.setdefault(prompt, None)
        if len(r.ids) - 1 > r.start:  # steps before the last: rows of the prompt that extends them
            rows_from(prompt, r.start)
        if prompt == last:
            asked.setdefault(prompt, {})[r.ids[-1]] = None
        elif prompt[len(last)] == r.ids[-1]:
            rows_from(prompt, len(last))
        else:
            rest.append(ScoreRequest(ids=r.ids, start=len(r.ids) - 1))
    reads = [PathRead(prompt=p, start=s, asked=tuple(sorted(asked.get(p, {})))) for p, s in starts.items()]
    return reads, list(dict.fromkeys(rest))


def _shared_lengths(prompts: Sequence[tuple[int, ...]], others: Iterable[tuple[int, ...]]) -> list[int]:
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
    shared = _shared_lengths([r.prompt for r in reads], others)
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
