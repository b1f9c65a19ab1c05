"""A sweep on Ray: start or join the cluster, size each point (``_plan``), run it as a Ray task, print the
sweep's progress line each time a point ends, and hand Hydra the points' results in order.

Ray queues a task until the GPUs and cores it asks for are free and sets its ``CUDA_VISIBLE_DEVICES``, so the
points fill the machine without a scheduler of our own; a point waits here only while a running point holds
the lock its run will take, or both are data parallel (``_plan.exclusive``). Each task sets Hydra up as the
point's own process would (``Singleton.set_state``, ``setup_globals``) and calls ``run_job``, as Hydra's Ray
and submitit launchers do. What a point prints reaches this terminal through Ray's log forwarding, prefixed
``(point N pid=...)``. A point that fails is recorded failed (evalkit/sweep/points.py, ``record_failure``) and the sweep goes on, as with
evalkit's own points.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from evalkit.config import ConfigError
from evalkit.engine.machine import local_ray
from evalkit.sweep.points import record_failure

from ._plan import RaySettings, Request, address_override, exclusive, request_for

# Ray forwards a task's output through its log monitor (polled every 0.1 s): a point's last lines arrive
# after its result, and would be lost if Ray were shut down at once.
LOG_GRACE_S = 1.0


def say(line: str) -> None:
    print(f"evalkit: {line}", file=sys.stderr, flush=True)


def connect(settings: RaySettings) -> tuple[bool, Path | None]:
    """Join settings.address or start Ray here (on 127.0.0.1, its session in a private folder: evalkit's
    engine/machine/local_ray.py): whether this call connected (False when this process was connected already)
    and the session folder of a Ray it started."""
    # Ray folds lines that differ only in their numbers ("[repeated 3x across cluster]"), which every point's
    # progress lines do; read when ray is imported. Colour codes only on a terminal; read per line.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if not settings.address:
        folder = local_ray.start(num_cpus=settings.num_cpus, num_gpus=settings.num_gpus,
                                 logging_level=logging.ERROR)
        return folder is not None, folder
    import ray

    if ray.is_initialized():
        return False, None
    ray.init(address=settings.address, logging_level=logging.ERROR)
    return True, None


def launch(*, settings: RaySettings, hydra_context: HydraContext, task_function: TaskFunction,
           config: DictConfig, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    setup_globals()
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)  # its ${now:} is cached for the points
    connected, ray_folder = connect(settings)
    received: list[int] = []  # SIGTERM, seen by the handler (Ray re-raises a bare KeyboardInterrupt)

    def stop(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        sweep = Sweep(settings=settings, hydra_context=hydra_context, task_function=task_function, config=config)
        return sweep.run([list(o) for o in job_overrides], initial_job_idx)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the running points were ended (Sweep.run)
        signum = received[-1] if received else signal.SIGINT
        say(f"sweep stopped by {signal.Signals(signum).name}; its running points were ended (the same command "
            "again reruns only what is missing)")
        raise SystemExit(128 + signum) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        if connected:
            time.sleep(LOG_GRACE_S)
            local_ray.stop(ray_folder)  # stops the Ray this sweep started; only disconnects from a cluster it joined


@dataclass
class Point:
    num: int
    cfg: DictConfig  # composed, with the sweep's cluster address for a data-parallel point
    request: Request
    keys: frozenset[str]  # what it must not share with another running point (_plan.exclusive)


class Sweep:
    """One launch: what each point asks Ray for, the points waiting their turn, the tasks in flight."""

    def __init__(self, *, settings: RaySettings, hydra_context: HydraContext, task_function: TaskFunction,
                 config: DictConfig) -> None:
        import ray

        self.settings, self.hydra_context, self.config = settings, hydra_context, config
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        self.cluster = ray.cluster_resources()
        self.address = ray.get_runtime_context().gcs_address
        # Sent once into Ray's object store; every task reads it from there.
        self.shared = ray.put((hydra_context, task_function, Singleton.get_state()))
        self.remote = ray.remote(max_retries=0)(run_point)  # a rerun is the user's call (resume makes it cheap)
        self.waiting: list[Point] = []  # in point order, until nothing running holds one of its keys
        self.running: dict[Any, Point] = {}  # Ray task -> point

    def run(self, job_overrides: list[list[str]], first: int) -> list[JobReturn]:
        import ray

        points = f"{len(job_overrides)} point{'s' if len(job_overrides) != 1 else ''}"
        say(f"sweep: {points} on Ray at {self.address} ({self.cluster.get('GPU', 0.0):g} GPUs, "
            f"{self.cluster.get('CPU', 0.0):g} cores); folders under {self.sweep_dir}")
        results: dict[int, JobReturn] = {}
        for num, overrides in enumerate(job_overrides, start=first):
            point = self.plan(num, overrides)
            if isinstance(point, JobReturn):
                results[num] = point
            else:
                self.waiting.append(point)
        self.submit_ready()
        start = time.monotonic()
        try:
            while self.running:
                (task,), _ = ray.wait(list(self.running), num_returns=1)
                point = self.running.pop(task)
                results[point.num] = self.collect(task, point)
                self.submit_ready()
                if self.running:  # the last line comes from the end-of-sweep callback
                    self.progress(len(job_overrides), time.monotonic() - start)
        except BaseException:  # Ctrl-C, SIGTERM: kill the points' workers; each point's engines die with them
            for task in self.running:
                ray.cancel(task, force=True)
            raise
        return [results[num] for num in range(first, first + len(job_overrides))]

    def plan(self, num: int, overrides: list[str]) -> Point | JobReturn:
        """Point num, sized for the cluster; a failed JobReturn (recorded) when it can never fit."""
        cfg = self.point_config(num, overrides)
        try:
            request = request_for(num, cfg, cluster_gpus=self.cluster.get("GPU", 0.0),
                                  cpus_per_point=self.settings.cpus_per_point)
        except ConfigError as error:
            say(f"error: {error}")
            return self.failed(num, cfg, str(error).removeprefix(f"point {num} "))
        say(f"point {num}: {' '.join(filter_overrides(overrides)) or '(no overrides)'} ({holds(request)})")
        if request.data_parallel:
            cfg = self.point_config(num, overrides + [address_override(self.address)])
        return Point(num=num, cfg=cfg, request=request, keys=exclusive(task_config(cfg), request))

    def point_config(self, num: int, overrides: list[str]) -> DictConfig:
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg):
            cfg.hydra.job.id = f"point_{num}"  # the Ray task's id once it runs
            cfg.hydra.job.num = num
        return cfg

    def submit_ready(self) -> None:
        """Hand Ray every waiting point whose keys no running point holds; Ray starts it when its devices are free."""
        held = set().union(*(p.keys for p in self.running.values()))
        for point in list(self.waiting):
            if point.keys & held:
                continue
            self.waiting.remove(point)
            held |= point.keys
            task = self.remote.options(num_gpus=point.request.num_gpus, num_cpus=point.request.num_cpus,
                                       name=f"point {point.num}").remote(
                shared=self.shared, sweep_config=point.cfg, num=point.num, cwd=os.getcwd(),
                threads=os.environ.get("OMP_NUM_THREADS"))
            self.running[task] = point

    def collect(self, task: Any, point: Point) -> JobReturn:
        """The point's JobReturn; a point Ray lost (its worker killed: out of memory, node gone) is recorded failed."""
        import ray

        try:
            return ray.get(task)
        except ray.exceptions.RayError as error:
            cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
            say(f"error: point {point.num} was lost: {cause}")
            return self.failed(point.num, point.cfg, f"lost: {cause}")

    def failed(self, num: int, cfg: DictConfig, error: str) -> JobReturn:
        overrides = list(cfg.hydra.overrides.task)
        record_failure(Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir), num=num, overrides=overrides,
                       error=error)
        return JobReturn(overrides=overrides, status=JobStatus.COMPLETED)  # as evalkit's failed points: recorded

    def progress(self, total: int, elapsed: float) -> None:
        from evalkit.sweep.points import read_points, sweep_line

        print(sweep_line(read_points(self.sweep_dir), total, elapsed), file=sys.stderr, flush=True)


