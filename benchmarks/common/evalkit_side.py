"""evalkit's side of the benchmark: its engine wrapped by a recorder, and the raw vLLM floor it is held to.

The recorder writes down every request list evalkit hands its engine, with the answers and the seconds
each call took. The floor sends those same requests to the same ``vllm.LLM`` with nothing of evalkit in
between: generation requests with the SamplingParams evalkit's engine builds from them, scoring requests
the naive way (one ``llm.generate`` call, ``prompt_logprobs=1``, no prefix-cache reads).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from benchmarks.common import TASKS_DIR
from evalkit.contracts import Engine, Generation, GenRequest, Progress, Scored, ScoreRequest
from evalkit.engine.wrapper import Wrapped

# the one in-process engine of benchmarks.divergence_cost and trace_cost: float32, eager, a quarter of the memory
OFFLINE_SETTINGS = ["dtype=float32", "gpu_memory_utilization=0.25", "+engine_kwargs.enforce_eager=true",
                    f"tasks_dirs=[{TASKS_DIR}]"]


@dataclass
class Call:
    kind: str  # "generate" or "score"
    requests: list[Any]
    answers: list[Any]
    seconds: float


class RecordingEngine(Wrapped):
    """The Engine protocol around another engine: records generate/score calls, passes the rest through
    (Wrapped), close() included."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.calls: list[Call] = []

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *,
                 top_k: int = 0) -> list[Generation]:
        return self._timed("generate", requests, lambda: self.engine.generate(requests, progress, top_k=top_k))

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True, top_k: int = 0) -> list[Scored]:
        return self._timed("score", requests, lambda: self.engine.score(requests, progress, fast=fast, top_k=top_k))

    def _timed(self, kind: str, requests: Sequence[Any], call: Callable[[], list[Any]]) -> list[Any]:
        started = time.perf_counter()
        answers = call()
        self.calls.append(Call(kind, list(requests), list(answers), time.perf_counter() - started))
        return answers

    def take(self, kind: str) -> tuple[list[Any], list[Any], float, int]:
        """(requests, answers, seconds, calls) of one kind recorded since the last take; forgets them."""
        mine = [c for c in self.calls if c.kind == kind]
        self.calls = [c for c in self.calls if c.kind != kind]
        return ([r for c in mine for r in c.requests], [a for c in mine for a in c.answers],
                sum(c.seconds for c in mine), len(mine))


@contextlib.contextmanager
def environment_restored() -> Iterator[None]:
    """os.environ as it was, on leaving: evalkit's tuning and vLLM's CPU platform (LD_PRELOAD, ...) set variables
    when an engine starts, and the next side's engine or client must not inherit them."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def warm_up(llm: Any) -> None:
    """Two short requests (one generating, one with prompt log-probabilities), so that no timed phase pays
    for the engine's first forward passes."""
    from vllm import SamplingParams

    prompt = [{"prompt_token_ids": list(range(100, 164))}]
    llm.generate(prompt, SamplingParams(max_tokens=8), use_tqdm=False)
    llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False), use_tqdm=False)
    llm.reset_prefix_cache()


def floor_generate(llm: Any, requests: Sequence[GenRequest]) -> tuple[list[tuple[int, ...]], float]:
    """Output token ids and seconds of the generation requests in one llm.generate call, prefix cache cold."""
    from vllm import SamplingParams

    if not requests:
        return [], 0.0
    params = [SamplingParams(**dict(r.sampling), max_tokens=r.max_tokens, stop=list(r.stop) or None)
              for r in requests]
    prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
    llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return [tuple(o.outputs[0].token_ids) for o in outputs], seconds


def floor_score(llm: Any, requests: Sequence[ScoreRequest]) -> tuple[list[float], float]:
    """Log-probabilities of ids[start:] and seconds, the naive way: every prompt in full, one call."""
    from vllm import SamplingParams

    if not requests:
        return [], 0.0
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": list(r.ids)} for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return [sum(out.prompt_logprobs[p][r.ids[p]].logprob for p in range(max(r.start, 1), len(r.ids)))
            for r, out in zip(requests, outputs)], seconds


def replay_floor(llm: Any, requests: Sequence[Any], replies: Sequence[Any]) -> tuple[float, int | None, float | None]:
    """(seconds, generations identical to replies, max |log-likelihood - replies'|) of the floor replaying
    requests (all GenRequests or all ScoreRequests) that evalkit's engine answered with replies."""
    if requests and isinstance(requests[0], GenRequest):
        ids, seconds = floor_generate(llm, requests)
        return seconds, sum(tuple(r.token_ids) == i for r, i in zip(replies, ids)), None
    logprobs, seconds = floor_score(llm, requests)
    return seconds, None, max((abs(r.logprob - lp) for r, lp in zip(replies, logprobs)), default=None)
