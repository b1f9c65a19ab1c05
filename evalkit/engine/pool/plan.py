"""The data-parallel pool's decisions, as pure functions (evalkit/engine/pool/engine.py): requests in
shards balanced by tokens, an actor's share of a node's cores, what an actor asks Ray for, and the settings
of the actor that replaces a failed one."""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Any, Sequence

from evalkit.config import ConfigError, EvalConfig, OomRetry, devices_per_engine
from evalkit.contracts import ScoreRequest
from evalkit.engine.backoff import next_settings

REPLACEMENTS = 3  # times one shard may lose its actor, or one actor fail to start, before the run fails
# seconds a replacement actor waits for a node with room (its node lost, the others full) before the run fails
PLACE_WAIT = 60.0


def shard(requests: Sequence[Any], shards: int) -> list[list[int]]:
    """Request indexes in `shards` groups of near-equal tokens, each in request order.

    Score requests with one context form one unit (their engine shares the prefix); a generation counts its
    prompt and its token allowance. Largest units first, each to the lightest group (LPT)."""
    units: dict[Any, list[int]] = {}
    cost: Counter = Counter()
    for i, r in enumerate(requests):
        key = ("ctx", r.ids[:r.start]) if isinstance(r, ScoreRequest) else ("req", i)
        units.setdefault(key, []).append(i)
        cost[key] += len(r.ids) if isinstance(r, ScoreRequest) else len(r.prompt_ids) + r.max_tokens
    heap = [(0, g) for g in range(max(1, shards))]
    groups: list[list[int]] = [[] for _ in heap]
    for key in sorted(units, key=lambda k: (-cost[k], units[k][0])):
        load, g = heapq.heappop(heap)
        groups[g].extend(units[key])
        heapq.heappush(heap, (load + cost[key], g))
    return [sorted(g) for g in groups if g]


def one_line(error: BaseException) -> str:
    """A Ray error's message on one line (Ray spreads an actor's death over several)."""
    return " ".join(str(error).split())


def core_share(cores: Sequence[int], slot: int, slots: int) -> list[int]:
    """The slot-th of `slots` equal consecutive parts of cores (an actor's cores on a CPU-only node)."""
    per = max(1, len(cores) // slots)
    return list(cores[slot * per:(slot + 1) * per]) or list(cores)


def replacement_settings(settings: EvalConfig, *, kind: str | None, died: bool, error: Exception,
                         policy: OomRetry) -> EvalConfig:
    """The settings of the actor that replaces a failed one: the next smaller ones after a memory failure
    (the run's back-off, one actor at a time), the same after a death. Any other failure is the run's."""
    if kind:
        smaller = next_settings(settings, kind, policy) if policy.enabled else None
        if smaller is None:
            raise RuntimeError(f"an engine ran out of memory and the back-off is spent: {one_line(error)}") from error
        return smaller
    if died:
        return settings
    raise RuntimeError(f"an engine failed: {one_line(error)}") from error


def actor_resources(cfg: EvalConfig, cluster: dict[str, float]) -> dict[str, Any]:
    """What one engine's actor asks Ray for: its Ascend chips where the cluster has Ray's "NPU" resource (Ray then
    gives the actor its own ASCEND_RT_VISIBLE_DEVICES), its GPUs where it has GPUs, else one core (it binds its
    share of the node's cores itself). Raises ConfigError when the engines cannot all fit at once."""
    per_engine = devices_per_engine(cfg)
    if cluster.get("NPU", 0) > 0:
        wanted, have, unit = per_engine * cfg.data_parallel_size, cluster["NPU"], "NPUs"
        resources = {"num_gpus": 0, "num_cpus": 1, "resources": {"NPU": per_engine}}
    elif cluster.get("GPU", 0) > 0:
        wanted, have, unit = per_engine * cfg.data_parallel_size, cluster["GPU"], "GPUs"
        resources = {"num_gpus": per_engine, "num_cpus": 1}
    else:
        wanted, have, unit = cfg.data_parallel_size, cluster.get("CPU", 0), "cores"
        resources = {"num_gpus": 0, "num_cpus": 1}
    if wanted > have:
        raise ConfigError(f"data_parallel_size={cfg.data_parallel_size} needs {wanted:g} {unit} on the Ray cluster, "
                          f"which has {have:g}; lower data_parallel_size or join a larger cluster (cluster.address)")
    return resources


UNITS = {"GPU": "GPUs", "NPU": "NPUs", "CPU": "cores"}


def check_nodes(cfg: EvalConfig, resources: dict[str, Any], nodes: Sequence[dict[str, float]]) -> None:
    """ConfigError in one line where no node of the cluster (each node's resources, as ray.nodes() gives them)
    holds one engine's actor, or the nodes hold fewer engines at once than data_parallel_size. An actor's devices
    are on one node: tensor_parallel_size=8 on two nodes of 4 GPUs fits the cluster's total and no node, and Ray
    would wait for such a node for ever."""
    need = {"GPU": resources.get("num_gpus", 0), "CPU": resources.get("num_cpus", 0), **resources.get("resources", {})}
    need = {key: amount for key, amount in need.items() if amount}
    held = [min(int(node.get(key, 0) // amount) for key, amount in need.items()) for node in nodes]
    device = next((key for key in need if key != "CPU"), "CPU")
    counts = ", ".join(f"{count:g}" for count in sorted(node.get(device, 0) for node in nodes))
    unit = UNITS.get(device, device)
    if max(held, default=0) == 0:
        most = max((node.get(device, 0) for node in nodes), default=0)
        raise ConfigError(f"no Ray node has the {need[device]:g} {unit} one engine needs (tensor_parallel_size x "
                          f"pipeline_parallel_size = {devices_per_engine(cfg)}; the nodes have {counts} {unit}): pass "
                          f"tensor_parallel_size x pipeline_parallel_size of {most:g} or less, or join a node with "
                          f"{need[device]:g} {unit}")
    if sum(held) < cfg.data_parallel_size:
        raise ConfigError(f"data_parallel_size={cfg.data_parallel_size} engines of {need[device]:g} {unit} each do "
                          f"not fit on the Ray nodes at once ({sum(held)} do; the nodes have {counts} {unit}): lower "
                          "data_parallel_size")
