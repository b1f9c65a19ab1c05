"""Turns lm-eval's requests into engine calls: lm-eval's ``LM`` interface on an evalkit engine
(:class:`~evalkit.contracts.Engine`).

Prompts and outputs are built as lm-eval's own ``vllm`` backend (0.4.13) builds them: text is encoded with
the tokenizer's default special tokens (BOS for Llama, Mistral, Gemma) unless it already starts with the
BOS text, or as ``add_bos_token`` forces; (context, continuation) pairs are encoded as ``TemplateLM`` encodes them (``lm_eval_compat.py``) with
its empty-context rule; a task's own generation settings pass through lm-eval's ``normalize_gen_kwargs``;
the decoded EOS joins the stop strings; special tokens stay in the output text, which is cut at the stops
afterwards. Where evalkit departs from that backend on purpose (the length budget, the ``max_tokens``
ceiling, unfinished reasoning), the README says so ("Differences from lm-eval").

Every request goes through the length budget (``budget.py``) and leaves a :class:`RequestRecord`, which the
results stage merges into the per-sample output: raw text, finish reason, token counts, clamps, truncations.
With ``divergence_top_k`` > 0, each engine call also asks for the traces of what it scores or generates
(``divergence_traces.py``: in the same pass where the engine can), kept on the records for the divergence record.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import time
from collections import Counter, defaultdict
from typing import Any, Callable

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from evalkit.harness.budget import plan_generation, plan_score
from evalkit.contracts import Engine, GenRequest, IdsRead, RequestProgress, RequestRecord, ScoreRequest, TokenTrace
from evalkit.harness.lm_eval_compat import encode_pairs
from evalkit.harness.divergence_traces import (Item, ReferenceIds, TraceError, TraceLog, given_traces, keep,
                                               outputs, reference_reads, scored_positions, with_given)


def strip_thinking(text: str, end_marker: str) -> str:
    """The answer after a reasoning section: text after the last end marker.

    Without an end marker, text that opened a reasoning section never reached its answer (cut off by
    the token limit), so nothing is left to score; text that never opened one is kept whole.
    """
    if end_marker in text:
        return text.rsplit(end_marker, 1)[1].lstrip()
    start_marker = end_marker.replace("</", "<", 1)
    return "" if start_marker != end_marker and start_marker in text else text


VLLM_DEFAULT_TEMPERATURE = 1.0  # vllm.SamplingParams' temperature when none is given

# What lm-eval's vllm backend adds to every generation's SamplingParams (its "HF defaults").
OUTPUT_DEFAULTS = {"skip_special_tokens": False, "spaces_between_special_tokens": False}


def generation_settings(gen_kwargs: dict[str, Any], *, eos: str | None, max_tokens: int,
                        temperature: float | None = None,
                        sampling_kwargs: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str], int]:
    """(SamplingParams settings, stop strings, new-token ceiling) for one request's gen_kwargs.

    As lm-eval's ``VLLM.modify_gen_kwargs`` with ``max_gen_toks=max_tokens``: a task's ``do_sample``,
    ``temperature``, ``top_p``, ... and its ``max_gen_toks`` (or an alias) pass through; ``max_tokens`` also
    caps a task that asks for more. Then evalkit's explicit overrides: ``sampling_kwargs``, and
    ``temperature`` when it is not None.
    """
    settings = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=max_tokens))
    until = handle_stop_sequences(settings.pop("until", None), eos=eos)
    requested = min(int(settings.pop("max_gen_toks")), max_tokens)
    if "temperature" not in settings:
        # normalize_gen_kwargs documents greedy (0.0) for a task that sets neither do_sample nor temperature, but
        # leaves the key out, so vLLM would sample at its default 1.0: evalkit sends what it means, either way.
        settings["temperature"] = VLLM_DEFAULT_TEMPERATURE if settings.get("do_sample") else 0.0
    settings.pop("do_sample", None)
    settings = OUTPUT_DEFAULTS | settings | dict(sampling_kwargs or {})
    if temperature is not None:
        settings["temperature"] = temperature
    return settings, until, requested


def sampled_seed(seed: int, content: str, draw: int) -> int:
    """A 31-bit seed for draw number draw (from 1) of a request whose content is given."""
    digest = hashlib.sha256(f"{seed}\n{draw}\n{content}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


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
        progress: Callable[[str, int], RequestProgress] | None = None,
        divergence_top_k: int = 0,
        reference: ReferenceIds | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.model_name = model_name
        self.max_tokens = max_tokens
        self.add_bos_token = add_bos_token
        self.temperature = temperature
        self.sampling_kwargs = dict(sampling_kwargs or {})
        self.min_gen_tokens = min_gen_tokens
        self.overflow = overflow
        self.strip_thinking = strip_thinking
        self.thinking_end = thinking_end
        self.order_seed = order_seed
        self.fast_scoring = fast_scoring  # passed to every engine.score call
        self.seed = seed  # every sampled request's own seed derives from it (sampled_seed)
        self._draws: Counter[str] = Counter()  # sampled requests seen so far in this run, by content
        self.sampling: dict[str, dict[str, int]] = defaultdict(Counter)  # task -> effective settings -> requests
        # (task, doc_id) -> records of that document's requests, in request order
        self.records: dict[tuple[str, int], list[RequestRecord]] = defaultdict(list)
        self.progress = progress  # opens the progress of one engine call: (request kind, requests); None: silent
        self.engine_seconds: dict[str, float] = {}  # wall time of the engine calls, per request kind
        self.divergence_top_k = divergence_top_k  # top entries traced at each scored position; 0: no traces
        self.traces = TraceLog(divergence_top_k, dtype=engine.logits_dtype)
        self.reference = reference  # a reference run's top ids per position, read where the trace left them out

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

    def _submit(self, call: Callable[..., list], items: list, label: str) -> list:
        """call(items), with one progress line for them, in an order shuffled by order_seed when set: batches
        then hold other neighbours, which is how the run-to-run noise of the engine is measured (evalkit.compare.noise)."""
        progress = self.progress(label, len(items)) if self.progress else None
        order = list(range(len(items)))
        if self.order_seed is not None:
            random.Random(self.order_seed).shuffle(order)
        started = time.perf_counter()
        answers = call([items[i] for i in order], progress)
        self.engine_seconds[label] = round(self.engine_seconds.get(label, 0.0) + time.perf_counter() - started, 3)
        if progress:
            progress.close()
        result: list = [None] * len(items)
        for position, answer in zip(order, answers):
            result[position] = answer
        return result

    def _score(self, requests: list[ScoreRequest], progress: RequestProgress | None) -> list:
        return self.engine.score(requests, progress, fast=self.fast_scoring, top_k=self.divergence_top_k)

    def _record(self, instance: Any, record: RequestRecord) -> None:
        self.records[(instance.task_name, instance.doc_id)].append(record)

    def _trace(self, kind: str, items: list[Item], given: dict[ScoreRequest, TokenTrace]) -> None:
        """With divergence_top_k > 0: the items' traces, checked and kept on the records (divergence_traces.keep). given
        holds those the engine answered in the same pass as the scores or generations; the others are traced in
        one more call (each distinct request once, in _submit's order, so a noise run's traces see other
        batches too)."""
        k = self.divergence_top_k
        items = [item for item in items if scored_positions(item[2])]  # an empty continuation has no position
        if not k or not items:
            return
        traced = {request: given[request] for _, _, request, _ in items if request in given}
        distinct = list(dict.fromkeys(request for _, _, request, _ in items if request not in traced))

        def call(requests: list[ScoreRequest], progress: RequestProgress | None) -> list:
            answers = self.engine.trace(requests, k)
            if len(answers) != len(requests):
                raise TraceError(f"the engine answered {len(answers)} traces for {len(requests)} {kind} requests")
            if progress:
                progress.advance(len(requests), sum(len(r.ids) for r in requests))
            return answers

        if distinct:
            traced.update(zip(distinct, self._submit(call, distinct, f"trace_{kind}")))
        self.traces.second_pass[kind] += len(distinct)
        if self.reference is not None and not self.traces.reference_not_read:
            traced = self._read_reference(kind, traced)
        keep(kind, items, traced, self.traces)

    def _read_reference(self, kind: str, traced: dict[ScoreRequest, TokenTrace]) -> dict[ScoreRequest, TokenTrace]:
        """The traces with the reference's top ids they left out read apart (Engine.read_ids), each distinct
        read once, in _submit's order; unchanged where the engine cannot read given ids (said in the summary)."""
        asks = reference_reads(traced, self.reference, self.traces)
        reads = list(dict.fromkeys(read for per in asks.values() for read in per if read is not None))

        def call(batch: list[IdsRead], progress: RequestProgress | None) -> list:
            answers = self.engine.read_ids(batch)
            if len(answers) != len(batch):
                raise TraceError(f"the engine answered {len(answers)} id reads for {len(batch)} asked")
            if progress:
                progress.advance(len(batch), sum(len(r.context) for r in batch))
            return answers

        try:
            answers = dict(zip(reads, self._submit(call, reads, f"reference_{kind}"))) if reads else {}
        except NotImplementedError as error:
            self.traces.reference_not_read = str(error)
            return traced
        self.traces.reference["reads"] += len(reads)
        self.traces.reference["ids_read"] += sum(len(r.ids) for r in reads)
        return with_given(traced, asks, answers, dtype=self.traces.dtype)

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
        scores, records = [], []
        for i, (_, context_enc, continuation_enc) in enumerate(pairs):
            drop = plan_score(context_tokens=len(context_enc), continuation_tokens=len(continuation_enc),
                              max_model_len=self.engine.max_model_len, overflow=self.overflow)
            ids = tuple(context_enc[drop:]) + tuple(continuation_enc)
            scores.append(ScoreRequest(ids=ids, start=len(context_enc) - drop))
            if instances is not None:
                records.append(RequestRecord(kind="loglikelihood", prompt_tokens=len(ids), truncated_tokens=drop,
                                             extra={"continuation_tokens": len(continuation_enc)}))
                self._record(instances[i], records[-1])
        answers = self._submit(self._score, scores, "loglikelihood")
        if instances is not None and self.divergence_top_k:
            self._trace("loglikelihood", list(zip(records, [i.idx for i in instances], scores, answers)),
                        given_traces(scores, answers))
        return [(s.logprob, s.is_greedy) for s in answers]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity-style scoring: the whole text (with the tokenizer's default special tokens, so a BOS
        is scored too) in disjoint windows of max_model_len - 2 tokens, as lm-eval's vllm backend cuts them
        (its hf backend uses windows of max_length)."""
        windows: list[ScoreRequest] = []
        owners: list[int] = []
        numbers: list[int] = []  # each window's number in its document: its request in the divergence record
        records = []
        for n, instance in enumerate(requests):
            (text,) = instance.args
            tokens = self.tok_encode(text)
            for w, (context, continuation) in enumerate(map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id,
                    max_seq_len=self.engine.max_model_len - 2, context_len=1))):
                windows.append(ScoreRequest(ids=tuple(context) + tuple(continuation), start=len(context)))
                owners.append(n)
                numbers.append(w)
            records.append(RequestRecord(kind="loglikelihood_rolling", prompt_tokens=len(tokens),
                                         extra={"windows": owners.count(n)}))
            self._record(instance, records[-1])
        totals = [0.0] * len(requests)
        answers = self._submit(self._score, windows, "loglikelihood_rolling")
        for n, scored in zip(owners, answers):
            totals[n] += scored.logprob
        self._trace("loglikelihood_rolling", [(records[n], w, window, scored) for n, w, window, scored
                                              in zip(owners, numbers, windows, answers)],
                    given_traces(windows, answers))
        return totals

    # --- generation ---
    def _seeded(self, request: GenRequest) -> GenRequest:
        """The request with its own seed: a function of the run's seed, the request and how many identical
        requests came before it in this run (a task's ``repeats`` draws distinct samples). So a draw depends
        on nothing else evalkit chooses: not on batch order, the engine's process, nor a data-parallel shard."""
        content = json.dumps([request.prompt_ids, request.max_tokens, request.stop, request.sampling], default=str)
        self._draws[content] += 1
        seed = sampled_seed(self.seed, content, self._draws[content])
        return GenRequest(prompt_ids=request.prompt_ids, max_tokens=request.max_tokens, stop=request.stop,
                          sampling=tuple(sorted((*request.sampling, ("seed", seed)))))

    def effective_sampling(self) -> dict[str, list[dict[str, Any]]]:
        """For results.json: each task's generation settings as the engine received them (seeds aside), with
        how many requests had each."""
        return {task: [{"settings": json.loads(k), "requests": n} for k, n in sorted(found.items())]
                for task, found in self.sampling.items()}

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.engine.decode([self.eot_token_id])
        batch: list[GenRequest] = []
        records: list[RequestRecord] = []
        stops: list[list[str]] = []
        for instance in requests:
            context, gen_kwargs = instance.args
            settings, until, requested = generation_settings(
                gen_kwargs, eos=eos, max_tokens=self.max_tokens, temperature=self.temperature,
                sampling_kwargs=self.sampling_kwargs)
            ids = self.tok_encode(context)
            plan = plan_generation(prompt_tokens=len(ids), requested=requested,
                                   max_model_len=self.engine.max_model_len,
                                   min_gen_tokens=self.min_gen_tokens, overflow=self.overflow)
            # A reasoning model writes the task's stops (often "\n\n") inside its thinking section: stop
            # only at EOS then, and apply the task's stops to the answer once the thinking is removed.
            engine_stop = [s for s in until if s == eos] if self.strip_thinking else until
            request = GenRequest(prompt_ids=tuple(ids[plan.keep_from:]), max_tokens=plan.max_tokens,
                                 stop=tuple(engine_stop), sampling=tuple(sorted(settings.items())))
            if not request.greedy and "seed" not in settings:
                request = self._seeded(request)
            batch.append(request)
            self.sampling[instance.task_name][json.dumps(
                {k: v for k, v in request.sampling if k != "seed"}, sort_keys=True)] += 1
            records.append(RequestRecord(kind="generate_until", prompt_tokens=len(ids) - plan.keep_from,
                                         requested_max_tokens=requested, max_tokens=plan.max_tokens,
                                         clamped=plan.clamped, truncated_tokens=plan.truncated))
            stops.append(until)
        answers = []
        generations = self._submit(functools.partial(self.engine.generate, top_k=self.divergence_top_k), batch,
                                   "generate_until")
        for instance, record, until, generation in zip(requests, records, stops, generations):
            record.raw_output = generation.text
            record.finish_reason = generation.finish_reason
            record.output_tokens = generation.output_tokens
            record.output_ids = list(generation.token_ids)
            self._record(instance, record)
            text = strip_thinking(generation.text, self.thinking_end) if self.strip_thinking else generation.text
            answers.append(postprocess_generated_text(text, until, None))
        if self.divergence_top_k:
            self._trace("generate_until", *outputs(requests, records, batch, generations,
                                                   max_model_len=self.engine.max_model_len, log=self.traces))
        return answers
