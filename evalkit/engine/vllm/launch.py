"""vLLM's ``LLM`` started for evalkit, with what a run records of its start: the arguments it was given, the
seconds of each step, the VLLM_* environment it started under, the tokenizer lm-eval's vllm backend would use
with it, and what vLLM resolved (model runner, KV-cache block, logits dtype, scheduling). vLLM is imported here
lazily, at the start.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any

from evalkit.config import installed_vllm_build
from evalkit.engine.machine.environment import engine_environment
from evalkit.engine.tokenizer import load_tokenizer


def engine_args(*, model: str, tokenizer: str | None, dtype: str, max_model_len: int, gpu_memory_utilization: float,
                tensor_parallel_size: int, max_num_seqs: int | None, seed: int, trust_remote_code: bool,
                engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM``'s arguments: evalkit's settings (max_num_seqs only where given), then engine_kwargs over them."""
    args: dict[str, Any] = {"model": model, "tokenizer": tokenizer or model, "dtype": dtype,
                            "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization,
                            "tensor_parallel_size": tensor_parallel_size, "seed": seed,
                            "trust_remote_code": trust_remote_code}
    if max_num_seqs is not None:
        args["max_num_seqs"] = max_num_seqs
    args.update(engine_kwargs)
    return args


@dataclass(frozen=True)
class Started:
    """A started ``vllm.LLM`` and what its start recorded."""

    llm: Any
    tokenizer: Any  # what lm-eval's vllm backend would use (lm_eval_tokenizer)
    start_seconds: dict[str, float]  # each step of the start, for results.json (evalkit.timings.engine_start_stages)
    environment: dict[str, str]  # the VLLM_* variables it started under (tuning sets some only for the start)
    runner: str  # which model runner computes prompt log-probabilities: "v1" or "v2"
    token_id_scores: bool  # prompt rows also scored through vLLM's fixed-id API (token_id_scores())
    block_size: int  # KV-cache block, tokens
    logits_dtype: str  # the dtype vLLM resolved ("auto" resolved)


def start_llm(args: dict[str, Any], *, trust_remote_code: bool, add_bos_token: bool | None) -> Started:
    """``vllm.LLM(**args)`` (its configuration, model load, KV cache and warm-up: its log has each), timed."""
    clock = time.perf_counter()
    from vllm import LLM

    start_seconds = {"import_vllm": round(time.perf_counter() - clock, 3)}
    environment = engine_environment(dict(os.environ))  # a secret's name, never its value
    clock = time.perf_counter()
    # vLLM's start runs gc.collect five times (model load, its own gc.freeze): frozen first, what this
    # process already holds (vLLM, torch, lm-eval and the tasks) is not traversed again each time
    gc.freeze()
    llm = LLM(**args)
    start_seconds["engine_init"] = round(time.perf_counter() - clock, 3)
    tokenizer, seconds = lm_eval_tokenizer(llm, args, trust_remote_code=trust_remote_code,
                                           add_bos_token=add_bos_token)
    if seconds is not None:
        start_seconds["tokenizer"] = seconds
    config = llm.llm_engine.vllm_config
    # "v2" (vLLM 0.32's default wherever Triton is, so every CUDA machine) returns only the prompt rows it
    # computed; "v1" (the CPU build) one row per position. On Ascend the NPU worker runs vllm-ascend's own model
    # runner, built on V1's, whatever vLLM's config says (vLLM 0.23 reports V2 for Llama and Qwen3 there).
    v2 = getattr(config, "use_v2_model_runner", False) and installed_vllm_build() != "ascend"
    runner = "v2" if v2 else "v1"
    return Started(llm=llm, tokenizer=tokenizer, start_seconds=start_seconds, environment=environment,
                   runner=runner, token_id_scores=token_id_scores(runner),
                   block_size=int(config.cache_config.block_size),
                   logits_dtype=str(llm.llm_engine.model_config.dtype).removeprefix("torch."))


def token_id_scores(runner: str) -> bool:
    """Whether the prompt rows of a read are also scored through vLLM's fixed-id API (``prompt_logprob_start`` and
    ``prompt_logprob_token_ids``, answered in ``prompt_token_id_logprobs``): only the V2 runner reads it, and only
    a vLLM whose SamplingParams takes both fields has it (0.32; 0.23 has neither). Without it a read's values come
    from its prompt rows alone, checked as V1's are (the rows' layout is the runner's, whatever the vLLM)."""
    if runner != "v2":
        return False
    import inspect

    from vllm import SamplingParams

    return {"prompt_logprob_start", "prompt_logprob_token_ids"} <= set(inspect.signature(SamplingParams).parameters)


def lm_eval_tokenizer(llm: Any, args: dict[str, Any], *, trust_remote_code: bool, add_bos_token: bool | None
                      ) -> tuple[Any, float | None]:
    """The tokenizer lm-eval's vllm backend would use with an engine of these args, and the seconds it took to
    load (None: the engine's own, already loaded)."""
    if add_bos_token is None and not args.get("skip_tokenizer_init"):
        # the engine's own, loaded by the get_tokenizer lm-eval's vllm backend calls, from the same files
        # and settings (the engine's tokenizer_mode and revision included): a second copy cost about 1.3 s
        # of the engine's start here (docs/speed.md, Start-up)
        return llm.get_tokenizer(), None
    # lm-eval passes add_bos_token to get_tokenizer (the engine's copy was loaded without it); or none
    clock = time.perf_counter()
    tokenizer = load_tokenizer(args["tokenizer"], trust_remote_code=trust_remote_code, add_bos_token=add_bos_token)
    return tokenizer, round(time.perf_counter() - clock, 3)


def scheduling(llm: Any, environment: dict[str, str]) -> dict[str, Any] | None:
    """The batch shapes llm's vLLM chose (its defaults where evalkit passed none), and whether its batch-invariant
    kernels were on (environment: the VLLM_* variables it started under)."""
    config = getattr(llm, "llm_engine", None) and llm.llm_engine.vllm_config
    if config is None:
        return None
    return {"max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "enforce_eager": config.model_config.enforce_eager,
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
            "batch_invariant": environment.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")}
