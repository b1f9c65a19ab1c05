"""What runs inside one of the pool's Ray actors: a vLLM engine started once and kept for the run.

The pool wraps :class:`EngineActor` with ``ray.remote`` (pool/replicas.py); each actor starts its engine on
its own ``tensor x pipeline`` devices, or on a CPU node on its own share of the node's cores, and answers the
calls the pool sends it (pool/dispatch.py). Its engine's progress goes back to the driver on a Ray queue
(:class:`ReportedProgress`), and an engine error that only says "see root cause above" comes back with the
engine's own error line in front (pool/output.py), so the driver's memory back-off can read it.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any, Callable

from evalkit.config import EvalConfig, devices_per_engine
from evalkit.contracts import Generation, GenRequest, IdsRead, Scored, ScoreRequest, TokenTrace
from evalkit.engine.machine.environment import devices_now, memory_back
from evalkit.engine.machine.process_group import guard_own_group
from evalkit.engine.pool.output import call_explained, keep_tails
from evalkit.engine.pool.plan import core_share
from evalkit.engine.vllm.bar import EngineBar
from evalkit.engine.vllm.start import start_vllm

PROGRESS_EVERY = 0.5  # seconds between an actor's progress reports


class ReportedProgress:
    """The Progress an actor's engine reports to: batched onto a Ray queue the driver drains."""

    def __init__(self, queue: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.queue, self.clock = queue, clock
        self.requests = self.tokens = 0
        self.sent = clock()

    def advance(self, requests: int = 1, tokens: int = 0) -> None:
        self.requests += requests
        self.tokens += tokens
        if self.clock() - self.sent >= PROGRESS_EVERY:
            self.flush()

    def engine_bar(self) -> Callable[..., Any]:
        return lambda iterable=None, **kwargs: iterable if iterable is not None else EngineBar(self)

    def flush(self) -> None:
        if self.requests or self.tokens:
            self.queue.put((self.requests, self.tokens))
        self.requests = self.tokens = 0
        self.sent = self.clock()


class EngineActor:
    """One vLLM engine in a Ray actor process (the class is wrapped with ``ray.remote`` by the pool)."""

    def place(self) -> dict[str, Any]:
        """Where this actor runs, and the models of its GPUs (named through NVML, which leaves CUDA alone; Ray's
        CUDA_VISIBLE_DEVICES makes the visible GPUs this actor's own), or of its Ascend chips (through npu-smi;
        Ray's ASCEND_RT_VISIBLE_DEVICES makes them its own)."""
        import ray

        context = ray.get_runtime_context()
        npu_ids = (context.get_accelerator_ids() if hasattr(context, "get_accelerator_ids") else {}).get("NPU") or []
        return {"node": context.get_node_id(), "host": socket.gethostname(), "pid": os.getpid(),
                "gpus": [str(g) for g in ray.get_gpu_ids()] or [str(n) for n in npu_ids],
                "gpu_models": [device.name for device in devices_now()]}

    def has_folder(self, path: str) -> bool:
        """Whether path is a folder on this actor's node (the model's, before its engine starts)."""
        return os.path.isdir(path)

    def gpu_memory(self) -> list[Any]:
        """This actor's GPUs as NVML reads them now (or its Ascend chips as npu-smi does), free memory included
        (before its engine starts)."""
        return devices_now()

    def memory_back(self, before: list[Any], timeout: float) -> list[tuple[Any, Any]]:
        """Wait, at most timeout seconds, until those of this actor's devices that before names have the memory
        free again that they had then: (then, now) for each still short (machine/gpus.py, memory_back)."""
        return memory_back(before, timeout=timeout)

    def start(self, cfg: EvalConfig, model_dir: str, slot: int, slots: int) -> dict[str, Any]:
        """Start the engine; on a node without GPUs, on this actor's share of the node's cores."""
        import ray
        import torch

        if not ray.get_gpu_ids() and hasattr(os, "sched_setaffinity"):
            share = core_share(sorted(os.sched_getaffinity(0)), slot, slots)
            os.sched_setaffinity(0, share)
            # OpenMP sized its team when this process loaded it: from Ray's OMP_NUM_THREADS (one core), or,
            # with libgomp in LD_PRELOAD (vLLM's CPU guide sets it; an engine started in the driver leaves it
            # in the environment), from every core of the node, which oversubscribes the share (measured here:
            # 2 threads on 1 core generated 20x slower). One thread per core of the share, before vLLM binds them.
            torch.set_num_threads(len(share))
        if devices_per_engine(cfg) > 1 and cfg.distributed_executor_backend is None:
            # vLLM would pick its Ray executor inside a Ray actor; this engine's ranks are its own processes
            cfg = dataclasses.replace(cfg, distributed_executor_backend="mp")
        # the engine's processes (EngineCore, workers) die with this actor, however it dies (ray.kill is SIGKILL)
        self.guard = guard_own_group()
        # vLLM's error names no cause when its EngineCore fails ("See root cause above"): read it off the output,
        # which the engine's processes inherit: a pipe (Ray rotating its logs) gets a tail of ours in front
        keep_tails()
        self.engine = call_explained(start_vllm, cfg, model_dir, sole_engine=True)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return {**self.engine.describe(), "cores": cores, "threads": torch.get_num_threads(),
                "logits_dtype": self.engine.logits_dtype}

    def generate(self, requests: list[GenRequest], queue: Any, top_k: int) -> list[Generation]:
        progress = ReportedProgress(queue)
        answers = call_explained(self.engine.generate, requests, progress, top_k=top_k)
        progress.flush()
        return answers

    def score(self, requests: list[ScoreRequest], queue: Any, fast: bool, top_k: int) -> list[Scored]:
        progress = ReportedProgress(queue)
        answers = call_explained(self.engine.score, requests, progress, fast=fast, top_k=top_k)
        progress.flush()
        return answers

    def trace(self, requests: list[ScoreRequest], top_k: int) -> list[TokenTrace]:
        return call_explained(self.engine.trace, requests, top_k)

    def read_ids(self, reads: list[IdsRead]) -> list[tuple[float, ...]]:
        return call_explained(self.engine.read_ids, reads)

    def close(self) -> None:
        self.engine.close()
