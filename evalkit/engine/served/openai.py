"""engine=served for a server without vLLM's extensions (``api: openai`` in the probe): the bodies sent, the reads
of what comes back, and which of them each request gets (:class:`OpenAIApi`).

Such a server (SGLang, llama.cpp, TGI, a gateway that drops fields) ignores ``prompt_logprobs``,
``return_token_ids``, ``logprob_token_ids`` and ``cache_salt``. What the OpenAI completions API itself offers
is used instead, as lm-eval's ``local-completions`` does, with the checks it lacks:

* **Scoring** by echo: ``echo=true`` with ``logprobs`` returns one entry per prompt token, then the generated
  one. Each entry must hold the token that was sent at that position, keyed by token id when the server honours
  ``return_tokens_as_token_ids`` (``token_id:N``), else as the text the local tokenizer decodes that id to;
  greediness compares the token's log-probability with its position's top entries (a tie counts as greedy,
  as offline). An echo that does not cover the prompt (llama.cpp returned generated tokens only, and lm-eval
  scored exactly chance) fails the read, and the probe refuses the server.
* **Generation**: the prompt's length from ``usage.prompt_tokens``, the output's token ids from the
  generated entries of ``logprobs`` (when keyed by id), their count from ``usage.completion_tokens``.
  Only OpenAI's sampling fields are sent; a request that needs another one (``top_k``, ``min_p``,
  ``repetition_penalty``, ...) at a value other than neutral fails: such a server could drop it unseen.
  How special tokens are written into the text is left to the server (``SERVER_TEXT``).

A server whose echo the probe found not to cover the prompt still generates; its log-likelihoods and traces
fail, each batch in one line saying why (``cannot_score``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Collection, Sequence

from evalkit.contracts import Generation, GenRequest, IdsRead, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.logprob_reads import scored_positions
from evalkit.engine.served.batch import Sender, failed
from evalkit.engine.served.body import SAMPLING_DEFAULTS, ServedReadError, checked_value

OPENAI_SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "n", "logit_bias")
# how the output's text is written around special tokens: left to the server (lm-eval's vllm backend, and so
# evalkit, turns both off; a server writes special tokens as it does, which changes no token and no score)
SERVER_TEXT = ("skip_special_tokens", "spaces_between_special_tokens")
Decode = Callable[[int], Collection[str]]  # the texts a server may write one token id as (the local tokenizer's)


def _settings(request: GenRequest) -> dict[str, Any]:
    """OpenAI's sampling fields of request, explicit; any other field it sets away from neutral is refused."""
    sampling = SAMPLING_DEFAULTS | dict(request.sampling)
    unsent = sorted(k for k, v in sampling.items() if k not in (*OPENAI_SAMPLING, *SERVER_TEXT, "stop")
                    and v != SAMPLING_DEFAULTS.get(k, object()))
    if unsent:
        raise ServedReadError(f"sampling {', '.join(f'{k}={sampling[k]}' for k in unsent)} has no OpenAI field, and "
                              "this server ignores vLLM's: serve the model with vLLM to evaluate these settings")
    return {k: sampling[k] for k in OPENAI_SAMPLING}


def generate_body(request: GenRequest, model: str) -> dict[str, Any]:
    return {"model": model, "prompt": list(request.prompt_ids), "max_tokens": request.max_tokens, "echo": False,
            "stream": False, "logprobs": 1, "return_tokens_as_token_ids": True, "stop": list(request.stop),
            **_settings(request)}


def echo_body(ids: Sequence[int], model: str, top: int = 1) -> dict[str, Any]:
    """The prompt echoed with the log-probability and top entries of every token, and one greedy token more."""
    return {"model": model, "prompt": list(ids), "max_tokens": 1, "echo": True, "stream": False, "logprobs": top,
            "return_tokens_as_token_ids": True, "temperature": 0.0, "top_p": 1.0, "seed": None}


def _choice(response: dict[str, Any]) -> dict[str, Any]:
    choices = response.get("choices") or []
    if len(choices) != 1:
        raise ServedReadError(f"{len(choices)} choices in the response, one was asked for")
    return choices[0]


def token_id(token: Any, decode: Decode, expected: int) -> int | None:
    """The id an entry's token names: ``token_id:N`` as N; a text as expected if the local tokenizer writes
    expected so, else None (a text names no id of its own)."""
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token.split(":", 1)[1])
    return expected if expected >= 0 and token in decode(expected) else None


def _entries(request: ScoreRequest, response: dict[str, Any], decode: Decode) -> tuple[list[Any], list[Any]]:
    """(token log-probabilities, top entries) of the echoed prompt, checked token by token against ids."""
    logprobs = _choice(response).get("logprobs") or {}
    tokens, values, tops = (logprobs.get(k) or [] for k in ("tokens", "token_logprobs", "top_logprobs"))
    ids = request.ids
    if not (len(ids) <= len(tokens) <= len(ids) + 1) or len(values) != len(tokens):
        raise ServedReadError(f"the echo has {len(tokens)} tokens and {len(values)} log-probabilities for a "
                              f"{len(ids)}-token prompt: the server's echo does not cover the prompt")
    for position, (token, sent) in enumerate(zip(tokens, ids)):
        if token_id(token, decode, sent) != sent:
            raise ServedReadError(f"the echo has {token!r} at position {position}, where token {sent} was sent")
    if len(tops) != len(tokens):
        raise ServedReadError(f"{len(tops)} top log-probability entries for {len(tokens)} echoed tokens")
    return values, tops


