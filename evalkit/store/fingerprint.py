"""What decides an engine's answers, as hashes: the fingerprint that names a request store, and the lock key.

:func:`fingerprint` hashes the model's files (or a hub model's commit), the settings that change outputs, the
model runner and kernel-selecting environment, the library versions, the hardware and evalkit's own answer
code. :func:`answers_key` is the coarser key the config alone decides, before the engine starts (the run lock,
evalkit/store/lock.py). Settings that only change scheduling or memory are left out of both
(``SCHEDULING_ONLY``), so the OOM back-off can resume a run under smaller settings.

The hardware in the key is what decides the numbers: on GPUs, the models of the GPUs the engine itself computes
on (``engine_gpus``, evalkit/engine/machine/gpus.py), not every GPU of the machine, so one engine with ``tensor_parallel_size=1`` on an
8-GPU machine, the same under ``CUDA_VISIBLE_DEVICES=0`` and a data-parallel actor on one such GPU share a store.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from evalkit.engine.machine.gpus import engine_gpus_of, pool_gpus
from evalkit.hashing import file_sha256, model_files, sha256

# Scheduling, not numerically neutral everywhere: on the CPU engine in float32 they move log-likelihoods by about
# 1e-5 nats (tests/store/test_scheduling.py), but on GPUs in bfloat16/float16, max_num_seqs, max_num_batched_tokens,
# enforce_eager and the data-parallel split change batch shapes, CUDA-graph padding and chunked prefill, hence
# the kernels' reduction order: answers differ in the last bits and near-ties can flip. They stay out of the key
# all the same: a store keyed on them would not make a resumed run bit-equal to an uninterrupted one (the chunks
# it reuses were batched with other requests than a fresh run would batch them with), and the OOM back-off
# would lose every answer at each step. Runs that must be bit-stable set batch_invariant=true (vLLM's
# VLLM_BATCH_INVARIANT=1, hashed with the environment), under which these settings are truly neutral; each
# stored answer records the settings of the try that computed it (store/requests.py), and the run records
# vLLM's resolved ones (VLLMEngine.describe()["scheduling"]). docs/survive.md, "No stale answer".
SCHEDULING_ONLY = {"gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "enforce_eager",
                   "swap_space", "cpu_offload_gb", "disable_log_stats", "kv_cache_memory_bytes",
                   # how the ranks of one engine are started (a data-parallel actor of TP > 1 picks "mp"): the
                   # same kernels on the same devices, so a run resumes whatever data_parallel_size
                   "distributed_executor_backend"}
# Environment variables recorded in describe() but not hashed: those that only place or time work, and those
# vLLM 0.32 sets itself from the platform and the engine's config (which the fingerprint already holds), so a
# process that started an engine before carries them (a data-parallel actor). Every other VLLM_* variable is
# hashed: they select kernels and runners (VLLM_ATTENTION_BACKEND, VLLM_USE_V2_MODEL_RUNNER,
# VLLM_BATCH_INVARIANT, ...), and one not listed here is safer hashed than not.
SCHEDULING_ENV = {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE",
                  "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_LOGGING_LEVEL",
                  "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_HOST_IP", "VLLM_PORT",
                  "VLLM_RPC_TIMEOUT", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_NO_USAGE_STATS",
                  "VLLM_DO_NOT_TRACK", "VLLM_USAGE_SOURCE", "VLLM_ENGINE_ITERATION_TIMEOUT_S",
                  "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
                  # set by vLLM itself: platforms/cpu.py, v1/worker/cpu_worker.py, v1/executor/ray_executor.py,
                  # config/vllm.py
                  "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "VLLM_SSM_CONV_STATE_LAYOUT", "VLLM_DIST_IDENT",
                  "VLLM_USE_RAY_COMPILED_DAG_CHANNEL_TYPE", "VLLM_USE_BREAKABLE_CUDAGRAPH",
                  # which of the machine's Ascend chips (the chips' models are hashed with the hardware)
                  "ASCEND_RT_VISIBLE_DEVICES"}
# The hardware facts that decide kernels; the OS release, core count and host name are recorded, not hashed. On
# GPUs the processor computes no answer: the engine's own GPUs replace the CPU's facts (engine_gpus).
CPU_KEYS = ("machine", "cpu_model", "cpu_bf16")


# evalkit's own code that shapes a request or reads the engine's answer: every module of these packages, and
# these modules. An upgrade that changes any of them may change answers, so their content is part of the
# fingerprint (tests/store/test_fingerprint.py fails when a module the run uses to build requests or read answers is not).
ANSWER_PACKAGES = ("engine", "harness")
ANSWER_MODULES = ("contracts.py", "hashing.py", "store/fingerprint.py", "store/requests.py", "run/reference.py")


def answer_code() -> list[str]:
    """The modules of the answer code, relative to the evalkit package."""
    package = Path(__file__).resolve().parent.parent
    found = {str(p.relative_to(package)) for name in ANSWER_PACKAGES for p in (package / name).rglob("*.py")}
    return sorted(found | set(ANSWER_MODULES))


def answers_key(cfg: Any) -> str:
    """12 hex digits naming the request store cfg's runs could write, before the engine starts: the settings
    of the fingerprint that the config decides (model, tokenizer, dtype, length, parallel layout, seed, engine
    arguments but the scheduling-only ones). Coarser than the fingerprint, never finer: two runs that could
    share a store share the key."""
    def folder(path: str | None) -> str | None:  # a local folder by its real path: `X`, `X/` or a link, one key
        local = os.path.expanduser(path) if path else ""
        return os.path.realpath(local) if os.path.isdir(local) else path

    engine_kwargs = {k: v for k, v in cfg.engine_kwargs.items() if k not in SCHEDULING_ONLY}
    model, tokenizer = folder(cfg.vllm_path), folder(cfg.tokenizer)
    return sha256({"engine": cfg.engine, "model": model, "tokenizer": None if tokenizer == model else tokenizer,
                   "dtype": cfg.dtype,
                   "max_model_len": cfg.max_model_len, "trust_remote_code": cfg.trust_remote_code,
                   "tensor_parallel_size": cfg.tensor_parallel_size, "seed": cfg.seed,
                   "pipeline_parallel_size": cfg.pipeline_parallel_size,
                   "batch_invariant": batch_invariant(cfg),
                   "engine_kwargs": engine_kwargs})[:12]  # the executor backend is scheduling (SCHEDULING_ONLY)


def batch_invariant(cfg: Any) -> bool:
    """Whether cfg's engine will run vLLM's batch-invariant kernels: batch_invariant=true, or VLLM_BATCH_INVARIANT set
    here (the engine inherits it; the fingerprint hashes it with the other VLLM_* variables)."""
    return bool(cfg.batch_invariant) or os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")


def code_signature() -> dict[str, str]:
    package = Path(__file__).resolve().parent.parent
    return {name: file_sha256(package / name) for name in answer_code()}


def fingerprint(model_dir: str, description: dict[str, Any]) -> str:
    """Hash of what decides an answer: model files (or a hub model's commit), output-changing settings, the
    model runner and kernel-selecting environment, library versions, the hardware that picks kernels, and
    evalkit's own request-building and answer-reading code.

    description is Engine.describe(): engine_args, model_runner, environment, versions, hardware. A served
    engine's (engine=served) is keyed on its deployment instead: the server's model root, max_model_len and
    vLLM version, with the local tokenizer that builds its prompts, never local weights the server may not share."""
    if "deployment" in description:
        return served_fingerprint(model_dir, description)
    engine_args = description.get("engine_args", {})
    settings = {k: v for k, v in engine_args.items() if k not in SCHEDULING_ONLY and k not in ("model", "tokenizer")}
    tokenizer = engine_args.get("tokenizer")
    environment = {k: v for k, v in (description.get("environment") or {}).items() if k not in SCHEDULING_ENV}
    return sha256({"engine": description.get("name", "vllm"),
                   "model": model_files(model_dir, engine_args.get("revision")),
                   "tokenizer": (model_files(tokenizer, engine_args.get("tokenizer_revision"))
                                 if tokenizer and tokenizer != model_dir else None),
                   "settings": settings, "model_runner": description.get("model_runner"),
                   "environment": environment, "versions": description.get("versions"),
                   "hardware": hardware_key(description), "code": code_signature()})


def hardware_key(description: dict[str, Any]) -> dict[str, Any]:
    """The hardware that decides an engine's numbers: its own GPUs' models in rank order (tensor x pipeline
    parallel of them), or on CPUs the processor's model and bfloat16 support. How many GPUs the machine has,
    and which of them (CUDA_VISIBLE_DEVICES), is recorded in describe() but not hashed. A data-parallel pool
    is keyed as any one of its engines, which must all run on one GPU model (:func:`pool_gpus`)."""
    hardware = description.get("hardware") or {}
    actors = (description.get("data_parallel") or {}).get("actors")
    if actors:
        pool_gpus([actor.get("engine_gpus") for actor in actors])
    gpus = engine_gpus_of(description)
    if gpus:
        return {"machine": hardware.get("machine"), "gpus": gpus}
    return {**{k: hardware.get(k) for k in CPU_KEYS}, "gpus": None}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def served_fingerprint(model_dir: str, description: dict[str, Any]) -> str:
    """The store of a served run: the deployment (a different server behind the same URL starts a new store),
    the local tokenizer files, the client's versions and evalkit's answer code. The URL, concurrency and
    timeouts only decide how answers travel."""
    engine_args = description.get("engine_args", {})
    tokenizer = engine_args.get("tokenizer") or model_dir
    root = Path(tokenizer)
    files = ({str(p.relative_to(root)): file_sha256(p) for p in sorted(root.rglob("*"))
              if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)}
             if root.is_dir() else model_files(tokenizer, engine_args.get("tokenizer_revision")))
    return sha256({"engine": "served", "deployment": description["deployment"], "tokenizer": files,
                   "versions": description.get("versions"), "code": code_signature()})
