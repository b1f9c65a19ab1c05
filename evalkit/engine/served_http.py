"""engine=served, the HTTP half: requests to an OpenAI-compatible server, a bounded number in flight, retried.

A batch of bodies is fed from a queue to a fixed pool of ``max_concurrency`` workers (never one pending task
per request), each sending one request at a time. A request's ``timeout`` counts from when it is sent, not
while it waits here. Connection errors, timeouts, HTTP 408, 429 and 5xx are retried with exponential
back-off (tenacity), ``retries`` more times; any other status is that request's failure. A batch never
raises for one request: each answer is the response's JSON or a :class:`Failure`, and the caller decides.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

RETRIED_STATUS = {408, 429}  # and every 5xx


@dataclass(frozen=True)
class Failure:
    """Why one request got no answer, as one line."""

    reason: str


class HTTPStatusFailure(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {' '.join(text.split())[:300]}")
        self.status = status


def transient(error: BaseException) -> bool:
    """Worth another try: the connection or the server's moment, not the request itself."""
    import httpx

    if isinstance(error, HTTPStatusFailure):
        return error.status in RETRIED_STATUS or error.status >= 500
    return isinstance(error, (httpx.TransportError, asyncio.TimeoutError, TimeoutError))


def without_credentials(url: str) -> str:
    """url without a user:password part, for records and messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def describe_error(error: BaseException) -> str:
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    return f"{type(error).__name__}: {error}" if not isinstance(error, HTTPStatusFailure) else str(error)


class Client:
    """One server's base URL (``.../v1``), its key, and the limits every request obeys."""

    def __init__(self, url: str, *, api_key: str | None, max_concurrency: int, timeout: float, retries: int,
                 backoff: float = 1.0, max_backoff: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff  # seconds before the first retry, doubling up to max_backoff
        self.max_backoff = max_backoff

    def root(self) -> str:
        """The server's root URL (the base URL without its trailing /v1), where /version and /health live."""
        return self.url[:-3] if self.url.endswith("/v1") else self.url

    def get(self, url: str) -> Any:
        """The JSON of one GET, retried as any request."""
        return self._run([("GET", url, None)])[0]

    def post(self, url: str, body: dict[str, Any]) -> Any:
        """The JSON of one POST to a full URL, or a Failure."""
        return self._run([("POST", url, body)])[0]

    def post_many(self, path: str, bodies: Sequence[dict[str, Any]],
                  done: Callable[[int], None] | None = None) -> list[Any]:
        """Each body POSTed to url/path: its response's JSON, or a Failure. done(i) is called as each finishes."""
        return self._run([("POST", f"{self.url}{path}", b) for b in bodies], done)

    def _run(self, calls: list[tuple[str, str, Any]], done: Callable[[int], None] | None = None) -> list[Any]:
        if not calls:
            return []
        return asyncio.run(self._all(calls, done))

    async def _all(self, calls: list[tuple[str, str, Any]], done: Callable[[int], None] | None) -> list[Any]:
        import httpx

        answers: list[Any] = [None] * len(calls)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(calls)):
            queue.put_nowait(i)
        workers = min(self.max_concurrency, len(calls))
        limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
        # httpx's own timeouts are per read; the request's whole time is bounded by asyncio.wait_for below
        async with httpx.AsyncClient(headers=self.headers, limits=limits, timeout=None) as client:
            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    answers[i] = await self._one(client, *calls[i])
                    if done:
                        done(i)

            await asyncio.gather(*(worker() for _ in range(workers)))
        return answers

    async def _one(self, client: Any, method: str, url: str, body: Any) -> Any:
        from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

        retrying = AsyncRetrying(retry=retry_if_exception(transient), stop=stop_after_attempt(self.retries + 1),
                                 wait=wait_exponential(multiplier=self.backoff, max=self.max_backoff), reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    return await asyncio.wait_for(self._send(client, method, url, body), self.timeout)
        except Exception as error:  # every request's failure is reported, none stops the others
            tries = getattr(retrying.statistics, "get", lambda *_: None)("attempt_number") or 1
            again = f" after {tries} tries" if tries > 1 else ""
            return Failure(f"{describe_error(error)}{again}")
        raise AssertionError("unreachable: tenacity either returns or raises")

    @staticmethod
    async def _send(client: Any, method: str, url: str, body: Any) -> Any:
        response = await client.request(method, url, json=body)
        if response.status_code != 200:
            raise HTTPStatusFailure(response.status_code, response.text)
        return response.json()
