"""A deterministic stand-in engine for unit tests of evalkit's own logic (budgets, records, results files).

It never stands in where evalkit claims real engine behaviour: those tests use vLLM (tests/engine/vllm/test_engine.py).
Tokens are characters (id = code point), so token counts are easy to reason about in tests.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from evalkit.contracts import Generation, GenRequest, IdsRead, Scored, ScoreRequest, TokenTrace

BOS, EOS = 1, 2


class FakeEngine:
    def __init__(self, max_model_len: int = 4096, reply: str | None = None, adds_bos: bool = False,
                 traces_in_pass: bool = False) -> None:
        self.max_model_len = max_model_len
        self.logits_dtype = "float32"  # its values are exact: any rounding between two calls is a fault
        # asked with top_k > 0, answer the traces with the scores and greedy generations (one pass), as vLLM does;
        # off by default: the harness then traces in a call of its own, as for an engine that cannot
        self.traces_in_pass = traces_in_pass
        self.adds_bos = adds_bos  # with special tokens, encode() puts BOS first, as a Llama tokenizer does
        self.reply = reply  # fixed generation text; None answers the last "What is a op b?" correctly
        self.generated: list[GenRequest] = []
        self.scored: list[ScoreRequest] = []
        self.id_reads: list[IdsRead] = []
        self.closed = False

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return ([BOS] if add_special_tokens and self.adds_bos else []) + [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    def prefix_token_id(self) -> int:
        return BOS

    def eos_token_id(self) -> int:
        return EOS

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def chat_template(self) -> str | None:
        return None

    def _answer(self, prompt: str) -> str:
        if self.reply is not None:
            return self.reply
        asked = re.findall(r"What is (\d+) ([+-]) (\d+)\?", prompt)
        if not asked:
            return " I do not know."
        a, op, b = asked[-1]
        return f" {int(a) + int(b) if op == '+' else int(a) - int(b)}\nQuestion: more"

    def generate(self, requests: Sequence[GenRequest], progress=None, *, top_k: int = 0) -> list[Generation]:
        self.generated.extend(requests)
        out = []
        for r in requests:
            text = self._answer(self.decode(r.prompt_ids))
            cut = min((text.find(s) for s in r.stop if s in text), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
            else:
                reason = "stop"
            if len(text) > r.max_tokens:
                text, reason = text[: r.max_tokens], "length"
            ids = tuple(self.encode(text))
            steps = self._steps(ids, top_k) if top_k and self.traces_in_pass and r.greedy else None
            out.append(Generation(text=text, finish_reason=reason, output_tokens=len(text), token_ids=ids,
                                  trace=steps))
        return out

    def score(self, requests: Sequence[ScoreRequest], progress=None, *, fast: bool = True,
              top_k: int = 0) -> list[Scored]:
        """Log-probability -0.1 per scored token, -0.05 for vowels: short, vowel-rich answers win."""
        self.scored.extend(requests)
        out = []
        for r in requests:
            tokens = r.ids[r.start:]
            logprob = sum(-0.05 if chr(t) in "aeiou" else -0.1 for t in tokens)
            traced = top_k and self.traces_in_pass and len(r.ids) > max(r.start, 1)  # an empty one has no position
            out.append(Scored(logprob=logprob, is_greedy=len(tokens) == 1,
                              trace=self._steps(r.ids[max(r.start, 1):], top_k) if traced else None))
        return out

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        """Each scored token at its own score, ranked first; runner-up: the next code point, 4.0 lower (the two
        hold less than all the probability, as a distribution's entries do)."""
        return [self._steps(r.ids[max(r.start, 1):], top_k) for r in requests]

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        """An id read apart is one no top list holds first, so it reads below every runner-up (-4.1 and lower):
        -5 less a hundredth per id modulo 50, whatever the context."""
        self.id_reads.extend(reads)
        return [tuple(-5.0 - 0.01 * (t % 50) for t in r.ids) for r in reads]

    @staticmethod
    def _steps(tokens: Sequence[int], top_k: int) -> TokenTrace:
        logprobs = tuple(-0.05 if chr(t) in "aeiou" else -0.1 for t in tokens)
        top = tuple(((t, lp), (t + 1, lp - 4.0))[:top_k] for t, lp in zip(tokens, logprobs))
        return TokenTrace(logprobs=logprobs, top=top)

    def scoring_counts(self) -> dict[str, int]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"engine_args": {"model": "fake", "max_model_len": self.max_model_len}, "versions": {}, "hardware": {}}

    def close(self) -> None:
        self.closed = True