def read_echo(request: ScoreRequest, response: dict[str, Any], decode: Decode) -> Scored:
    values, tops = _entries(request, response, decode)
    total, greedy = 0.0, True
    for position in scored_positions(request):
        value = checked_value(values[position], position, "echo")
        top = tops[position]
        if not isinstance(top, dict) or not top:
            raise ServedReadError(f"echo: position {position} has no top log-probabilities")
        total += value
        greedy = greedy and value >= max(checked_value(v, position, "echo") for v in top.values())
    return Scored(logprob=total, is_greedy=greedy)


def read_echo_trace(request: ScoreRequest, response: dict[str, Any], decode: Decode, top_k: int) -> TokenTrace:
    values, tops = _entries(request, response, decode)
    positions = scored_positions(request)
    top = []
    for p in positions:
        row = tops[p] if isinstance(tops[p], dict) else {}
        pairs = [(token_id(t, decode, -1), checked_value(v, p, "echo")) for t, v in row.items()]
        if not pairs or any(t is None for t, _ in pairs):
            raise ServedReadError(f"echo: position {p}'s top entries are not keyed by token id: the server "
                                  "ignores return_tokens_as_token_ids, and a text may name two ids")
        top.append(tuple(sorted(pairs, key=lambda item: -item[1])[:top_k]))
    return TokenTrace(logprobs=tuple(checked_value(values[p], p, "echo") for p in positions), top=tuple(top))


def read_generation(request: GenRequest, response: dict[str, Any]) -> Generation:
    choice = _choice(response)
    usage = response.get("usage") or {}
    prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if prompt != len(request.prompt_ids):
        raise ServedReadError(f"the server counted a {prompt}-token prompt, not the {len(request.prompt_ids)} token "
                              "ids sent")
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise ServedReadError(f"finish_reason {reason!r}, not stop or length")
    if not isinstance(output, int) or output > request.max_tokens or (reason == "length" and output != request.max_tokens):
        raise ServedReadError(f"{output} output tokens with finish_reason {reason} for max_tokens={request.max_tokens}")
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    ids = tuple(int(t.split(":", 1)[1]) for t in tokens if isinstance(t, str) and t.startswith("token_id:"))
    if len(ids) < len(tokens):
        ids = ()  # the server writes its tokens as text: the output's ids are not known
    elif len(ids) != output:
        raise ServedReadError(f"{len(ids)} output token ids for {output} output tokens counted")
    return Generation(text=choice.get("text") or "", finish_reason=reason, output_tokens=output, token_ids=ids)


class OpenAIApi:
    """Generations, and log-likelihoods and traces by echo, of a server read through the OpenAI API alone."""

    def __init__(self, sender: Sender, *, model: str, decode: Decode, cannot_score: str | None,
                 counts: Counter[str]) -> None:
        self.sender = sender
        self.model = model
        self.decode = decode
        self.cannot_score = cannot_score  # why the probe found the server's echo unreadable; None: it scores
        self.counts = counts

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None, top_k: int = 0) -> list[Generation]:
        """No trace, whatever top_k: the harness traces the greedy outputs by echo in a call of its own."""
        return self.sender.built(requests, lambda r: generate_body(r, self.model), read_generation, progress,
                                 lambda r: len(r.prompt_ids))

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None, fast: bool,
              top_k: int = 0) -> list[Scored]:
        """Every request by echo: one path, fast changes nothing; no trace, whatever top_k (the harness traces
        by echo in a call of its own)."""
        self._fail_unless_scorable(requests)
        self.counts.update(echo=len(requests))
        return self.sender.send(requests, lambda r: echo_body(r.ids, self.model),
                                lambda r, response: read_echo(r, response, self.decode), progress,
                                lambda r: len(r.ids))

    def trace(self, requests: Sequence[ScoreRequest], top_k: int) -> list[TokenTrace]:
        self._fail_unless_scorable(requests)
        return self.sender.send(requests, lambda r: echo_body(r.ids, self.model, top_k),
                                lambda r, response: read_echo_trace(r, response, self.decode, top_k), None, len)

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        """NotImplementedError where a read asks any id: the OpenAI API has no field that asks for given ids'
        log-probabilities (its logprobs are the top entries, an echo the prompt's own tokens). Reads that ask
        none are answered ()."""
        if any(r.ids for r in reads):
            raise NotImplementedError("the server is read through the OpenAI API alone (api: openai), which cannot "
                                      "ask for given token ids' log-probabilities (vLLM's logprob_token_ids)")
        return [() for _ in reads]

    def _fail_unless_scorable(self, requests: Sequence[ScoreRequest]) -> None:
        """Every request of the batch failed, where the probe found the server's echo unreadable."""
        if self.cannot_score is not None:
            raise failed([None] * len(requests), self.cannot_score)
