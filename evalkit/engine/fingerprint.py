"""What decides an engine's answers, as hashes: the fingerprint that names a request store, and the lock key.

:func:`fingerprint` hashes the model's files (or a hub model's commit), the settings that change outputs, the
model runner and kernel-selecting environment, the library versions, the hardware and evalkit's own answer
code. :func:`answers_key` is the coarser key the config alone decides, before the engine starts (the run lock,
evalkit/run/lock.py). Settings that only change scheduling or memory are left out of both
(``SCHEDULING_ONLY``), so the OOM back-off can resume a run under smaller settings.

The hardware in the key is what decides the numbers: on GPUs, the models of the GPUs the engine itself computes
on (:func:`engine_gpus`), not every GPU of the machine, so one engine with ``tensor_parallel_size=1`` on an
8-GPU machine, the same under ``CUDA_VISIBLE_DEVICES=0`` and a data-parallel actor on one such GPU share a store.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

from evalkit.config import ConfigError, cache_dir

# Scheduling, not numerically neutral everywhere: on the CPU engine in float32 they move log-likelihoods by about
# 1e-5 nats (tests/test_scheduling.py), but on GPUs in bfloat16/float16, max_num_seqs, max_num_batched_tokens,
# enforce_eager and the data-parallel split change batch shapes, CUDA-graph padding and chunked prefill, hence
# the kernels' reduction order: answers differ in the last bits and near-ties can flip. They stay out of the key
# all the same: a store keyed on them would not make a resumed run bit-equal to an uninterrupted one (the chunks
# it reuses were batched with other requests than a fresh run would batch them with), and the OOM back-off
# would lose every answer at each step. Runs that must be bit-stable set batch_invariant=true (vLLM's
# VLLM_BATCH_INVARIANT=1, hashed with the environment), under which these settings are truly neutral; each
# stored answer records the settings of the try that computed it (request_store.py), and the run records
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
                  "VLLM_USE_RAY_COMPILED_DAG_CHANNEL_TYPE", "VLLM_USE_BREAKABLE_CUDAGRAPH"}
SMALL_FILE = 16 << 20  # model files up to this size are hashed on every start; larger ones once (large_file_sha256)
# The hardware facts that decide kernels; the OS release, core count and host name are recorded, not hashed. On
# GPUs the processor computes no answer: the engine's own GPUs replace the CPU's facts (engine_gpus).
CPU_KEYS = ("machine", "cpu_model", "cpu_bf16")
REMOTE_GPU = "a GPU on another node (not read)"  # a rank vLLM's Ray executor may place off this node


def sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# evalkit's own code that shapes a request or reads the engine's answer: every module of these packages, and
# these modules. An upgrade that changes any of them may change answers, so their content is part of the
# fingerprint (tests/test_fingerprint.py fails when a module the run uses to build requests or read answers is not).
ANSWER_PACKAGES = ("engine", "harness")
ANSWER_MODULES = ("contracts.py",)


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


def hub_revision(model_id: str, revision: str | None = None, cache: str | Path | None = None) -> str | None:
    """The commit a hub id resolved to, from the local hub cache that vLLM downloads into (None if absent)."""
    if revision and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision
    if cache is None:
        from huggingface_hub.constants import HF_HUB_CACHE as cache
    ref = Path(cache) / f"models--{model_id.replace('/', '--')}" / "refs" / (revision or "main")
    return ref.read_text().strip() if ref.is_file() else None


def digest_cache() -> Path:
    return cache_dir() / "file-digests.json"


def large_file_sha256(path: Path, cache: Path | None = None) -> str:
    """The content hash of a large file, computed once: kept by (path, size, mtime, inode), so a same-shape
    checkpoint copied with ``cp -p`` (same size and mtime, another inode) is hashed anew."""
    cache = cache or digest_cache()
    stat = path.stat()
    key = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino])
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = file_sha256(path)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, cache)  # another process's entries may be lost; they are recomputed, never wrong
    return known[key]


def model_files(model_dir: str, revision: str | None = None) -> dict[str, Any]:
    """A content signature of a model folder; a hub id signs as itself and the commit it resolved to."""
    root = Path(model_dir)
    if not root.is_dir():
        return {"id": model_dir, "revision": hub_revision(model_dir, revision)}
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        small = path.stat().st_size <= SMALL_FILE
        files[str(path.relative_to(root))] = file_sha256(path) if small else large_file_sha256(path)
    return files


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


def engine_gpus(visible: Sequence[str] | None, devices: int, *, remote_ranks: bool = False) -> list[str] | None:
    """The models of the GPUs one engine computes on, in rank order, from the names of the GPUs this process
    sees (CUDA_VISIBLE_DEVICES order): vLLM puts rank i of its ``devices`` (tensor x pipeline) ranks on the
    i-th of them, so the first ``devices``. In a data-parallel actor, Ray's CUDA_VISIBLE_DEVICES makes them the
    actor's own. None where no GPU is visible (a CPU engine). remote_ranks (vLLM's Ray executor): ranks past
    this node's GPUs run elsewhere, on a GPU this process cannot name; they count as REMOTE_GPU."""
    names = list(visible or [])[:devices]
    if remote_ranks:
        names += [REMOTE_GPU] * (devices - len(names))
    return names or None


def engine_gpus_of(description: dict[str, Any]) -> list[str] | None:
    """engine_gpus for an Engine.describe(): its devices from its engine arguments (vLLM's tensor x pipeline
    parallel sizes; HF's device_map), the visible GPUs from its hardware."""
    args = description.get("engine_args") or {}
    visible = (description.get("hardware") or {}).get("gpus")
    if (description.get("versions") or {}).get("vllm_distribution") == "vllm-cpu" and description.get("name") == "vllm":
        return None  # vLLM's CPU build computes on the processor, whatever GPUs the machine has
    if "device_map" in args:  # HF: one device, or its layers spread over every visible GPU
        device_map = args["device_map"]
        return None if device_map == "cpu" else engine_gpus(visible, len(visible or []) if device_map == "auto" else 1)
    devices = int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)
    return engine_gpus(visible, devices, remote_ranks=args.get("distributed_executor_backend") == "ray")


def pool_gpus(engines: Sequence[Sequence[str] | None]) -> list[str] | None:
    """The GPU models of a data-parallel pool, one per engine rank, which every engine must share: the pool sends
    a shard to whichever engine is free, so on engines of two GPU models a request's answer (last bits, near-ties)
    would depend on which one took it, and all of them would go into one store. Raises ConfigError naming them."""
    models = [list(gpus) if gpus else None for gpus in engines]
    if any(m != models[0] for m in models):
        seen = ", ".join(f"engine {i}: {', '.join(m) if m else 'no GPU'}" for i, m in enumerate(models))
        raise ConfigError(f"the data-parallel engines landed on different GPU models ({seen}), whose answers differ "
                          "in the last bits and would share one request store: run the pool on nodes of one GPU "
                          "model (one run per model)")
    return models[0] if models else None


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
