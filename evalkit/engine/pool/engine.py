"""Data parallelism on Ray, the pool: ``data_parallel_size`` vLLM engines, each in its own Ray actor, behind one Engine.

vLLM's own ``data_parallel_size`` serves mixture-of-experts models only, and lm-eval's vllm backend builds a
fresh ``LLM`` in a Ray task for every call. Here each actor starts its engine once and keeps it for the
run (on its own ``tensor x pipeline`` devices; on a CPU machine, its own share of the node's cores).
Every engine call is split into shards balanced by tokens, one per actor by default; a question's choices
(score requests with one context) stay in one shard, so an engine reads their shared prefix from its own
cache. Answers go back in request order, so lm-eval scores what a single engine would have returned.

An actor that dies is replaced and its shard sent again; one whose engine runs out of memory is replaced
with the next smaller settings of the run's memory back-off (``oom_retry``), the others keep theirs. An actor
whose engine fails to start (a segfault, the kernel's OOM killer) is replaced ``REPLACEMENTS`` times, then the
run fails with one line naming it and its last error. The pool's pure decisions are in ``pool/plan.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time
from collections import Counter
from typing import Any, Callable, Sequence

from evalkit.config import EvalConfig, devices_per_engine, memory_settings
from evalkit.contracts import Generation, GenRequest, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.backoff import classify, weights_failure
from evalkit.engine.pool.output import call_explained
from evalkit.engine.machine.process_group import guard_own_group
from evalkit.engine.pool.plan import REPLACEMENTS, actor_resources, core_share, one_line, replacement_settings, shard
from evalkit.engine.vllm.bar import EngineBar
from evalkit.engine.machine.gpus import engine_gpus, pool_gpus
from evalkit.engine.vllm.start import start_vllm
from evalkit.engine.tokenizer import TokenizerSide, load_tokenizer

log = logging.getLogger("evalkit")
PROGRESS_EVERY = 0.5  # seconds between an actor's progress reports


# --- inside an actor ---
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
        CUDA_VISIBLE_DEVICES makes the visible GPUs this actor's own)."""
        import ray

        from evalkit.engine.machine.gpus import visible_gpus

        return {"node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(), "pid": os.getpid(),
                "gpus": [str(g) for g in ray.get_gpu_ids()],
                "gpu_models": [gpu.name for gpu in visible_gpus()]}

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
        # vLLM's error names no cause when its EngineCore fails ("See root cause above"): read it off the output
        self.engine = call_explained(start_vllm, cfg, model_dir, sole_engine=True)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return {**self.engine.describe(), "cores": cores, "threads": torch.get_num_threads()}

    def generate(self, requests: list[GenRequest], queue: Any) -> list[Generation]:
        progress = ReportedProgress(queue)
        answers = call_explained(self.engine.generate, requests, progress)
        progress.flush()
        return answers

    def score(self, requests: list[ScoreRequest], queue: Any, fast: bool) -> list[Scored]:
        progress = ReportedProgress(queue)
        answers = call_explained(self.engine.score, requests, progress, fast=fast)
        progress.flush()
        return answers

    def trace(self, requests: list[ScoreRequest], top_k: int) -> list[TokenTrace]:
        return call_explained(self.engine.trace, requests, top_k)

    def close(self) -> None:
        self.engine.close()


# --- the driver's side ---
def connect(cfg: EvalConfig) -> bool:
    """Join cluster.address, or start Ray on this machine; False when this process was connected already."""
    import ray

    if ray.is_initialized():
        return False
    local = {} if cfg.cluster.address else {"num_cpus": cfg.cluster.num_cpus, "num_gpus": cfg.cluster.num_gpus}
    ray.init(address=cfg.cluster.address, include_dashboard=False, logging_level=logging.WARNING, **local)
    return True


