"""engine=served, the HTTP half: requests to an OpenAI-compatible server, a bounded number in flight, retried.

A batch of bodies is fed from a queue to a fixed pool of ``max_concurrency`` workers (never one pending task
per request), each sending one request at a time, while the window of ``served/concurrency.py`` lets them: as
many prompts in flight as the server batches (a request of several prompts weighs as many). A request's ``timeout`` counts from when it is sent, not
while it waits here. Connection errors, timeouts, HTTP 408, 429 and 5xx are retried with exponential
back-off (tenacity), ``retries`` more times; any other status is that request's failure. A batch never
raises for one request: each answer is the response's JSON or a :class:`Failure`, and the caller decides. A
request whose every try was refused (nothing listens at the address: the server stopped or never started)
fails naming the server: ``the server at URL refused connections (...)``.

While requests are in flight a watcher asks the server's ``/health`` every ``HEALTH_POLL`` seconds on a new
connection. A server that shuts down (vLLM's on SIGTERM: a rolling restart, a preempted pod) aborts its
requests and refuses new connections but leaves the open ones waiting, so a request in flight would sit until
``timeout``; after ``HEALTH_MISSES`` checks in a row that get no answer (or a 5xx, as a gateway with no server
behind it gives), the server is gone: the requests in flight are cancelled and each unfinished one is a
:class:`Failure` naming it. With ``reconnect_wait`` the watcher first waits up to that many seconds for
``/health`` to answer again, and the unfinished requests are sent again.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence
from evalkit.engine.served.concurrency import Gate, Window
from evalkit.untrusted import without_credentials

RETRIED_STATUS = {408, 429}  # and every 5xx
GONE_STATUS = {502, 503, 504}  # /health answered by a gateway with no server behind it, or a dead engine
HEALTH_POLL = 5.0  # seconds between two checks of /health while requests are in flight
HEALTH_MISSES = 3  # checks in a row without an answer: the server is gone (about 10-30 s after it went)


@dataclass(frozen=True)
class Failure:
    """Why one request got no answer, as one line."""

    reason: str
    refused: bool = False  # nothing listened at the server's address: the reason names the server itself


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


@functools.lru_cache(maxsize=1)
def tls() -> Any:
    """The TLS context every client of this process shares: httpx's default (certifi's CAs, SSL_CERT_FILE and
    SSL_CERT_DIR honoured), built once. httpx builds a new one for each AsyncClient, loading the CA file (about
    20 ms of CPU here), even for http:// URLs; evalkit opens two clients for each batch and one for each /health
    check, on the cores a local server computes on."""
    import httpx

    return httpx.create_ssl_context()


def refused(error: BaseException) -> bool:
    """Whether error is a connection the server's address refused (nothing listens there: stopped, or never
    started), as httpx raises it: a ConnectError caused by a ConnectionRefusedError."""
    link: BaseException | None = error
    seen: set[int] = set()  # a chain that loops back on itself ends the walk
    while link is not None and id(link) not in seen:
        if isinstance(link, ConnectionRefusedError):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


def prompts_in(body: Any) -> int:
    """The prompts a request carries, as the server runs them: a completions body's list of token-id lists
    counts each (``served/batch.py`` bundles them), anything else one."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else 1


def describe_error(error: BaseException) -> str:
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    return f"{type(error).__name__}: {error}" if not isinstance(error, HTTPStatusFailure) else str(error)


