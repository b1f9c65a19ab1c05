"""Engines around an engine: the explicit pass-through every wrapper builds on, an engine kept running after a
run's close() for the next run, and one started only when a call needs it.

A wrapper (the request store, an engine kept running, the benchmark's recorder) changes one or two members of the
Engine contract and passes the rest through. :class:`Wrapped` writes that pass-through out once, member by
member (no ``__getattr__`` forwarding, which would hide what a wrapper does), and a wrapper overrides only what it
changes.
tests/test_contracts.py checks that Wrapped defines every member of the contract, so a new one cannot be
forgotten here and silently missing from every wrapper.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

from evalkit.contracts import Engine, Generation, GenRequest, IdsRead, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.tokenizer import TokenizerSide


class Wrapped:
    """The Engine contract around ``self.engine``: every member goes to the engine unchanged."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def logits_dtype(self) -> str:
        return self.engine.logits_dtype

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.engine.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self.engine.decode(ids)

    def prefix_token_id(self) -> int:
        return self.engine.prefix_token_id()

    def eos_token_id(self) -> int:
        return self.engine.eos_token_id()

    def chat_template(self) -> str | None:
        return self.engine.chat_template()

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.engine.chat_prompt(messages, add_generation_prompt)

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *,
                 top_k: int = 0) -> list[Generation]:
        return self.engine.generate(requests, progress, top_k=top_k)

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True, top_k: int = 0) -> list[Scored]:
        return self.engine.score(requests, progress, fast=fast, top_k=top_k)

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        return self.engine.trace(requests, top_k)

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        return self.engine.read_ids(reads)

    def scoring_counts(self) -> dict[str, int]:
        return self.engine.scoring_counts()

    def describe(self) -> dict[str, Any]:
        return self.engine.describe()

    def close(self) -> None:
        self.engine.close()


class KeptRunning(Wrapped):
    """An engine shared by several runs (a noise measurement, a test session, a benchmark): every call goes to the
    engine, but a run's close() leaves it running for the next run. Scoring counts are the engine's, so a run
    records the difference over its own calls."""

    def close(self) -> None:
        pass  # whoever started the engine closes it


class Deferred(TokenizerSide):
    """An engine started only when a call needs it: a rerun whose every answer is in the request store
    (evalkit.store.replay found the earlier run of its config) asks its engine nothing, and would spend most of
    its time importing vLLM and starting one. Until then the tokenizer half is served by the tokenizer lm-eval's
    vllm backend uses, loaded with transformers alone (what vLLM's get_tokenizer gives: engine/tokenizer.py), and
    describe() by the description an engine here would give; the first generate, score, trace or ids read
    starts the engine (start) and everything goes to it from then on."""

    def __init__(self, start: Callable[[], Engine], *, description: dict[str, Any], tokenizer: Any,
                 max_model_len: int, trust_remote_code: bool) -> None:
        self.start, self.description, self.tokenizer = start, description, tokenizer
        self.max_model_len, self.trust_remote_code = max_model_len, trust_remote_code
        self.logits_dtype = str(description["logits_dtype"])
        self.engine: Engine | None = None

    def started(self) -> Engine:
        if self.engine is None:
            print("evalkit: an answer is not in the request store: starting the engine", file=sys.stderr, flush=True)
            self.engine = self.start()
        return self.engine

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *,
                 top_k: int = 0) -> list[Generation]:
        return self.started().generate(requests, progress, top_k=top_k)

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True, top_k: int = 0) -> list[Scored]:
        return self.started().score(requests, progress, fast=fast, top_k=top_k)

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        return self.started().trace(requests, top_k)

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        return self.started().read_ids(reads)

    def scoring_counts(self) -> dict[str, int]:
        return self.engine.scoring_counts() if self.engine is not None else {}

    def describe(self) -> dict[str, Any]:
        """The engine's own description once it started; until then the one it would give, marked not started."""
        return self.engine.describe() if self.engine is not None else {**self.description, "started": False}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
