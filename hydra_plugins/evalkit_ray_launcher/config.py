"""The settings of ``hydra/launcher=evalkit_ray`` (``hydra.launcher.<key>=...`` on the command line)."""

from dataclasses import dataclass
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class EvalkitRayLauncherConf:
    _target_: str = "hydra_plugins.evalkit_ray_launcher.ray_launcher.EvalkitRayLauncher"
    address: Optional[str] = None  # null: start Ray on this machine for the sweep; "auto" or "host:port": join that cluster
    num_cpus: Optional[int] = None  # a local start only: cores Ray hands out (null: all of them)
    num_gpus: Optional[int] = None  # a local start only: GPUs Ray hands out (null: those it finds; on a CPU machine, logical ones)
    cpus_per_point: float = 1.0  # cores each point's task holds (a data-parallel point's: none, its engines' actors hold theirs)


ConfigStore.instance().store(group="hydra/launcher", name="evalkit_ray", node=EvalkitRayLauncherConf, provider="evalkit")
