"""Which prompt-row reads trace which requests of several tokens (vllm/trace_from_cache.py sends them): as few
prompts as cover them all. Pure; nothing here imports vLLM.

A prompt's rows (``prompt_logprobs=k``) give the top-k after each of its prefixes, whatever follows. So a
request whose context before its last token (``ids[:-1]``) is a prefix of a longer read prompt is traced from
that prompt's rows: at every position but the last, the read holds the request's own token, the row's target;
at the last, where the read may go on with another token, the row's top-k is the request's top list and its
token's value is the target's (the same token), a top entry's or, where neither, one ``logprob_token_ids`` read
of that id after that context (trace_from_cache.py's text-token reads), checked as a one-token trace is
(``trace_rows.next_token_trace``).

Each read costs what V1 computes for it: its tail past the last cached whole block, with a row of k entries at
every computed position. Choices of 2+ tokens behind one question so need one read per distinct last context
that no other request's extends, not one per choice (evalkit_bench_mc: 63 reads for 120 choices).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from evalkit.contracts import ScoreRequest, TokenTrace
from evalkit.engine.logprob_reads import scored_positions
from evalkit.engine.vllm.trace_rows import next_token_trace


def covering_reads(requests: Sequence[ScoreRequest]) -> dict[ScoreRequest, ScoreRequest]:
    """Each request's row read: the ids of a request whose last context extends the request's own (itself where
    none does) with rows from the earliest start among the requests it covers. Requests of one last context
    share a read, as does a context that another extends (the nearest one after it in sorted order does)."""
    groups: dict[tuple[int, ...], list[ScoreRequest]] = {}
    for r in requests:
        groups.setdefault(r.ids[:-1], []).append(r)
    contexts = sorted(groups)
    leaf: dict[tuple[int, ...], tuple[int, ...]] = {}
    for i in range(len(contexts) - 1, -1, -1):  # a context that extends c, if any, is the next one in order
        c, after = contexts[i], contexts[i + 1] if i + 1 < len(contexts) else None
        leaf[c] = leaf[after] if after is not None and after[:len(c)] == c else c
    starts: dict[tuple[int, ...], int] = {}
    for r in requests:
        end = leaf[r.ids[:-1]]
        starts[end] = min(starts.get(end, r.start), r.start)
    reads = {end: ScoreRequest(ids=groups[end][0].ids, start=start) for end, start in starts.items()}
    return {r: reads[leaf[r.ids[:-1]]] for r in requests}


def last_step(request: ScoreRequest, read: ScoreRequest) -> ScoreRequest | None:
    """The one-token step of request's last token where read goes on with another (None: read holds it)."""
    last = len(request.ids) - 1
    if last not in scored_positions(request) or read.ids[last] == request.ids[last]:
        return None
    return ScoreRequest(ids=request.ids, start=last)


def unlisted_last_steps(cover: Mapping[ScoreRequest, ScoreRequest], rows: Mapping[ScoreRequest, TokenTrace]
                        ) -> list[ScoreRequest]:
    """The last steps whose token their read's row leaves out of its top list (their value needs a read of that
    id after their context), once each."""
    steps = []
    for request, read in cover.items():
        step = last_step(request, read)
        if step is not None and step.ids[-1] not in dict(rows[read].top[step.start - scored_positions(read).start]):
            steps.append(step)
    return list(dict.fromkeys(steps))


def covered_trace(request: ScoreRequest, read: ScoreRequest, rows: TokenTrace,
                  entries: Mapping[int, float], *, dtype: str) -> TokenTrace:
    """request's trace from the checked rows of the read that covers it (rows: the read's trace, from its first
    scored position), its last token's value from entries (the ids read after its context) where the read goes
    on with another token that the row's top list leaves out (checked as next_token_trace checks it, for dtype)."""
    first = scored_positions(read).start
    positions = scored_positions(request)
    if (read.ids[:len(request.ids) - 1] != request.ids[:-1] or len(read.ids) < len(request.ids) or
            (positions and positions.start < first)):
        raise ValueError(f"a read of {len(read.ids)} tokens from {first} does not cover a request of "
                         f"{len(request.ids)} tokens from {positions.start}")
    values = list(rows.logprobs[positions.start - first:positions.stop - first])
    tops = list(rows.top[positions.start - first:positions.stop - first])
    step = last_step(request, read)
    if step is not None:
        own = next_token_trace(step, tops[-1], entries, dtype=dtype)
        values[-1] = own.logprobs[0]
    return TokenTrace(logprobs=tuple(values), top=tuple(tops))
