"""engine=served: how many prompts are kept in flight, as many as the server batches.

A server that batches decodes faster with more prompts in flight, up to its own limit (vLLM's max_num_seqs);
past it, they wait in its queue, where their request's ``timeout`` runs and nothing goes faster. So the window
of prompts in flight (a request of several prompts, ``served/batch.py``, weighs as many, as the server counts
them running) starts at ``START`` (or the cap), doubles while a request is held back and the server queues
nothing, and, when the server says it queues (vLLM's ``/metrics``: ``vllm:num_requests_waiting`` above 0),
falls to what it runs (``vllm:num_requests_running``); a reading while the server runs nothing (it has not seen
our requests yet) does not grow it. The server is asked only while the window is full (a request held back, or
as many in flight as it allows: at the cap no request is held back, and a server that queues them must still be
seen); otherwise there is nothing to learn, and on a small machine the server's own process renders the page on
the cores its engine uses. ``endpoint.max_concurrency`` caps it, so evalkit's memory stays flat (a fixed pool of
at most that many workers, never one task per request). A server without vLLM's ``/metrics`` gets the cap, and its 429s are
retried with back-off as before (``served/http.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator

# prompts in flight before the server has said anything: vLLM 0.32's smallest default max_num_seqs (an API server on
# CPU; 256 or more on GPUs), so a default server queues none of them. 32 held evalkit_bench_num_mc's 120 whole reads
# (8 requests of 16) to 2 requests at a time until /metrics was read: 2.78 s against 2.57 s with all in flight
# (medians of 10 runs in turn, each run faster; the server's steps take up to 2048 tokens)
START = 128
POLL = 0.5  # seconds between two reads of /metrics while requests are in flight
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


def server_load(metrics: str) -> tuple[int, int] | None:
    """(running, waiting) summed over the engines of a Prometheus text page, None where it has neither gauge."""
    found: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (RUNNING, WAITING):
            fields = (line.rsplit("}", 1)[-1] if "{" in line else line.split(" ", 1)[-1]).split()
            try:
                found[name] = found.get(name, 0.0) + float(fields[0])
            except (ValueError, IndexError):
                return None
    if RUNNING not in found or WAITING not in found:
        return None
    return int(found[RUNNING]), int(found[WAITING])


@dataclass
class Window:
    """How many requests may be in flight now (limit), never more than cap."""

    cap: int
    limit: int = START

    def __post_init__(self) -> None:
        self.limit = min(self.cap, self.limit)

    def seen(self, running: int, waiting: int, in_flight: int) -> None:
        """Follow one reading of the server's load, with in_flight of ours sent and unanswered."""
        if waiting > 0:
            self.limit = max(1, min(self.cap, running))
        elif in_flight >= self.limit and running > 0:  # it queues none of ours: try more
            self.limit = min(self.cap, self.limit * 2)

    def unknown(self) -> None:
        """The server reports no load: the cap."""
        self.limit = self.cap


class Gate:
    """Holds a worker back while its request would overfill the window; the tuner moves the window. A request
    weighs the prompts it carries (a bundle of several, ``served/batch.py``), as the server counts them running."""

    def __init__(self, window: Window) -> None:
        self.window = window
        self.in_flight = 0  # prompts sent and unanswered
        self.wanting = 0  # prompts of the requests held back
        self.peak = 0  # the most prompts that were in flight at once
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def held(self, weight: int = 1) -> AsyncIterator[None]:
        """Room for a request of weight prompts while it is in flight; one heavier than the window goes alone."""
        async with self._changed:
            self.wanting += weight
            try:
                await self._changed.wait_for(lambda: self.in_flight == 0 or
                                             self.in_flight + weight <= self.window.limit)
            finally:
                self.wanting -= weight
            self.in_flight += weight
            self.peak = max(self.peak, self.in_flight)
        try:
            yield
        finally:
            async with self._changed:
                self.in_flight -= weight
                self._changed.notify_all()

    async def tune(self, metrics_url: str, headers: dict[str, str], poll: float = POLL, verify: Any = True) -> None:
        """Read the server's load every poll seconds and move the window, until cancelled; a server without the
        gauges leaves the window at the cap and is not asked again. verify: httpx's (the caller's TLS context)."""
        import httpx

        async with httpx.AsyncClient(headers=headers, timeout=max(poll * 4, 2.0), verify=verify) as fresh:
            while True:
                await asyncio.sleep(poll)
                if not self.wanting and self.in_flight < self.window.limit:  # not full: nothing to learn
                    continue
                try:
                    response = await fresh.get(metrics_url)
                    load = server_load(response.text) if response.status_code == 200 else None
                except (httpx.HTTPError, OSError):
                    load = None
                async with self._changed:
                    if load is None:
                        self.window.unknown()
                    else:
                        self.window.seen(*load, in_flight=self.in_flight + self.wanting)
                    self._changed.notify_all()
                if load is None:
                    return