def task_config(cfg: DictConfig) -> Any:
    """The point's config as its task function gets it (without Hydra's node), as an object where it has a
    schema (evalkit's EvalConfig); None when it does not convert (the point will say why when it runs)."""
    task = copy.deepcopy(cfg)
    with open_dict(task):
        del task["hydra"]
    try:
        return OmegaConf.to_object(task)
    except Exception:
        return None


def holds(request: Request) -> str:
    if request.data_parallel:
        return "its engines take their own devices on the cluster"
    gpus = f"{request.num_gpus:g} GPU{'s' if request.num_gpus != 1 else ''}, " if request.num_gpus else ""
    return f"{gpus}{request.num_cpus:g} core{'s' if request.num_cpus != 1 else ''}"


def run_point(*, shared: tuple[HydraContext, TaskFunction, Any], sweep_config: DictConfig, num: int,
              cwd: str, threads: Optional[str]) -> JobReturn:
    """A Ray task: one point, run as Hydra runs a job, in the sweep's working directory where this node has it.

    threads: the sweep's OMP_NUM_THREADS. Ray sets it to the task's cores (1) in a worker that had none, for
    in-process work; a point's engine is a process tree that sizes its own threads, as without Ray."""
    import ray

    hydra_context, task_function, singleton_state = shared
    setup_globals()
    Singleton.set_state(singleton_state)
    if os.path.isdir(cwd):  # a node of a cluster may not share the driver's file system
        os.chdir(cwd)
    if threads is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = threads
    with open_dict(sweep_config.hydra.job):
        sweep_config.hydra.job.id = ray.get_runtime_context().get_task_id()
    return run_job(hydra_context=hydra_context, task_function=recorded(task_function, num), config=sweep_config,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


def recorded(task_function: TaskFunction, num: int) -> Callable[[DictConfig], Optional[Any]]:
    """task_function, its failure recorded in the point's record: an exit code (evalkit ends a stopped point
    with sys.exit, which would otherwise kill the Ray worker) or an exception (its traceback printed here)."""

    def point(cfg: DictConfig) -> Optional[Any]:
        try:
            return task_function(cfg)
        except SystemExit as end:
            if end.code in (None, 0):
                return None
            error = f"exit code {end.code}"
        except Exception as exception:
            traceback.print_exc()
            error = " ".join(f"{type(exception).__name__}: {exception}".split())
        hydra = HydraConfig.get()
        record_failure(Path(hydra.runtime.output_dir), num=num, overrides=list(hydra.overrides.task), error=error)
        return None

    return point
