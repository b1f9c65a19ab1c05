"""One engine call spread over the pool's actors: its requests in shards, each sent to an actor as one frees up.

The shards are balanced by tokens, one per actor by default, and a question's choices (score requests with one
context) stay in one shard, so an engine reads their shared prefix from its own cache (pool/plan.py, ``shard``).
Answers go back in request order, so lm-eval scores what a single engine would have returned. A shard whose actor
is lost is sent again to the actor that replaces it, ``REPLACEMENTS`` times at most. What the actors report of
their progress reaches the caller's Progress while the shards run.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import Progress
from evalkit.engine.pool.actor import PROGRESS_EVERY
from evalkit.engine.pool.plan import REPLACEMENTS, one_line, shard
from evalkit.engine.pool.replicas import Replicas


def dispatch(replicas: Replicas, method: str, requests: Sequence[Any], *args: Any, queue: Any,
             progress: Progress | None, shards: int) -> list:
    """replicas' actors' `method`(shard, queue, *args) over `shards` shards of requests; answers in request order.
    queue is where the actors report their progress, passed on to progress."""
    import ray

    if not requests:
        return []
    waiting = shard(requests, shards)
    answers: list[Any] = [None] * len(requests)
    free, running, losses = list(range(len(replicas.actors))), {}, Counter()
    while waiting or running:
        while waiting and free:
            i, indexes = free.pop(0), waiting.pop(0)
            ref = getattr(replicas.actors[i], method).remote([requests[k] for k in indexes], queue, *args)
            running[ref] = (i, indexes)
        done, _ = ray.wait(list(running), num_returns=1, timeout=PROGRESS_EVERY)
        report(queue, progress)
        for ref in done:
            i, indexes = running.pop(ref)
            try:
                for k, answer in zip(indexes, ray.get(ref)):
                    answers[k] = answer
            except ray.exceptions.RayError as error:
                losses[tuple(indexes)] += 1
                if losses[tuple(indexes)] > REPLACEMENTS:
                    raise RuntimeError(f"a shard of {len(indexes)} requests lost its engine "
                                       f"{REPLACEMENTS + 1} times; last: {one_line(error)}") from error
                replicas.restart(i, error)
                waiting.insert(0, indexes)
            free.append(i)
    report(queue, progress)
    return answers


def report(queue: Any, progress: Progress | None) -> None:
    """Pass on to progress what the actors put on queue since the last call."""
    size = queue.qsize()
    for requests, tokens in (queue.get_nowait_batch(size) if size else []):
        if progress:
            progress.advance(requests, tokens)
