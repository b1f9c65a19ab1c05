"""An HTTP proxy in a thread between evalkit and a real server, which spoils answers on the way (tests/engine/served/test_served.py).

Every request is forwarded to the server as it came. POSTs to ``/v1/completions`` can be spoiled: ``faults``
is a list consumed one per such request as they arrive (None: forwarded untouched), and ``wrong_ids_for``
names prompts whose answer always comes back with another prompt's token ids. ``dead`` (or ``die_after``
completions answered) drops every connection unanswered, as a server killed behind a gateway. What was
spoiled is recorded in ``spoiled``. :func:`openai_only` makes the server behind it one that ignores vLLM's
fields, as a server that is not vLLM does.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("429", "500", "hang", "drop", "cut", "wrong_ids")


class FaultProxy:
    def __init__(self, upstream: str, hang_seconds: float = 8.0, api_key: str | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.api_key = api_key  # the server's, added to what is forwarded (a gateway in front of a keyed server)
        self.hang_seconds = hang_seconds
        self.faults: list[str | None] = []
        self.wrong_ids_for: set[tuple[int, ...]] = set()
        self.dead = False
        self.die_after: int | None = None
        self.rewrite = None  # a function applied to every completions answer's JSON, as another server writes it
        self.rewrite_request = None  # a function applied to every completions body before it is forwarded
        self.rewrite_get = None  # a function (path, JSON) applied to every GET's answer
        self.hidden: set[str] = set()  # paths (their ends) answered 404, as a server without them
        self.answered = 0  # completions forwarded and answered whole
        self.spoiled: list[str] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                proxy.handle(self, None)

            def do_POST(self):  # noqa: N802
                proxy.handle(self, self.rfile.read(int(self.headers["Content-Length"])))

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _fault(self, handler: BaseHTTPRequestHandler, sent: bytes | None) -> tuple[str | None, list[int]]:
        """(the fault for this request, the prompts of it whose answers get another prompt's ids: a request may
        carry several prompts, answered by one choice each in their order)."""
        if sent is None or not handler.path.endswith("/completions"):
            return None, []
        with self.lock:
            fault = self.faults.pop(0) if self.faults else None
        prompt = json.loads(sent)["prompt"]
        prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        return fault, [i for i, p in enumerate(prompts) if tuple(p) in self.wrong_ids_for]

    def handle(self, handler: BaseHTTPRequestHandler, sent: bytes | None) -> None:
        if self.die_after is not None and self.answered >= self.die_after:
            self.dead = True
        if self.dead:
            handler.close_connection = True
            return  # no answer at all: the client sees the connection closed
        if any(handler.path.endswith(p) for p in self.hidden):
            return self._reply(handler, 404, b'{"detail": "Not Found"}')
        if sent is not None and self.rewrite_request is not None and handler.path.endswith("/completions"):
            sent = json.dumps(self.rewrite_request(json.loads(sent))).encode()
        fault, wrong = self._fault(handler, sent)
        if fault:
            self.spoiled.append(fault)
        if fault in ("429", "500"):
            return self._reply(handler, int(fault), b'{"error": "spoiled by the proxy"}')
        if fault == "drop":
            handler.close_connection = True
            return
        if fault == "hang":
            time.sleep(self.hang_seconds)  # past the client's timeout: it has given up and will try again
            handler.close_connection = True
            return
        key = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(self.upstream + handler.path, data=sent, method=handler.command,
                                         headers={"Content-Type": "application/json", **key})
        try:
            with urllib.request.urlopen(request, timeout=600) as answer:
                status, data = answer.status, answer.read()
        except urllib.error.HTTPError as error:
            status, data = error.code, error.read()
        if wrong or fault == "wrong_ids":
            if wrong:
                self.spoiled.append("wrong_ids")
            answer = json.loads(data)
            for i in wrong or [0]:
                answer["choices"][i]["prompt_token_ids"][-1] += 1
            data = json.dumps(answer).encode()
        if self.rewrite is not None and status == 200 and handler.path.endswith("/completions"):
            data = json.dumps(self.rewrite(json.loads(data))).encode()
        if self.rewrite_get is not None and status == 200 and sent is None:
            data = json.dumps(self.rewrite_get(handler.path, json.loads(data))).encode()
        if fault == "cut":
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data[:len(data) // 2])
            handler.close_connection = True
            return
        if status == 200 and sent is not None and handler.path.endswith("/completions"):
            with self.lock:
                self.answered += 1
        self._reply(handler, status, data)

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


VLLM_FIELDS = ("prompt_logprobs", "return_token_ids", "cache_salt", "logprob_token_ids", "top_k", "min_p",
               "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens",
               "include_stop_str_in_output", "ignore_eos", "min_tokens", "stop_token_ids", "allowed_token_ids",
               "bad_words", "add_special_tokens")


def openai_only(proxy: FaultProxy, *, token_ids: bool = True, echo_covers_prompt: bool = True) -> None:
    """The server behind proxy as one that is not vLLM: vLLM's request fields are dropped before it sees them
    (and return_tokens_as_token_ids too, unless token_ids), its answers carry no vLLM fields, /version and
    /tokenize are not found, /v1/models names no max_model_len. With echo_covers_prompt false, an echo's
    log-probabilities cover the generated token only, as llama.cpp's did (llama.cpp #27174)."""
    dropped = VLLM_FIELDS + (() if token_ids else ("return_tokens_as_token_ids",))

    def request(sent: dict) -> dict:
        return {k: v for k, v in sent.items() if k not in dropped}

    def answer(got: dict) -> dict:
        for choice in got["choices"]:
            for key in ("prompt_logprobs", "prompt_token_ids", "token_ids"):
                choice.pop(key, None)
            logprobs = choice.get("logprobs")
            if logprobs and not echo_covers_prompt:  # the generated tokens' entries only
                generated = got["usage"]["completion_tokens"]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    logprobs[key] = logprobs[key][-generated:]
        return got

    def listed(path: str, got: dict) -> dict:
        for model in got.get("data", []) if path.endswith("/models") else []:
            model.pop("max_model_len", None)
        return got

    proxy.rewrite_request, proxy.rewrite, proxy.rewrite_get = request, answer, listed
    proxy.hidden = {"/version", "/tokenize"}
