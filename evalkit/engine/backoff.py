"""The memory back-off, as a decision: which failures are memory failures, and the next smaller settings.

The supervisor (evalkit/run/supervise.py) applies it to a run's tries; the data-parallel pool
(evalkit/engine/dataparallel.py) to one actor at a time. Pure functions of an error text and a config.
"""

from __future__ import annotations

import dataclasses
import re

from evalkit.config import EvalConfig, OomRetry

# Memory failures that fewer/lower settings can cure. "pressure": the engine could not get the memory it
# asked for; "kv_cache": it got it, but too little was left for the KV cache (lowering the utilization
# would make that worse, so the back-off moves on to fewer sequences and eager mode).
PRESSURE = re.compile(r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|"
                      r"is less than desired (?:CPU|GPU) memory utilization", re.IGNORECASE)
KV_CACHE = re.compile(r"No available memory for the cache blocks|"
                      r"which is larger than the available KV cache memory", re.IGNORECASE)


def classify(text: str) -> str | None:
    """"pressure", "kv_cache" or None (not a memory failure) for an error message or log tail."""
    if KV_CACHE.search(text):
        return "kv_cache"
    if PRESSURE.search(text):
        return "pressure"
    return None


def next_settings(cfg: EvalConfig, kind: str, policy: OomRetry) -> EvalConfig | None:
    """The next, smaller settings to try after a memory failure of this kind, or None when none are left."""
    lower = round(cfg.gpu_memory_utilization - policy.utilization_step, 4)
    if kind == "pressure" and lower >= policy.utilization_floor - 1e-9:
        return dataclasses.replace(cfg, gpu_memory_utilization=lower)
    smaller = [n for n in policy.max_num_seqs if cfg.batch_size is None or n < cfg.batch_size]
    if smaller:
        return dataclasses.replace(cfg, batch_size=max(smaller))
    if policy.eager and not cfg.engine_kwargs.get("enforce_eager"):
        return dataclasses.replace(cfg, engine_kwargs={**cfg.engine_kwargs, "enforce_eager": True})
    return None
