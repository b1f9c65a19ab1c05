"""A local HTTP server in a thread, for the served client's tests that need a real socket but no vLLM: started by
:func:`serve` on a free port (or the one given), each handler answering JSON with :func:`answer_json`; :func:`running` for the length of a with block."""

import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator


def serve(handler: type[BaseHTTPRequestHandler], port: int = 0, queue: int | None = None) -> ThreadingHTTPServer:
    """handler serving on 127.0.0.1:port (0: a free one) in a daemon thread; queue: the listen backlog where the
    default (5) would refuse a burst of connections. Stop it with ``server.shutdown()``."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler, bind_and_activate=False)
    if queue is not None:
        server.request_queue_size = queue
    server.daemon_threads = True
    server.server_bind()
    server.server_activate()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def answer_json(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    """handler's answer: status and a JSON body."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.end_headers()
    handler.wfile.write(body)


class QuietHandler(BaseHTTPRequestHandler):
    """A handler that writes no access log to the test's output."""

    def log_message(self, *args) -> None:
        pass


@contextmanager
def running(handler: type[BaseHTTPRequestHandler], queue: int | None = None) -> Iterator[str]:
    """handler served (:func:`serve`) for the with block: its base URL, the server shut down after."""
    server = serve(handler, queue=queue)
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
