"""engine=served, the pure half: the /v1/completions bodies evalkit sends and the reads of what comes back.

Nothing here talks to a server or imports vLLM. Bodies carry the prompt as token ids and every sampling field
explicitly, so a server's ``generation_config`` defaults cannot change an answer. Each read checks itself
against the request (STYLE 14): the prompt token ids the server saw, the token of every log-probability row,
finite values <= 0. Responses are shaped as vLLM 0.32's ``vllm/entrypoints/openai/completion/serving.py``
builds them (``request_output_to_completion_response``); tests/engine/served/test_served.py builds them with vLLM's own
protocol classes.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from evalkit.contracts import Generation, GenRequest, Scored, ScoreRequest, TokenTrace
from evalkit.engine.logprob_reads import BadRead, scored_positions

# vllm.SamplingParams() in 0.32 for every field a completion request carries (tests/engine/served/test_served.py checks them
# against vLLM): a field the request leaves unset is sent with the value the offline engine would use.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None, "stop": [], "stop_token_ids": [],
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
    "ignore_eos": False, "min_tokens": 0, "n": 1, "logit_bias": None, "allowed_token_ids": None, "bad_words": [],
}
CLAMPED = -9999.0  # vLLM's server writes -inf as this (clamp_prompt_logprobs, _create_completion_logprobs)


class ServedReadError(BadRead):
    """A server's response does not answer the request that was sent."""


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


def read_next_token(context: Sequence[int], asked: Sequence[int], response: dict[str, Any]) -> dict[int, float]:
    """{token id: log-probability} of the next token after context: the greedy token and every asked id."""
    logprobs = choice_of(response, context).get("logprobs") or {}
    steps = logprobs.get("top_logprobs") or []
    if len(steps) != 1 or not isinstance(steps[0], dict):
        raise ServedReadError(f"{len(steps)} generated steps of log-probabilities, one was asked for")
    entries = {}
    for key, value in steps[0].items():
        if not key.startswith("token_id:"):
            raise ServedReadError(f"log-probability keyed {key!r}: the server ignored return_tokens_as_token_ids")
        entries[int(key.split(":", 1)[1])] = checked_value(value, len(context), "next-token")
    missing = sorted(set(asked) - set(entries))
    if missing:
        raise ServedReadError(f"next-token log-probabilities lack the asked ids {missing[:5]}")
    return entries