class DataParallelEngine(TokenizerSide):
    """The :class:`evalkit.contracts.Engine` over ``data_parallel_size`` engine actors."""

    def __init__(self, cfg: EvalConfig, model_dir: str) -> None:
        import ray
        from ray.util.queue import Queue

        self.cfg, self.model_dir, self.max_model_len = cfg, model_dir, cfg.max_model_len
        self.connected_here = connect(cfg)
        self.resources = actor_resources(cfg, ray.cluster_resources())
        self.shards = cfg.data_parallel_size
        self.trust_remote_code = cfg.trust_remote_code
        self.tokenizer = load_tokenizer(cfg.tokenizer or model_dir, trust_remote_code=cfg.trust_remote_code,
                                        add_bos_token=cfg.add_bos_token)
        self.queue = Queue(actor_options={"num_cpus": 0})
        self.remote = ray.remote(EngineActor)
        self.settings = [cfg] * cfg.data_parallel_size
        self.actors: list[Any] = [self.remote.options(**self.resources).remote() for _ in self.settings]
        self.places = ray.get([a.place.remote() for a in self.actors])
        nodes = [p["node"] for p in self.places]
        self.slots = [(nodes[:i].count(node), nodes.count(node)) for i, node in enumerate(nodes)]
        self.descriptions: list[dict[str, Any]] = [{} for _ in self.actors]
        self.replaced = 0
        try:
            self._one_gpu_model()
            for i, ref in [(i, self._start(i)) for i in range(len(self.actors))]:
                self._started(i, ref)
        except BaseException:
            self._end()
            raise
        hosts = Counter(p["host"] for p in self.places)
        print(f"evalkit: {len(self.actors)} engines on Ray ({', '.join(f'{n} on {h}' for h, n in hosts.items())}), "
              f"requests shared by tokens", file=sys.stderr, flush=True)

    def _start(self, i: int) -> Any:
        return self.actors[i].start.remote(self.settings[i], self.model_dir, *self.slots[i])

    def _started(self, i: int, ref: Any) -> None:
        """Wait for actor i's engine. One that fails to start is replaced (after a memory failure, with the next
        smaller settings) REPLACEMENTS times at most; then the run fails, naming the actor and its last error."""
        import ray

        for tries in range(1, REPLACEMENTS + 2):
            try:
                self.descriptions[i] = ray.get(ref)
                return
            except ray.exceptions.RayError as error:
                if tries > REPLACEMENTS:
                    place = self.places[i]
                    raise RuntimeError(f"engine {i} (pid {place['pid']} on {place['host']}) did not start in "
                                       f"{tries} tries; last: {one_line(error)}") from error
                self._replace(i, error)
                ref = self._start(i)

    def _replace(self, i: int, error: Exception) -> None:
        """A fresh actor in place of actor i, with the settings replacement_settings gives."""
        import ray

        kind = classify(str(error))
        if kind == "weights":  # no smaller setting loads them: fail now, not after every replacement
            raise RuntimeError(f"engine {i}: {weights_failure(str(error))}") from error
        if isinstance(error, ray.exceptions.OutOfMemoryError):  # Ray's memory monitor killed the actor
            kind = "pressure"
        died = isinstance(error, ray.exceptions.RayActorError)
        self.settings[i] = replacement_settings(self.settings[i], kind=kind, died=died, error=error,
                                                policy=self.cfg.oom_retry)
        log.warning("engine %d %s; starting a fresh actor with %s", i, f"ran out of memory ({kind})" if kind else "died",
                    memory_settings(self.settings[i]))
        ray.kill(self.actors[i], no_restart=True)
        self.actors[i] = self.remote.options(**self.resources).remote()
        self.places[i] = ray.get(self.actors[i].place.remote())
        self.replaced += 1
        self._one_gpu_model()  # the replacement may land on another GPU model

    def _one_gpu_model(self) -> None:
        """Refuse engines on different GPU models before they start: they would share one store
        (gpus.pool_gpus says why)."""
        pool_gpus([engine_gpus(p.get("gpu_models"), devices_per_engine(self.cfg)) for p in self.places])

    def _map(self, method: str, requests: Sequence[Any], progress: Progress | None, shards: int | None,
             *args: Any) -> list:
        """Send the shards of requests to free actors as they free up; answers back in request order."""
        import ray

        if not requests:
            return []
        waiting = shard(requests, shards or self.shards)
        answers: list[Any] = [None] * len(requests)
        free, running, losses = list(range(len(self.actors))), {}, Counter()
        while waiting or running:
            while waiting and free:
                i, indexes = free.pop(0), waiting.pop(0)
                ref = getattr(self.actors[i], method).remote([requests[k] for k in indexes], self.queue, *args)
                running[ref] = (i, indexes)
            done, _ = ray.wait(list(running), num_returns=1, timeout=PROGRESS_EVERY)
            self._report(progress)
            for ref in done:
                i, indexes = running.pop(ref)
                try:
                    for k, answer in zip(indexes, ray.get(ref)):
                        answers[k] = answer
                except ray.exceptions.RayError as error:
                    losses[tuple(indexes)] += 1
                    if losses[tuple(indexes)] > REPLACEMENTS:
                        raise RuntimeError(f"a shard of {len(indexes)} requests lost its engine "
                                           f"{REPLACEMENTS + 1} times; last: {one_line(error)}") from error
                    self._replace(i, error)
                    self._started(i, self._start(i))
                    waiting.insert(0, indexes)
                free.append(i)
        self._report(progress)
        return answers

    def _report(self, progress: Progress | None) -> None:
        """Pass on what the actors reported since the last call."""
        size = self.queue.qsize()
        for requests, tokens in (self.queue.get_nowait_batch(size) if size else []):
            if progress:
                progress.advance(requests, tokens)

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *,
                 shards: int | None = None) -> list[Generation]:
        """shards: how many parts to split requests into (default: one per engine)."""
        return self._map("generate", requests, progress, shards)

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True, shards: int | None = None) -> list[Scored]:
        return self._map("score", requests, progress, shards, fast)

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        """From the first actor alone: a trace reads no cache and samples nothing, so any engine gives it."""
        import ray

        return ray.get(self.actors[0].trace.remote(list(requests), top_k)) if requests else []

    def scoring_counts(self) -> dict[str, int]:
        return {}  # the actors' engines keep their own counts; the pool records none (as before the contract)

    def describe(self) -> dict[str, Any]:
        """The first engine's description (every engine runs the same arguments), and where each one ran."""
        actors = [{**place, "settings": memory_settings(settings), "choices": description.get("choices"),
                   "cores": description.get("cores"), "threads": description.get("threads"),
                   "engine_gpus": description.get("engine_gpus"),
                   "scheduling": description.get("scheduling")}
                  for place, settings, description in zip(self.places, self.settings, self.descriptions)]
        return {**self.descriptions[0], "data_parallel": {"size": len(self.actors), "shards": self.shards,
                                                          "replaced": self.replaced, "actors": actors}}

    def close(self) -> None:
        import ray

        try:
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        except ray.exceptions.RayError as error:
            log.warning("closing the engines: %s", one_line(error))
        finally:
            self._end()

    def _end(self) -> None:
        """Stop every actor, and Ray where this pool started it."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.connected_here:
            ray.shutdown()
