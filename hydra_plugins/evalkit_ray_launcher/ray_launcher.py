"""The launcher class Hydra instantiates; the work is in ``_core`` (imported at launch, with Ray), so that Hydra's
plugin scan, which imports this module on every evalkit start, stays fast."""

from __future__ import annotations

from typing import Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class EvalkitRayLauncher(Launcher):
    def __init__(self, address: Optional[str] = None, num_cpus: Optional[int] = None,
                 num_gpus: Optional[int] = None, cpus_per_point: float = 1.0) -> None:
        from ._plan import RaySettings

        self.settings = RaySettings(address=address, num_cpus=num_cpus, num_gpus=num_gpus,
                                    cpus_per_point=float(cpus_per_point))
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None
        self.config: Optional[DictConfig] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ._core import launch

        assert self.hydra_context is not None and self.task_function is not None and self.config is not None
        return launch(settings=self.settings, hydra_context=self.hydra_context, task_function=self.task_function,
                      config=self.config, job_overrides=job_overrides, initial_job_idx=initial_job_idx)
