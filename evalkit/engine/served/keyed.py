"""The key check on every path of the server evalkit starts, loaded into that server by vLLM's ``--middleware``.

vLLM checks ``--api-key`` (or ``VLLM_API_KEY``) only on paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``; the same app answers SageMaker's ``/invocations`` (completions and chat), ``/tokenize``, ``/metrics``
and more without it, so another user of the machine could use the model through them. :class:`KeyOnEveryPath`
sits in front of the whole app (routes, mounted apps, websockets) and lets a request through only with
``Authorization: Bearer <VLLM_API_KEY>``; with no key in the environment it lets nothing through. Standard
library only: it runs inside vLLM's server process.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import Any, Awaitable, Callable

KEY_VARIABLE = "VLLM_API_KEY"  # the server's environment holds the run's key (never its command line)

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def carries(headers: list[tuple[bytes, bytes]], digest: bytes | None) -> bool:
    """Whether the ASGI headers hold ``Authorization: Bearer <key>`` whose SHA-256 is digest (compared in constant
    time, as vLLM compares its own)."""
    if digest is None:
        return False
    given = [value for name, value in headers if name.lower() == b"authorization"]
    if len(given) != 1:
        return False
    scheme, _, token = given[0].decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(hashlib.sha256(token.encode()).digest(), digest)


class KeyOnEveryPath:
    """ASGI middleware: every HTTP request and websocket without the run's key is refused (401; a websocket is
    closed before it opens), whatever its path or method; lifespan events pass."""

    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get(KEY_VARIABLE)
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or carries(scope.get("headers", []), self.digest):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = b'{"error": "Unauthorized"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
