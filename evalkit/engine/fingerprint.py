"""What decides an engine's answers, as hashes: the fingerprint that names a request store, and the lock key.

:func:`fingerprint` hashes the model's files (or a hub model's commit), the settings that change outputs, the
model runner and kernel-selecting environment, the library versions, the hardware and evalkit's own answer
code. :func:`answers_key` is the coarser key the config alone decides, before the engine starts (the run lock,
evalkit/run/lock.py). Settings that only change scheduling or memory are left out of both
(``SCHEDULING_ONLY``), so the OOM back-off can resume a run under smaller settings.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from evalkit.config import cache_dir

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
# The hardware facts that decide kernels; the OS release, core count and host name are recorded, not hashed.
HARDWARE_KEYS = ("machine", "cpu_model", "cpu_bf16", "gpus")


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
                   "engine_kwargs": engine_kwargs})[:12]  # the executor backend is scheduling (SCHEDULING_ONLY)


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
    hardware = description.get("hardware") or {}
    environment = {k: v for k, v in (description.get("environment") or {}).items() if k not in SCHEDULING_ENV}
    return sha256({"engine": description.get("name", "vllm"),
                   "model": model_files(model_dir, engine_args.get("revision")),
                   "tokenizer": (model_files(tokenizer, engine_args.get("tokenizer_revision"))
                                 if tokenizer and tokenizer != model_dir else None),
                   "settings": settings, "model_runner": description.get("model_runner"),
                   "environment": environment, "versions": description.get("versions"),
                   "hardware": {k: hardware.get(k) for k in HARDWARE_KEYS}, "code": code_signature()})


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
