"""engine=served: what is checked before anything is scored, and which API the server is read through.

:func:`deployment` names the server (``/v1/models``, ``/version``) and refuses another model or a shorter
``max_model_len``. :func:`probe` sends a known prompt and refuses in one line a server whose answers could not
be read right. A server that speaks vLLM's extensions (``return_token_ids``, ``prompt_logprobs``,
``cache_salt``) is read through them (``api: vllm``); one that ignores them is read through the OpenAI API
alone (``api: openai``, ``served/openai.py``): generation if its answers count the prompt that was sent, and
log-likelihoods only if its echo covers the prompt token by token. A vLLM server is also asked for two given ids'
next-token log-probabilities (``logprob_token_ids``, which vLLM 0.23's completions API lacks and ignores): where
they do not come back, no read asks for given ids and all are read from prompt rows. Nothing here is scored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from evalkit.config import ConfigError
from evalkit.contracts import GenRequest, ScoreRequest
from evalkit.engine.served import body
from evalkit.engine.served import openai
from evalkit.engine.logprob_reads import BadRead
from evalkit.engine.served.http import Client, Failure
from evalkit.untrusted import without_credentials

PROBE_TEXT = "The capital of France is Paris. The capital of Italy is Rome. " * 24  # longer than a cache block
# the fields vLLM's server fills from the model's generation_config.json into a request that leaves them out
# (ModelConfig.get_diff_sampling_param in 0.32, with --generation-config auto, its default)
SERVER_DEFAULT_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                         "top_p", "min_p", "max_new_tokens")


class ServerRefused(ConfigError):
    """The server cannot be evaluated as configured (unreachable, another model, too short a context, answers
    evalkit could not read right): found before anything is sent for scoring, and bad input like any other."""


def deployment(client: Client, model: str | None, max_model_len: int) -> dict[str, Any]:
    """The served model's identity: its name, root, max_model_len and the server's version (None where the
    server has no /version, as servers other than vLLM)."""
    url = without_credentials(client.url)
    listed = client.get(f"{client.url}/models")
    if isinstance(listed, Failure):  # a refused connection's reason names the server already
        raise ServerRefused(listed.reason if listed.refused else
                            f"the server at {url} did not answer /v1/models: {listed.reason}")
    version = client.get(f"{client.root()}/version")
    names = [m.get("id") for m in listed.get("data", [])]
    if model is None and len(names) != 1:
        raise ServerRefused(f"the server serves {len(names)} models ({', '.join(map(str, names))}): pass "
                            "endpoint.model=NAME")
    model = model or names[0]
    entry = next((m for m in listed["data"] if m.get("id") == model), None)
    if entry is None:
        raise ServerRefused(f"endpoint.model={model} is not served at {url} (it serves {', '.join(map(str, names))})")
    served_len = entry.get("max_model_len")
    if served_len is not None and (not isinstance(served_len, int) or served_len < max_model_len):
        raise ServerRefused(f"the server's max_model_len is {served_len}, less than max_model_len={max_model_len}: "
                            f"pass max_model_len={served_len} or serve a longer one")
    return {"model": model, "root": entry.get("root"), "max_model_len": served_len,
            "version": None if isinstance(version, Failure) else version.get("version")}


def weights_identity(*, started_from: str | None, deployment_id: str | None, keeps_answers: bool,
                     url: str) -> dict[str, str]:
    """What names the weights behind a server, for the request store's key (docs/served.md, "Which answers are
    reused"). No server says which weights it serves: vLLM's ``system_fingerprint`` hashes its configuration
    (version, parallel layout, dtype, attention backend), not its weights, and a model name is an alias. So:

    * a server evalkit started (``endpoint.serve=true``) from a local folder or a hub id: the content hash of
      those weights (:func:`evalkit.hashing.model_files`, as the offline engine's store);
    * a server evalkit did not start: ``endpoint.deployment``, an id the user gives that changes when the weights
      do (a checkpoint's hash, a release tag); without one its answers cannot be kept (``resume=true``), and the
      run is refused in one line before anything is sent;
    * both, when both are given."""
    from evalkit.hashing import model_files, sha256

    identity = {"weights": sha256(model_files(started_from))} if started_from else {}
    if deployment_id:
        identity["id"] = deployment_id
    if not identity and keeps_answers:
        raise ServerRefused(f"the server at {url} cannot say which weights it serves (vLLM's system_fingerprint "
                            "hashes its configuration, not its weights): pass endpoint.deployment=ID, an id that "
                            "changes when the deployed weights do (their hash, a release tag), so its answers are "
                            "kept under it; or resume=false to keep none")
    return identity


def early_probe(client: Client, model: str | None, max_model_len: int) -> dict[str, Any]:
    """The probe's round trips that need no local tokenizer, sent while it loads (the served engine runs this in
    a thread; on 2 cores they took 1.2-1.8 s after it): the deployment, the server's ids of the probe text
    (``/tokenize``), and where it gave them the two prompt-log-probability reads of those ids. :func:`probe`
    checks them all once the tokenizer is there."""
    named = deployment(client, model, max_model_len)
    tokenized = client.post(f"{client.root()}/tokenize", {"model": named["model"], "prompt": PROBE_TEXT,
                                                          "add_special_tokens": False})
    tokens = None if isinstance(tokenized, Failure) else tokenized.get("tokens")
    given = isinstance(tokens, list) and len(tokens) > 1 and all(isinstance(t, int) for t in tokens)
    return {"deployment": named, "tokenized": tokenized,
            "reads": _two_reads(client, named["model"], tuple(tokens)) if given else None,
            "ids_read": _ids_read(client, named["model"], tuple(tokens)) if given else None}


def _two_reads(client: Client, model: str, ids: tuple[int, ...]) -> list[Any]:
    """The prompt log-probabilities of ids twice, each under a fresh cache_salt, one after the other: the second
    could read the first's cache, were the salt ignored."""
    return [client.post_many("/completions", [body.prompt_logprobs_body(ids, model, body.salt())])[0]
            for _ in range(2)]


def _asked(ids: tuple[int, ...]) -> tuple[int, ...]:
    """Two distinct ids of the probe text, asked after it: a server that ignores logprob_token_ids returns the
    greedy token alone (``logprobs: 1``), which cannot be both."""
    return tuple(sorted(set(ids))[:2])


def _ids_read(client: Client, model: str, ids: tuple[int, ...]) -> Any:
    """The next-token log-probabilities of two given ids after ids (``logprob_token_ids``), under a fresh salt."""
    return client.post_many("/completions", [body.next_token_body(ids, _asked(ids), model, body.salt())])[0]


def asks_ids(ids: tuple[int, ...], answer: Any) -> bool:
    """Whether the server answered the ids read of ids with both asked ids (it honours ``logprob_token_ids``);
    a read that fails its check for any reason counts as not: the reads that do without are checked themselves."""
    if isinstance(answer, Failure):
        raise ServerRefused(f"the server failed evalkit's probe: {answer.reason}")
    try:
        body.read_next_token(ids, _asked(ids), answer)
    except BadRead:
        return False
    return True


def probe(engine: Any, early: dict[str, Any]) -> dict[str, Any]:
    """What the server was found to do, checked on a known prompt before anything is scored (early: what
    :func:`early_probe` found while the tokenizer loaded):

    * it tokenizes as the local tokenizer (where it has /tokenize);
    * ``api: vllm``: it returns the token ids it saw (``return_token_ids`` took effect) and log-probabilities
      of every position asked for; where it reports cached tokens, a repeated prompt under a fresh
      ``cache_salt`` reads no cache; whether it answers given ids (``logprob_token_ids``: True or False);
    * ``api: openai`` (it ignores vLLM's fields): a generation's answer counts the prompt's tokens, and its echo
      covers the prompt token by token, else ``scoring`` is None and why is in ``cannot_score``."""
    client, model = engine.client, engine.model
    text_ids = engine.encode(PROBE_TEXT, add_special_tokens=False)
    tokenized = early["tokenized"]
    tokenize = "no /tokenize" if isinstance(tokenized, Failure) else tokenized.get("tokens") == text_ids
    if tokenize is False:
        raise ServerRefused("the server tokenizes a probe text differently from the local tokenizer "
                            f"({engine.tokenizer_path}): point tokenizer= at the served model's tokenizer")
    if early["reads"] is not None:  # read on the server's ids of the text, the local ones (checked just above)
        ids, answers, ids_read = tuple(text_ids), early["reads"], early["ids_read"]
    else:
        ids = (engine.prefix_token_id(), *text_ids)
        answers, ids_read = _two_reads(client, model, ids), None
    found: dict[str, Any] = {"prompt_tokens": len(ids), "tokenize": tokenize}
    for answer in answers:
        if isinstance(answer, Failure):
            raise ServerRefused(f"the server failed evalkit's probe: {answer.reason}")
    found["system_fingerprint"] = answers[0].get("system_fingerprint")
    choice = (answers[0].get("choices") or [{}])[0]
    if choice.get("prompt_token_ids") is None and choice.get("prompt_logprobs") is None:
        return {**found, **_probe_openai(engine, ids)}
    try:
        for answer in answers:
            body.read_prompt_logprobs(ScoreRequest(ids=ids, start=1), answer)
    except BadRead as error:
        raise ServerRefused(f"the server failed evalkit's probe: {error}") from None
    cached = [(a.get("usage") or {}).get("prompt_tokens_details") or {} for a in answers]
    found["cached_tokens"] = [c.get("cached_tokens") for c in cached]
    if any(found["cached_tokens"]):
        raise ServerRefused("the server read its prefix cache for a prompt under a fresh cache_salt: it ignores "
                            "cache_salt, so prompt log-probabilities could come from cache rows")
    found["cache_salt"] = "verified" if all(c is not None for c in found["cached_tokens"]) else \
        "not reported (start the server with --enable-prompt-tokens-details to check it; vLLM 0.23's leaves a " \
        "count of 0 out even then)"
    found["logprob_token_ids"] = asks_ids(ids, ids_read if ids_read is not None else _ids_read(client, model, ids))
    return {**found, "api": "vllm", "scoring": "prompt_logprobs"}


def _probe_openai(engine: Any, ids: tuple[int, ...]) -> dict[str, Any]:
    """A server that ignores vLLM's fields: its generations must count the prompt that was sent; its echo, if
    it covers the prompt, scores."""
    client, model = engine.client, engine.model
    generation = GenRequest(prompt_ids=ids, max_tokens=4, stop=(), sampling=(("temperature", 0.0),))
    answer = client.post_many("/completions", [openai.generate_body(generation, model)])[0]
    try:
        if isinstance(answer, Failure):
            raise BadRead(answer.reason)
        output = openai.read_generation(generation, answer)
    except BadRead as error:
        raise ServerRefused(f"the server ignores vLLM's fields (no prompt_token_ids or prompt_logprobs), and its "
                            f"plain OpenAI answer failed evalkit's probe: {error}") from None
    found: dict[str, Any] = {"api": "openai", "cache_salt": "not sent (the server ignores vLLM's fields)",
                             "output_ids": "token_id" if output.token_ids else "not returned (tokens as text)",
                             "special_tokens_in_text": "as the server writes them"}
    echoed = client.post_many("/completions", [openai.echo_body(ids, model)])[0]
    try:
        if isinstance(echoed, Failure):
            raise BadRead(echoed.reason)
        openai.read_echo(ScoreRequest(ids=ids, start=1), echoed, engine.token_texts)
    except BadRead as error:
        return {**found, "scoring": None, "cannot_score": f"the server's echo failed evalkit's probe ({error})"}
    return {**found, "scoring": "echo"}


def server_defaults(folder: str, api: str) -> dict[str, Any]:
    """What a vLLM server of the weights in folder fills into a request that leaves a field out (the model's
    generation_config.json, with vLLM's default --generation-config auto), and which of them can apply: none
    through vLLM's API, where every field is sent; through the OpenAI API alone, those it has no field for."""
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        config = {}
    fields = {k: config[k] for k in SERVER_DEFAULT_FIELDS if config.get(k) is not None}
    unsendable = sorted(k for k in fields if k not in openai.OPENAI_SAMPLING and k != "max_new_tokens")
    applied = "none: every sampling field is sent explicitly" if api == "vllm" or not unsendable else \
        f"{', '.join(unsendable)} if the server applies generation_config.json: the OpenAI API has no field for them"
    return {"source": str(path) if path.is_file() else None, "fields": fields, "applied": applied}
