"""engine=served: the Engine contract over a running OpenAI-compatible server (docs/served.md).

Prompts are built here with the local tokenizer, exactly as for the offline engine, and sent as token ids to
``/v1/completions``. A probe checks the server before anything is scored and finds which API it is read
through (``served/probe.py``); the engine then hands every batch to that API's reader: vLLM's fields
(``served/body.py``: the bodies, the reads that check each answer, chains or whole prompt reads; with the
divergence record's traces read in the same requests, ``served/traced_requests.py``) or, for a server that ignores them,
the OpenAI API alone (``served/openai.py``: echo; its traces in a call of their own). Both send through
``served/batch.py`` (each answer checked, a failed request never scored) and its HTTP pool and retries
(``served/http.py``). A continuation with nothing to score is answered here and never sent.
"""
from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from evalkit.contracts import Generation, GenRequest, IdsRead, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.logprob_reads import NOTHING_SCORED, unscored
from evalkit.engine.machine.environment import library_versions
from evalkit.engine.served.batch import Sender, ServedError, failed
from evalkit.engine.served.body import PROMPTS_PER_REQUEST, salt
from evalkit.engine.served.http import Client
from evalkit.engine.served.openai import OpenAIApi
from evalkit.engine.served.probe import ServerRefused, early_probe, probe, server_defaults
from evalkit.engine.served.traced_requests import TracedVLLMApi
from evalkit.engine.tokenizer import TokenizerSide, load_tokenizer
from evalkit.untrusted import without_credentials

__all__ = ["ServedEngine", "ServedError", "ServerRefused"]


class ServedEngine(TokenizerSide):
    """The :class:`evalkit.contracts.Engine` of a running OpenAI-compatible server, reached over HTTP: read
    through vLLM's fields where it has them (api: vllm), else through the OpenAI API alone (api: openai)."""

    def __init__(self, *, client: Client, model: str | None, tokenizer: str, trust_remote_code: bool,
                 add_bos_token: bool | None, max_model_len: int, server: Any = None,
                 identity: dict[str, str] | None = None) -> None:
        self.client = client
        self.server = server  # the server evalkit started (served/start.py), stopped by close(); None otherwise
        self.tokenizer_path = tokenizer
        self.max_model_len = max_model_len
        self.logits_dtype = ""  # a server does not say: its checks between two calls are held to bfloat16's
        self.trust_remote_code = trust_remote_code
        self._counts: Counter[str] = Counter()
        # next-token reads share the server's prefix cache with one another, and with no other client's requests
        self.cache_salt = salt()
        # the probe's round trips to the server go while the tokenizer loads (a thread: both mostly wait)
        with ThreadPoolExecutor(1, thread_name_prefix="evalkit-probe") as pool:
            sent = pool.submit(early_probe, client, model, max_model_len)
            self.tokenizer = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code,
                                            add_bos_token=add_bos_token, with_vllm=False)  # a client needs no vLLM
            early = sent.result()
        self.deployment = {**early["deployment"], **(identity or {})}  # identity: weights_identity
        self.model = self.deployment["model"]
        self.probed = probe(self, early)
        self.api = self.probed["api"]  # "vllm": read through vLLM's fields; "openai": the OpenAI API alone
        if self.probed["system_fingerprint"] is not None:
            self.deployment["system_fingerprint"] = self.probed["system_fingerprint"]
        if self.api != "vllm":
            self.deployment["api"] = self.api
        self.reader = self._reader()

    def _reader(self) -> TracedVLLMApi | OpenAIApi:
        """The probed API's reader: vLLM's fields (with the divergence record's traces read in the same requests),
        else the OpenAI API alone (scoring by echo where the probe found the server's echo readable; no trace)."""
        if self.api == "vllm":  # a vLLM server answers each prompt of a request apart (choices numbered by prompt)
            sender = Sender(self.client, fingerprint=self.probed["system_fingerprint"], counts=self._counts,
                            bundle=PROMPTS_PER_REQUEST)
            return TracedVLLMApi(sender, model=self.model, cache_salt=self.cache_salt, counts=self._counts,
                                 asks_ids=self.probed["logprob_token_ids"])
        sender = Sender(self.client, fingerprint=self.probed["system_fingerprint"], counts=self._counts)
        cannot_score = None if self.probed["scoring"] is not None else self.probed["cannot_score"]
        return OpenAIApi(sender, model=self.model, decode=self.token_texts, cannot_score=cannot_score,
                         counts=self._counts)

    def url(self) -> str:
        return without_credentials(self.client.url)

    def token_texts(self, token: int) -> tuple[str, ...]:
        """The texts a server may write one token as: decoded alone, or its vocabulary piece."""
        return self.tokenizer.decode([token]), self.tokenizer.convert_ids_to_tokens(token)

    # --- inference: each batch read through the probed API (self.reader) ---
    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *,
                 top_k: int = 0) -> list[Generation]:
        """With top_k > 0, through vLLM's fields, each greedy generation with the trace of its steps (the top_k of
        each, read in the same request: served/traced_requests.py); through the OpenAI API alone, none (trace None)."""
        return self.reader.generate(requests, progress, top_k)

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True, top_k: int = 0) -> list[Scored]:
        """Log-probabilities of ids[start:] given what precedes, read as the API's reader reads them (fast:
        chained next-token reads where they pay, on vLLM's fields; with top_k > 0 there, whole-prompt reads at
        top_k that answer each trace too). A request with nothing to score (an empty continuation) is answered
        (0.0, True), as lm-eval sums it, and never sent."""
        empty = set(unscored(requests))
        if empty:
            return self._with_unscored(requests, empty, progress, fast, top_k)
        return self.reader.score(requests, progress, fast, top_k)

    def _with_unscored(self, requests: Sequence[ScoreRequest], empty: set[int], progress: Progress | None,
                       fast: bool, top_k: int) -> list[Scored]:
        self._counts.update(unscored=len(empty))
        if progress:
            progress.advance(len(empty), sum(len(requests[i].ids) for i in empty))
        reason = None
        try:
            answers = self.score([r for i, r in enumerate(requests) if i not in empty], progress, fast=fast,
                                 top_k=top_k)
        except ServedError as error:
            answers, reason = error.answers, error.reason
        sent = iter(answers)
        merged = [NOTHING_SCORED if i in empty else next(sent) for i in range(len(requests))]
        if reason:
            raise failed(merged, reason)
        return merged

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        return self.reader.trace(requests, top_k)

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        """Through vLLM's fields, next-token reads of the asked ids (served/id_reads.py); through the OpenAI API
        alone, NotImplementedError: it has no way to ask for given ids."""
        return self.reader.read_ids(reads)

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