class Client:
    """One server's base URL (``.../v1``), its key, and the limits every request obeys."""

    def __init__(self, url: str, *, api_key: str | None, max_concurrency: int, timeout: float, retries: int,
                 backoff: float = 1.0, max_backoff: float = 30.0, reconnect_wait: float = 0.0,
                 health_poll: float = HEALTH_POLL) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff  # seconds before the first retry, doubling up to max_backoff
        self.max_backoff = max_backoff
        self.reconnect_wait = reconnect_wait  # seconds to wait for a server that went away to come back
        self.health_poll = health_poll
        self.peak_in_flight = 0  # the most prompts this client had in flight at once

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
        """Every call answered (JSON or Failure); while the server is gone and back within reconnect_wait, the
        unfinished ones are sent again."""
        answers: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        while todo:
            gone = await self._some(calls, todo, answers, done)
            todo = [i for i in todo if answers[i] is None]
            if gone is None or not todo:
                break
            if not await self._back_within(self.reconnect_wait):
                for i in todo:
                    answers[i] = Failure(gone)
                break
        return answers

    async def _some(self, calls: list[tuple[str, str, Any]], todo: list[int], answers: list[Any],
                    done: Callable[[int], None] | None) -> str | None:
        """Send the calls in todo from a pool of workers, answers filled in place; None when all finished, else
        why the server is gone (its unfinished calls are cancelled and left None)."""
        import httpx

        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in todo:
            queue.put_nowait(i)
        workers = min(self.max_concurrency, len(todo))
        limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
        # as many prompts in flight as the server batches (served/concurrency.py), at most max_concurrency
        gate = Gate(Window(cap=self.max_concurrency))
        # httpx's own timeouts are per read; the request's whole time is bounded by asyncio.wait_for below
        async with httpx.AsyncClient(headers=self.headers, limits=limits, timeout=None, verify=tls()) as client:
            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    async with gate.held(prompts_in(calls[i][2])):
                        answers[i] = await self._one(client, *calls[i])
                    if done:
                        done(i)

            pool = asyncio.ensure_future(asyncio.gather(*(worker() for _ in range(workers))))
            watcher = asyncio.ensure_future(self._watch())
            tuner = asyncio.ensure_future(gate.tune(f"{self.root()}/metrics", self.headers, verify=tls()))
            await asyncio.wait({pool, watcher}, return_when=asyncio.FIRST_COMPLETED)
            tuner.cancel()
            self.peak_in_flight = max(self.peak_in_flight, gate.peak)
            if pool.done():
                watcher.cancel()
                pool.result()
                return None
            pool.cancel()
            try:
                await pool
            except asyncio.CancelledError:
                pass
            return watcher.result()

    async def _healthy(self) -> bool:
        """Whether the server answers /health on a new connection: any answer but a gateway's 502-504 (or vLLM's
        503 for a dead engine) counts, so a server without /health still shows it listens."""
        import httpx

        try:
            async with httpx.AsyncClient(headers=self.headers, timeout=self.health_poll, verify=tls()) as fresh:
                return (await fresh.get(f"{self.root()}/health")).status_code not in GONE_STATUS
        except (httpx.HTTPError, OSError):
            return False

    async def _watch(self) -> str:
        """Return, only once the server is gone, one line saying so."""
        misses = 0
        while misses < HEALTH_MISSES:
            await asyncio.sleep(self.health_poll)
            misses = 0 if await self._healthy() else misses + 1
        return (f"the server at {without_credentials(self.root())} is gone (its /health did not answer "
                f"{HEALTH_MISSES} times in a row while requests were in flight: shut down or restarted)"
                + (f" and did not come back within endpoint.reconnect_wait={self.reconnect_wait:g}s"
                   if self.reconnect_wait else ""))

    async def _back_within(self, seconds: float) -> bool:
        """Whether the server answers /health again within seconds."""
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline:
            if await self._healthy():
                return True
            await asyncio.sleep(min(self.health_poll, 1.0))
        return False

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
            why = describe_error(error) + (f" after {tries} tries" if tries > 1 else "")
            if refused(error):
                return Failure(f"the server at {without_credentials(self.root())} refused connections ({why})",
                               refused=True)
            return Failure(why)
        raise AssertionError("unreachable: tenacity either returns or raises")

    @staticmethod
    async def _send(client: Any, method: str, url: str, body: Any) -> Any:
        response = await client.request(method, url, json=body)
        if response.status_code != 200:
            raise HTTPStatusFailure(response.status_code, response.text)
        return response.json()
