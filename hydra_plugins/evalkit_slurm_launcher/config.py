"""The settings of ``hydra/launcher=evalkit_slurm``: submitit_slurm's (``hydra.launcher.partition=...``), its launcher
evalkit's. Registered only where hydra-submitit-launcher is installed."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

try:
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
except ImportError:  # the slurm extra is not installed: no evalkit_slurm either
    SlurmQueueConf = None

if SlurmQueueConf is not None:

    @dataclass
    class EvalkitSlurmQueueConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.evalkit_slurm_launcher.slurm_launcher.EvalkitSlurmLauncher"

    ConfigStore.instance().store(group="hydra/launcher", name="evalkit_slurm", node=EvalkitSlurmQueueConf,
                                 provider="evalkit")
