"""Data parallelism on Ray, the pool: ``data_parallel_size`` vLLM engines, each in its own Ray actor, behind one Engine.

vLLM's own ``data_parallel_size`` serves mixture-of-experts models only, and lm-eval's vllm backend builds a
fresh ``LLM`` in a Ray task for every call. Here each actor starts its engine once and keeps it for the
run (on its own ``tensor x pipeline`` devices; on a CPU machine, its own share of the node's cores).
Every engine call is split into shards balanced by tokens, one per actor by default; a question's choices
(score requests with one context) stay in one shard, so an engine reads their shared prefix from its own
cache. Answers go back in request order, so lm-eval scores what a single engine would have returned.

This module is the pool's face, the Engine contract: the tokenizer is kept here, beside the engines. The rest
lives beside it, one job a module: what runs in an actor (``actor.py``), the actors as the driver holds them,
their start and their replacement after a death or a memory failure (``replicas.py``), one call spread over
them (``dispatch.py``), the pure decisions (``plan.py``), and an engine's own error read back from its
output (``output.py``).
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Sequence

from evalkit.config import EvalConfig
from evalkit.contracts import Generation, GenRequest, IdsRead, Progress, Scored, ScoreRequest, TokenTrace
from evalkit.engine.pool.dispatch import dispatch
from evalkit.engine.pool.replicas import Replicas
from evalkit.engine.tokenizer import TokenizerSide, load_tokenizer


def progress_queue_options() -> dict:
    """Where the progress queue's actor lives: on this process's own node, which the run cannot outlive; placed
    anywhere, a lost node could take it, and the run would fail on its next report instead of replacing the
    lost engine."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}


class DataParallelEngine(TokenizerSide):
    """The :class:`evalkit.contracts.Engine` over ``data_parallel_size`` engine actors."""

    def __init__(self, cfg: EvalConfig, model_dir: str) -> None:
        from ray.util.queue import Queue

        self.max_model_len = cfg.max_model_len
        self.replicas = Replicas(cfg, model_dir)  # a cluster too small fails here, before anything loads
        self.shards = cfg.data_parallel_size
        self.trust_remote_code = cfg.trust_remote_code
        self.tokenizer = load_tokenizer(cfg.tokenizer or model_dir, trust_remote_code=cfg.trust_remote_code,
                                        add_bos_token=cfg.add_bos_token)
        self.queue = Queue(actor_options=progress_queue_options())  # the actors' progress reports
        self.replicas.start()
        # the first engine's (every engine runs the same arguments)
        self.logits_dtype = str(self.replicas.descriptions[0].get("logits_dtype") or "")
        hosts = Counter(p["host"] for p in self.replicas.places)
        print(f"evalkit: {len(self.replicas.actors)} engines on Ray "
              f"({', '.join(f'{n} on {h}' for h, n in hosts.items())}), requests shared by tokens",
              file=sys.stderr, flush=True)

    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None, *, top_k: int = 0,
                 shards: int | None = None) -> list[Generation]:
        """shards: how many parts to split requests into (default: one per engine). With top_k, each actor's
        engine answers its shard's traces as it would alone; they come back with the answers (pickled)."""
        return dispatch(self.replicas, "generate", requests, top_k, queue=self.queue, progress=progress,
                        shards=shards or self.shards)

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *,
              fast: bool = True, top_k: int = 0, shards: int | None = None) -> list[Scored]:
        return dispatch(self.replicas, "score", requests, fast, top_k, queue=self.queue, progress=progress,
                        shards=shards or self.shards)

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        """From the first actor alone: a trace reads no cache and samples nothing, so any engine gives it."""
        import ray

        return ray.get(self.replicas.actors[0].trace.remote(list(requests), top_k)) if requests else []

    def read_ids(self, reads: Sequence[IdsRead]) -> list[tuple[float, ...]]:
        """From the first actor alone, as trace: an ids read samples nothing, so any engine gives it."""
        import ray

        return ray.get(self.replicas.actors[0].read_ids.remote(list(reads))) if reads else []

    def scoring_counts(self) -> dict[str, int]:
        return {}  # the actors' engines keep their own counts; the pool records none (as before the contract)

    def describe(self) -> dict[str, Any]:
        """The first engine's description (every engine runs the same arguments), and where each one ran."""
        replicas = self.replicas
        return {**replicas.descriptions[0], "data_parallel": {"size": len(replicas.actors), "shards": self.shards,
                                                              "replaced": replicas.replaced,
                                                              "actors": replicas.described()}}

    def close(self) -> None:
        self.replicas.close()
