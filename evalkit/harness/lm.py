"""Turns lm-eval's requests into engine calls: lm-eval's ``LM`` interface on an evalkit engine
(:class:`~evalkit.contracts.Engine`), a thin face over the parts that plan and trace them.

Prompts and outputs are built as lm-eval's own ``vllm`` backend (0.4.13) builds them: text is encoded with
the tokenizer's default special tokens (BOS for Llama, Mistral, Gemma) unless it already starts with the
BOS text, or as ``add_bos_token`` forces; (context, continuation) pairs are encoded as ``TemplateLM`` encodes
them (``lm_eval_compat.py``) with its empty-context rule. Where evalkit departs from that backend on purpose
(the length budget, the ``max_tokens`` ceiling, unfinished reasoning), docs/differences-from-lm-eval.md says
so.

The parts: ``loglikelihood.py`` (pairs and rolling windows as score requests), ``generate_until.py`` (generation
requests, their settings, seeds and answers), ``calls.py`` (each engine call in the run's order, timed) and,
with ``divergence_top_k`` > 0, ``trace_calls.py`` (the traces of what each call scores or generates, in the same
pass where the engine can, kept on the records for the divergence record). Every request goes through the
length budget (``budget.py``) and leaves a :class:`RequestRecord`, which the results stage merges into the
per-sample output: raw text, finish reason, token counts, clamps, truncations.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

from lm_eval.api.model import TemplateLM

from evalkit.contracts import Engine, RequestRecord, ScoreRequest
from evalkit.harness.calls import Calls, OpenProgress
from evalkit.harness.divergence_traces import ReferenceIds, TraceLog, given_traces, outputs
from evalkit.harness.generate_until import Generations
from evalkit.harness.lm_eval_compat import encode_pairs
from evalkit.harness.loglikelihood import pair_requests, rolling_windows
from evalkit.harness.trace_calls import Tracer


class EvalkitLM(TemplateLM):
    """One engine shared by every task of a run, seen by lm-eval as an ``LM``."""

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        max_tokens: int,
        add_bos_token: bool | None = None,
        temperature: float | None = None,
        sampling_kwargs: dict[str, Any] | None = None,
        min_gen_tokens: int = 1,
        overflow: str = "fail",
        strip_thinking: bool = False,
        thinking_end: str = "</think>",
        order_seed: int | None = None,
        fast_scoring: bool = True,
        seed: int = 0,
        progress: OpenProgress | None = None,
        divergence_top_k: int = 0,
        reference: ReferenceIds | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.model_name = model_name
        self.add_bos_token = add_bos_token
        self.overflow = overflow
        self.fast_scoring = fast_scoring  # passed to every engine.score call
        self.divergence_top_k = divergence_top_k  # top entries traced at each scored position; 0: no traces
        self.generations = Generations(max_tokens=max_tokens, temperature=temperature, sampling_kwargs=sampling_kwargs,
                                       min_gen_tokens=min_gen_tokens, overflow=overflow, strip_thinking=strip_thinking,
                                       thinking_end=thinking_end, seed=seed)
        self.calls = Calls(order_seed=order_seed, progress=progress)
        self.tracer = Tracer(engine, divergence_top_k, submit=self.calls.submit, reference=reference)
        # (task, doc_id) -> records of that document's requests, in request order
        self.records: dict[tuple[str, int], list[RequestRecord]] = defaultdict(list)

    @property
    def engine_seconds(self) -> dict[str, float]:
        """Wall time of the engine calls, per request kind."""
        return self.calls.seconds

    @property
    def traces(self) -> TraceLog:
        """What the run's traces did, for results.json."""
        return self.tracer.log

    def effective_sampling(self) -> dict[str, list[dict[str, Any]]]:
        return self.generations.effective_sampling()

    @functools.cached_property
    def _bos_text(self) -> str:
        return self.engine.decode([self.prefix_token_id])

    # --- what lm-eval asks of a model ---
    @property
    def eot_token_id(self) -> int:
        return self.engine.eos_token_id()

    @property
    def prefix_token_id(self) -> int:
        return self.engine.prefix_token_id()

    @property
    def tokenizer_name(self) -> str:
        return self.model_name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """lm-eval's rule: the tokenizer's default special tokens (or add_bos_token when set), none for
        text that already starts with the BOS text (a chat template's output), none for empty text."""
        if not string:
            return []
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if string.startswith(self._bos_text):
            add_special_tokens = False
        return self.engine.encode(string, add_special_tokens=True if add_special_tokens is None else add_special_tokens)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.engine.chat_template() if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.engine.chat_prompt(chat_history, add_generation_prompt)

    def _score(self, requests: list[ScoreRequest], progress: Any) -> list:
        return self.engine.score(requests, progress, fast=self.fast_scoring, top_k=self.divergence_top_k)

    def _record(self, instance: Any, record: RequestRecord) -> None:
        self.records[(instance.task_name, instance.doc_id)].append(record)

    # --- log-likelihood ---
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Each (context, continuation) encoded as TemplateLM.loglikelihood encodes it, scored with its record."""
        return self._score_pairs(encode_pairs(self, requests), instances=requests)

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        """lm-eval's entry for pairs it encoded itself: scored without per-sample records (no instances)."""
        return self._score_pairs(requests, instances=None)

    def _score_pairs(self, pairs: list, *, instances: list | None) -> list[tuple[float, bool]]:
        """pairs: ((context, continuation), context ids, continuation ids); instances: the lm-eval requests they
        came from, one each, whose records are kept."""
        scores, records = pair_requests(pairs, max_model_len=self.engine.max_model_len, overflow=self.overflow)
        for instance, record in zip(instances or (), records):
            self._record(instance, record)
        answers = self.calls.submit(self._score, scores, "loglikelihood")
        if instances is not None and self.divergence_top_k:
            self.tracer.trace("loglikelihood", list(zip(records, [i.idx for i in instances], scores, answers)),
                              given_traces(scores, answers))
        return [(s.logprob, s.is_greedy) for s in answers]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity-style scoring: the whole text in disjoint windows (loglikelihood.rolling_windows)."""
        windows = rolling_windows([self.tok_encode(text) for (text,) in (i.args for i in requests)],
                                  prefix_token=self.prefix_token_id, max_model_len=self.engine.max_model_len)
        for instance, record in zip(requests, windows.records):
            self._record(instance, record)
        answers = self.calls.submit(self._score, windows.requests, "loglikelihood_rolling")
        self.tracer.trace("loglikelihood_rolling", windows.items(answers), given_traces(windows.requests, answers))
        return windows.totals(answers)

    # --- generation ---
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        planned = self.generations.plan(requests, encode=self.tok_encode, eos=self.engine.decode([self.eot_token_id]),
                                        max_model_len=self.engine.max_model_len)
        generations = self.calls.submit(functools.partial(self.engine.generate, top_k=self.divergence_top_k),
                                        planned.requests, "generate_until")
        answers = []
        for instance, record, until, generation in zip(requests, planned.records, planned.stops, generations):
            self._record(instance, record)
            answers.append(self.generations.answer(record, until, generation))
        if self.divergence_top_k:
            self.tracer.trace("generate_until", *outputs(requests, planned.records, planned.requests, generations,
                                                         max_model_len=self.engine.max_model_len,
                                                         log=self.tracer.log))
        return answers
