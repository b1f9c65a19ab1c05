"""lm-eval's generation requests as engine requests, and the engine's generations as lm-eval's answers.

A task's own generation settings pass through lm-eval's ``normalize_gen_kwargs``, as lm-eval's ``vllm`` backend
(0.4.13) passes them; the decoded EOS joins the stop strings; each request gets its length budget
(``budget.plan_generation``) and, where it samples without a seed of its own, a seed of its own
(:func:`sampled_seed`). Special tokens stay in the output text, which is cut at the stops afterwards, past a
reasoning section where ``strip_thinking`` is on.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from evalkit.contracts import Generation, GenRequest, RequestRecord
from evalkit.harness.budget import plan_generation

VLLM_DEFAULT_TEMPERATURE = 1.0  # vllm.SamplingParams' temperature when none is given

# What lm-eval's vllm backend adds to every generation's SamplingParams (its "HF defaults").
OUTPUT_DEFAULTS = {"skip_special_tokens": False, "spaces_between_special_tokens": False}


def strip_thinking(text: str, end_marker: str) -> str:
    """The answer after a reasoning section: text after the last end marker.

    Without an end marker, text that opened a reasoning section never reached its answer (cut off by
    the token limit), so nothing is left to score; text that never opened one is kept whole.
    """
    if end_marker in text:
        return text.rsplit(end_marker, 1)[1].lstrip()
    start_marker = end_marker.replace("</", "<", 1)
    return "" if start_marker != end_marker and start_marker in text else text


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


@dataclass(frozen=True)
class Planned:
    """One batch of generation requests: what the engine is sent, each request's record and its task's stops."""

    requests: list[GenRequest]
    records: list[RequestRecord]
    stops: list[list[str]]  # the task's stop strings, applied to the answer after the engine's stop


class Generations:
    """A run's generation requests: planned from lm-eval's instances with the run's settings, seeded by the
    run's seed, and tallied by the settings the engine received (``effective_sampling``)."""

    def __init__(self, *, max_tokens: int, temperature: float | None = None,
                 sampling_kwargs: dict[str, Any] | None = None, min_gen_tokens: int = 1, overflow: str = "fail",
                 strip_thinking: bool = False, thinking_end: str = "</think>", seed: int = 0) -> None:
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.sampling_kwargs = dict(sampling_kwargs or {})
        self.min_gen_tokens = min_gen_tokens
        self.overflow = overflow
        self.strip_thinking = strip_thinking
        self.thinking_end = thinking_end
        self.seed = seed  # every sampled request's own seed derives from it (sampled_seed)
        self._draws: Counter[str] = Counter()  # sampled requests seen so far in this run, by content
        self.sampling: dict[str, dict[str, int]] = defaultdict(Counter)  # task -> effective settings -> requests

    def plan(self, instances: Sequence[Any], *, encode: Callable[[str], list[int]], eos: str,
             max_model_len: int) -> Planned:
        """Each instance's (context, gen_kwargs) as an engine request, in order; encode: lm-eval's tok_encode."""
        planned = Planned(requests=[], records=[], stops=[])
        for instance in instances:
            context, gen_kwargs = instance.args
            settings, until, requested = generation_settings(
                gen_kwargs, eos=eos, max_tokens=self.max_tokens, temperature=self.temperature,
                sampling_kwargs=self.sampling_kwargs)
            ids = encode(context)
            plan = plan_generation(prompt_tokens=len(ids), requested=requested, max_model_len=max_model_len,
                                   min_gen_tokens=self.min_gen_tokens, overflow=self.overflow)
            # A reasoning model writes the task's stops (often "\n\n") inside its thinking section: stop
            # only at EOS then, and apply the task's stops to the answer once the thinking is removed.
            engine_stop = [s for s in until if s == eos] if self.strip_thinking else until
            request = GenRequest(prompt_ids=tuple(ids[plan.keep_from:]), max_tokens=plan.max_tokens,
                                 stop=tuple(engine_stop), sampling=tuple(sorted(settings.items())))
            if not request.greedy and "seed" not in settings:
                request = self.seeded(request)
            planned.requests.append(request)
            self.sampling[instance.task_name][json.dumps(
                {k: v for k, v in request.sampling if k != "seed"}, sort_keys=True)] += 1
            planned.records.append(RequestRecord(
                kind="generate_until", prompt_tokens=len(ids) - plan.keep_from, requested_max_tokens=requested,
                max_tokens=plan.max_tokens, clamped=plan.clamped, truncated_tokens=plan.truncated))
            planned.stops.append(until)
        return planned

    def answer(self, record: RequestRecord, until: list[str], generation: Generation) -> str:
        """lm-eval's answer from the engine's generation (cut at the task's stops, past the reasoning where
        strip_thinking is on), with the generation written to its record."""
        record.raw_output = generation.text
        record.finish_reason = generation.finish_reason
        record.output_tokens = generation.output_tokens
        record.output_ids = list(generation.token_ids)
        text = strip_thinking(generation.text, self.thinking_end) if self.strip_thinking else generation.text
        return postprocess_generated_text(text, until, None)

    def seeded(self, request: GenRequest) -> GenRequest:
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
