"""One vLLM engine from a run's config, on this machine (or in a data-parallel actor).

The settings evalkit.engine.machine.tuning fills in for this machine are applied here and printed once.
"""

from __future__ import annotations

import sys
from typing import Any

from evalkit.config import EvalConfig
from evalkit.contracts import Engine
from evalkit.engine.machine import tuning


def start_vllm(cfg: EvalConfig, model_dir: str, *, sole_engine: bool = False) -> Engine:
    """The vLLM engine for cfg, with the settings evalkit.engine.machine.tuning fills in for this machine (printed once).

    sole_engine: no other engine will live in this process (a run's try), so vLLM may run inside it."""
    from evalkit.engine.vllm.engine import VLLMEngine

    choices = tuning.choices_for(cfg, model_dir, sole_engine=sole_engine)
    engine_kwargs, env = tuning.apply(choices, {**parallel_kwargs(cfg), **cfg.engine_kwargs})
    if cfg.distributed_executor_backend == "ray" and cfg.cluster.address:
        env["RAY_ADDRESS"] = cfg.cluster.address  # where vLLM's Ray executor connects
    env.update(invariance_env(cfg))
    for choice in choices:
        print(choice.line(), file=sys.stderr, flush=True)
    with tuning.environment(env):
        return VLLMEngine(
            model=model_dir, tokenizer=cfg.tokenizer, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
            max_num_seqs=cfg.batch_size, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code,
            add_bos_token=cfg.add_bos_token, engine_kwargs=engine_kwargs, choices=choices,
        )


def invariance_env(cfg: EvalConfig) -> dict[str, str]:
    """batch_invariant=true: vLLM's batch-invariant kernels, read by the engine's processes from the environment
    they start under (recorded and hashed with the engine's VLLM_* variables)."""
    return {"VLLM_BATCH_INVARIANT": "1"} if cfg.batch_invariant else {}


def parallel_kwargs(cfg: EvalConfig) -> dict[str, Any]:
    """vLLM's own parallelism beyond tensor_parallel_size, passed only where it differs from vLLM's default."""
    kwargs: dict[str, Any] = {}
    if cfg.pipeline_parallel_size != 1:
        kwargs["pipeline_parallel_size"] = cfg.pipeline_parallel_size
    if cfg.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = cfg.distributed_executor_backend
    return kwargs
