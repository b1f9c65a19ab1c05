"""The pool's engine actors as the driver holds them: asked of Ray, placed, started, replaced, stopped.

Each actor (pool/actor.py) starts its engine once. One that dies is replaced by a fresh actor with the same
settings; one whose engine runs out of memory, by one with the next smaller settings of the run's memory
back-off (``oom_retry``, evalkit/engine/backoff.py), while the others keep theirs; either starts once its GPUs
have the memory back that the run found there (the killed actor's engine processes free it as they end). An actor whose engine fails
to start (a segfault, the kernel's OOM killer) is replaced ``REPLACEMENTS`` times, then the run fails with one
line naming it and its last error. Engines on two GPU models are refused before they start, the replacement's
too, since they would share one request store (machine/gpus.py, ``pool_gpus``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from evalkit.config import ConfigError, EvalConfig, devices_per_engine, memory_settings
from evalkit.engine.backoff import classify, weights_failure
from evalkit.engine.machine import local_ray
from evalkit.engine.machine.gpus import MEMORY_WAIT, engine_gpus, pool_gpus, short_line
from evalkit.engine.pool.actor import EngineActor
from evalkit.engine.pool.plan import (PLACE_WAIT, REPLACEMENTS, actor_resources, check_nodes, one_line,
                                      replacement_settings)

log = logging.getLogger("evalkit")


def connect(cfg: EvalConfig) -> tuple[bool, Path | None]:
    """Join cluster.address, or start Ray on this machine (on 127.0.0.1, its session in a private folder:
    machine/local_ray.py): whether this call connected (False when this process was connected already) and the
    session folder of a Ray it started."""
    if not cfg.cluster.address:
        folder = local_ray.start(num_cpus=cfg.cluster.num_cpus, num_gpus=cfg.cluster.num_gpus,
                                 logging_level=logging.WARNING)
        return folder is not None, folder
    import ray

    if ray.is_initialized():
        return False, None
    ray.init(address=cfg.cluster.address, include_dashboard=False, logging_level=logging.WARNING)
    return True, None


class Replicas:
    """``data_parallel_size`` engine actors, each with its settings, its place and its engine's description.

    Made in two steps so that a cluster too small fails (ConfigError) before anything loads: the constructor
    joins Ray and sizes the actors; :meth:`start` makes them and starts their engines."""

    def __init__(self, cfg: EvalConfig, model_dir: str) -> None:
        import ray

        self.cfg, self.model_dir = cfg, model_dir
        self.connected_here, self.ray_folder = connect(cfg)
        self.actors: list[Any] = []
        try:
            self.resources = actor_resources(cfg, ray.cluster_resources())
            check_nodes(cfg, self.resources, [node["Resources"] for node in ray.nodes() if node["Alive"]])
        except BaseException:
            self.end()  # leave the cluster, or stop the Ray started here
            raise

    def start(self) -> None:
        """Make the actors, place them, and start their engines, all at once; any failure stops them all."""
        import ray

        self.remote = ray.remote(EngineActor)
        self.settings = [self.cfg] * self.cfg.data_parallel_size
        self.actors = [self.remote.options(**self.resources).remote() for _ in self.settings]
        self.descriptions: list[dict[str, Any]] = [{} for _ in self.actors]
        self.replaced = 0
        try:
            self.places = self._all_placed()
            self.before = ray.get([a.gpu_memory.remote() for a in self.actors])  # each actor's GPUs, no engine yet
            nodes = [p["node"] for p in self.places]
            self.slots = [(nodes[:i].count(node), nodes.count(node)) for i, node in enumerate(nodes)]
            self._one_gpu_model()
            self._model_on_nodes(range(len(self.actors)))
            for i, ref in [(i, self._start(i)) for i in range(len(self.actors))]:
                self._started(i, ref)
        except BaseException:
            self.end()
            raise

    def _all_placed(self) -> list[dict[str, Any]]:
        """Where each new actor runs, once Ray has placed them all; the run fails in one line when that takes more
        than PLACE_WAIT seconds (nodes that could hold them are busy: start() then stops the actors)."""
        import ray

        try:
            return ray.get([a.place.remote() for a in self.actors], timeout=PLACE_WAIT)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"Ray did not place all {len(self.actors)} engines ({self.resources} each) within "
                               f"{PLACE_WAIT:g} s: other work holds the nodes with room for them; run the same command "
                               "again when they are free, or with a smaller data_parallel_size") from None

    def restart(self, i: int, error: Exception) -> None:
        """Actor i failed with error while answering: a fresh one in its place, its engine started."""
        self._replace(i, error)
        self._started(i, self._start(i))

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
        self.places[i] = self._placed(i, error)
        self.replaced += 1
        self._one_gpu_model()  # the replacement may land on another GPU model
        self._model_on_nodes([i])  # and on a node without the weights
        self._memory_back(i)

    def _memory_back(self, i: int) -> None:
        """Wait until the GPUs of actor i's replacement that its first actor had have their memory back, at most
        MEMORY_WAIT seconds: Ray frees a killed actor's GPU at once, while its engine's processes (a group of
        their own) free the memory only as they end; started sooner, the replacement would fit itself to what
        they still hold. One line for each GPU still short."""
        import ray

        for then, now in ray.get(self.actors[i].memory_back.remote(self.before[i], MEMORY_WAIT)):
            log.warning("engine %d: %s", i, short_line(then, now, MEMORY_WAIT, after="its last actor was stopped",
                                                       before="the run's engines started"))

    def _placed(self, i: int, error: Exception) -> dict[str, Any]:
        """The place of actor i's replacement; the run fails in one line when no node has room for it within
        PLACE_WAIT seconds (its node was lost and the others are full): the answers stored so far are kept."""
        import ray

        try:
            return ray.get(self.actors[i].place.remote(), timeout=PLACE_WAIT)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.actors[i], no_restart=True)
            lost = self.places[i]
            raise RuntimeError(
                f"engine {i} (on {lost['host']}, Ray node {lost['node'][:12]}) was lost ({one_line(error)[:200]}) and no "
                f"node had room for a replacement ({self.resources}) within {PLACE_WAIT:g} s; the answers finished "
                f"so far are kept: run the same command again when the cluster has room, or with a smaller "
                f"data_parallel_size") from None

    def _model_on_nodes(self, indices: Any) -> None:
        """ConfigError, one line naming the node, when the model's folder (a path the driver resolved: vllm_path
        or a preset's EVALKIT_MODELS_DIR on the driver's machine) is not there on an actor's node; a hub id is
        fetched on each node."""
        import ray

        if not Path(self.model_dir).is_absolute():
            return
        found = ray.get([self.actors[i].has_folder.remote(self.model_dir) for i in indices])
        for i, here in zip(indices, found):
            if not here:
                place = self.places[i]
                raise ConfigError(f"the model folder {self.model_dir} does not exist on Ray node {place['node'][:12]} "
                                  f"({place['host']}), where engine {i} was placed: every node needs the weights at "
                                  f"the same path")

    def _one_gpu_model(self) -> None:
        """Refuse engines on different GPU models before they start: they would share one store
        (gpus.pool_gpus says why)."""
        pool_gpus([engine_gpus(p.get("gpu_models"), devices_per_engine(self.cfg)) for p in self.places])

    def described(self) -> list[dict[str, Any]]:
        """Where each actor runs, its memory settings, and what its engine said of its choices and cores."""
        return [{**place, "settings": memory_settings(settings), "choices": description.get("choices"),
                 "cores": description.get("cores"), "threads": description.get("threads"),
                 "engine_gpus": description.get("engine_gpus"), "scheduling": description.get("scheduling")}
                for place, settings, description in zip(self.places, self.settings, self.descriptions)]

    def close(self) -> None:
        """Close every engine (a minute at most), then stop the actors and Ray where this pool started it."""
        import ray

        try:
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        except ray.exceptions.RayError as error:
            log.warning("closing the engines: %s", one_line(error))
        finally:
            self.end()

    def end(self) -> None:
        """Stop every actor, and Ray where this pool started it."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.connected_here:
            local_ray.stop(self.ray_folder)
