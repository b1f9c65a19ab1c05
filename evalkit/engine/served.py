"""engine=served: the Engine contract over a running OpenAI-compatible vLLM server (docs/served.md).

Prompts are built here with the local tokenizer, exactly as for the offline engine, and sent as token ids to
``/v1/completions``; the bodies and the reads that check each answer are in ``served_body.py``, the HTTP
pool and its retries in ``served_http.py``. A probe checks the server before anything is scored
(:meth:`ServedEngine.probe`). A request that fails is never scored: the batch's finished answers are handed
back with one :class:`ServedError` naming how many failed and why the first did (the request store keeps
the finished ones, so a rerun sends only the rest).
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any, Callable, Sequence

from evalkit.config import ConfigError
from evalkit.contracts import (Generation, GenRequest, PartialAnswers, Progress, Scored, ScoreRequest,
                               TokenTrace)
from evalkit.engine import served_body as body
from evalkit.engine.environment import library_versions
from evalkit.engine.logprob_reads import BadRead, chunked, next_token_scores
from evalkit.engine.served_http import Client, Failure, without_credentials
from evalkit.engine.tokenizer import TokenizerSide, load_tokenizer

MAX_LOGPROB_TOKEN_IDS = 128  # vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS in 0.32: ids one request may ask for
PROBE_TEXT = "The capital of France is Paris. The capital of Italy is Rome. " * 24  # longer than a cache block


class ServerRefused(ConfigError):
    """The server cannot be evaluated as configured (unreachable, another model, too short a context, answers
    evalkit could not read right): found before anything is sent for scoring, and bad input like any other."""


class ServedError(PartialAnswers):
    """Some requests of a batch got no verified answer from the server; none of them was scored."""

    def __init__(self, message: str, answers: list[Any], reason: str | None = None) -> None:
        super().__init__(message, answers)
        self.reason = reason or message


def failed(answers: list[Any], reason: str) -> ServedError:
    """The error of a batch whose None answers failed, the first of them for reason."""
    missing = sum(1 for a in answers if a is None)
    return ServedError(f"{missing} of {len(answers)} requests failed: {reason}", answers, reason)


class ServedEngine(TokenizerSide):
    """The :class:`evalkit.contracts.Engine` of a running vLLM server, reached over HTTP."""

    def __init__(self, *, client: Client, model: str | None, tokenizer: str, trust_remote_code: bool,
                 add_bos_token: bool | None, max_model_len: int, server: Any = None) -> None:
        self.client = client
        self.server = server  # the server evalkit started (served_start.py), stopped by close(); None otherwise
        self.tokenizer_path = tokenizer
        self.tokenizer = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code, add_bos_token=add_bos_token)
        self.max_model_len = max_model_len
        self._counts: Counter[str] = Counter()
        self.deployment, self.model = self._deployment(model)
        self.probed = self.probe()

    # --- the server ---
    def _deployment(self, model: str | None) -> tuple[dict[str, Any], str]:
        listed = self.client.get(f"{self.client.url}/models")
        version = self.client.get(f"{self.client.root()}/version")
        for answer, what in ((listed, "/v1/models"), (version, "/version")):
            if isinstance(answer, Failure):
                raise ServerRefused(f"the server at {self.url()} did not answer {what}: {answer.reason}")
        names = [m.get("id") for m in listed.get("data", [])]
        if model is None and len(names) != 1:
            raise ServerRefused(f"the server serves {len(names)} models ({', '.join(map(str, names))}): pass "
                              "endpoint.model=NAME")
        model = model or names[0]
        entry = next((m for m in listed["data"] if m.get("id") == model), None)
        if entry is None:
            raise ServerRefused(f"endpoint.model={model} is not served at {self.url()} (it serves "
                              f"{', '.join(map(str, names))})")
        served_len = entry.get("max_model_len")
        if not isinstance(served_len, int) or served_len < self.max_model_len:
            raise ServerRefused(f"the server's max_model_len is {served_len}, less than max_model_len="
                              f"{self.max_model_len}: pass max_model_len={served_len} or serve a longer one")
        return {"model": model, "root": entry.get("root"), "max_model_len": served_len,
                "version": version.get("version")}, model

    def url(self) -> str:
        return without_credentials(self.client.url)

    def probe(self) -> dict[str, Any]:
        """Before anything is scored, refuse in one line a server whose answers could not be read right: it
        must tokenize as the local tokenizer (where it has /tokenize), return the token ids it saw
        (``return_token_ids`` took effect), and give log-probabilities of every position asked for; where it
        reports cached tokens, a repeated prompt under a fresh ``cache_salt`` must read no cache."""
        text_ids = self.encode(PROBE_TEXT, add_special_tokens=False)
        ids = (self.prefix_token_id(), *text_ids)
        found: dict[str, Any] = {"prompt_tokens": len(ids)}
        tokenized = self.client.post(f"{self.client.root()}/tokenize",
                                     {"model": self.model, "prompt": PROBE_TEXT, "add_special_tokens": False})
        found["tokenize"] = "no /tokenize" if isinstance(tokenized, Failure) else tokenized.get("tokens") == text_ids
        if found["tokenize"] is False:
            raise ServerRefused("the server tokenizes a probe text differently from the local tokenizer "
                              f"({self.tokenizer_path}): point tokenizer= at the served model's tokenizer")
        request = ScoreRequest(ids=ids, start=1)
        # one after the other: the second could read the first's cache, were the salt ignored
        answers = [self.client.post_many("/completions", [body.prompt_logprobs_body(ids, self.model, salt())])[0]
                   for _ in range(2)]
        try:
            for answer in answers:
                if isinstance(answer, Failure):
                    raise BadRead(answer.reason)
                body.read_prompt_logprobs(request, answer)
        except BadRead as error:
            raise ServerRefused(f"the server failed evalkit's probe: {error}") from None
        cached = [(a.get("usage") or {}).get("prompt_tokens_details") or {} for a in answers]
        found["cached_tokens"] = [c.get("cached_tokens") for c in cached]
        if any(found["cached_tokens"]):
            raise ServerRefused("the server read its prefix cache for a prompt under a fresh cache_salt: it "
                              "ignores cache_salt, so prompt log-probabilities could come from cache rows")
        found["cache_salt"] = "verified" if all(c is not None for c in found["cached_tokens"]) else \
            "not reported (start the server with --enable-prompt-tokens-details to check it)"
        return found

    # --- inference ---
    def _batch(self, requests: Sequence[Any], make: Callable[[Any], dict], read: Callable[[Any, dict], Any],
               progress: Progress | None, tokens: Callable[[Any], int]) -> list[Any]:
        """Each request sent, its answer read and checked; one that fails its check is sent once more (a fresh
        salt); those still failing raise ServedError after the batch, with the finished answers."""
        answers: list[Any] = [None] * len(requests)
        reasons: dict[int, str] = {}
        todo = list(range(len(requests)))
        for round_ in (1, 2):
            responses = self.client.post_many("/completions", [make(requests[i]) for i in todo])
            again = []
            for i, response in zip(todo, responses):
                try:
                    if isinstance(response, Failure):
                        reasons[i] = response.reason
                        continue
                    answers[i] = read(requests[i], response)
                    reasons.pop(i, None)
                    if progress:
                        progress.advance(1, tokens(requests[i]))
                except BadRead as error:
                    reasons[i] = f"the answer failed its check twice ({error})"
                    again.append(i)
            self._counts["mismatched"] += len(again) if round_ == 1 else 0
            todo = again
            if not todo:
                break
        if reasons:
            raise failed(answers, reasons[min(reasons)])
        return answers

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None) -> list[Generation]:
        try:
            bodies = {id(r): body.generate_body(r, self.model) for r in requests}
        except BadRead as error:
            raise failed([None] * len(requests), str(error)) from None
        return self._batch(requests, lambda r: bodies[id(r)], body.read_generation, progress,
                           lambda r: len(r.prompt_ids))

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True) -> list[Scored]:
        """Log-probabilities of ids[start:] given what precedes. One-token continuations (fast): one request per
        context, every choice's token in ``logprob_token_ids``; the rest from prompt log-probabilities,
        each under a fresh ``cache_salt`` so no row comes from another request's cache."""
        single = [i for i, r in enumerate(requests) if fast and len(r.ids) - r.start == 1 and r.start >= 1]
        taken = set(single)
        rest = [i for i in range(len(requests)) if i not in taken]
        scored: list[Any] = [None] * len(requests)
        reasons = []
        for chosen, send in ((rest, self._prompt_logprobs), (single, self._next_token)):
            try:
                answers = send([requests[i] for i in chosen], progress)
            except ServedError as error:
                answers, reasons = error.answers, [*reasons, error.reason]
            for i, answer in zip(chosen, answers):
                scored[i] = answer
        if reasons:
            raise failed(scored, reasons[0])
        return scored

    def _prompt_logprobs(self, requests: Sequence[ScoreRequest], progress: Progress | None) -> list[Scored]:
        self._counts.update(prompt_logprobs=len(requests))
        return self._batch(requests, lambda r: body.prompt_logprobs_body(r.ids, self.model, salt()),
                           body.read_prompt_logprobs, progress, lambda r: len(r.ids))

    def _next_token(self, requests: Sequence[ScoreRequest], progress: Progress | None) -> list[Scored | None]:
        """One request per context, asking for every choice's token (at most 128 per request, more split)."""
        contexts: dict[tuple[int, ...], set[int]] = {}
        for r in requests:
            contexts.setdefault(r.ids[:r.start], set()).add(r.ids[r.start])
        asks = [(c, tuple(ids)) for c in contexts for ids in chunked(sorted(contexts[c]), MAX_LOGPROB_TOKEN_IDS)]
        self._counts.update(single_token=len(requests), contexts=len(contexts), context_requests=len(asks))
        reason = None
        try:
            found = self._batch(asks, lambda a: body.next_token_body(a[0], a[1], self.model, salt()),
                                lambda a, response: body.read_next_token(a[0], a[1], response), None, len)
        except ServedError as error:
            found, reason = error.answers, error.reason
        entries: dict[tuple[int, ...], dict[int, float]] = {}
        for (context, _), entry in zip(asks, found):
            if entry is not None:
                entries.setdefault(context, {}).update(entry)
        answered = [r for r in requests if r.ids[r.start] in entries.get(r.ids[:r.start], {})]
        scores = dict(zip(answered, next_token_scores(answered, entries)))
        if progress:
            progress.advance(len(answered), sum(len(r.ids) for r in answered))
        if reason:
            raise failed([scores.get(r) for r in requests], reason)
        return [scores[r] for r in requests]

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        return self._batch(requests, lambda r: body.prompt_logprobs_body(r.ids, self.model, salt(), top_k),
                           lambda r, response: body.read_trace(r, response, top_k), None, len)

    def scoring_counts(self) -> dict[str, int]:
        return dict(self._counts)

    def describe(self) -> dict[str, Any]:
        client = self.client
        return {"name": "served",
                "engine_args": {"url": self.url(), "model": self.model, "tokenizer": self.tokenizer_path,
                                "max_model_len": self.max_model_len, "max_concurrency": client.max_concurrency,
                                "timeout": client.timeout, "retries": client.retries,
                                "started_by_evalkit": self.server is not None},
                "server_log": str(self.server.log) if self.server is not None else None,
                "choices": [vars(c) for c in self.server.choices] if self.server is not None else [],
                "deployment": dict(self.deployment), "probe": dict(self.probed), "versions": library_versions()}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def salt() -> str:
    """A fresh cache_salt: the request shares no prefix-cache block with any other."""
    return uuid.uuid4().hex
