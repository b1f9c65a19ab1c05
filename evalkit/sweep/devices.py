"""The GPUs a Hydra launcher gives each point of a sweep, checked against what the point needs.

Under Slurm (``hydra/launcher=evalkit_slurm`` or ``submitit_slurm``) a point waits in the queue before it runs;
given fewer GPUs than ``tensor x pipeline x data parallel`` it would then fail once its engine starts. Checked
inside the point, before the engine: :func:`point_launcher` reads the launcher's settings (``hydra.launcher``) and
:func:`check_launcher_devices` compares. The Ray launcher (``evalkit_ray``) sizes each point itself, and
without a launcher the preflight counts this machine's devices (evalkit/engine/machine/preflight.py).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from evalkit.config import ConfigError

SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
EVALKIT_SLURM = "hydra_plugins.evalkit_slurm_launcher.slurm_launcher.EvalkitSlurmLauncher"  # submitit's, evalkit's wait
SUBMITIT_LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
KEYS = ("_target_", "gpus_per_node", "gpus_per_task", "gres", "nodes")  # what the check reads of hydra.launcher
GRES_GPUS = re.compile(r"(?:^|,)gpu(?::[^:,]+)?:(\d+)(?:,|$)")  # gres=gpu:4, gres=gpu:a100:4


def launcher_gpus(launcher: Mapping[str, Any]) -> Optional[tuple[int, str, str]]:
    """(GPUs the launcher gives one point, the settings that say so, the setting to raise), or None when it asks
    for no GPU (a CPU job: the preflight checks it against cores) or is not a submitit launcher."""
    target = launcher.get("_target_")
    if target == SUBMITIT_LOCAL and launcher.get("gpus_per_node"):
        return int(launcher["gpus_per_node"]), f"gpus_per_node={launcher['gpus_per_node']}", "gpus_per_node"
    if target not in (SLURM, EVALKIT_SLURM):
        return None
    if launcher.get("gpus_per_task"):
        return int(launcher["gpus_per_task"]), f"gpus_per_task={launcher['gpus_per_task']}", "gpus_per_task"
    nodes = int(launcher.get("nodes") or 1)
    if launcher.get("gpus_per_node"):
        per_node, said = int(launcher["gpus_per_node"]), f"gpus_per_node={launcher['gpus_per_node']}"
    elif GRES_GPUS.search(str(launcher.get("gres") or "")):
        per_node, said = int(GRES_GPUS.search(str(launcher["gres"]))[1]), f"gres={launcher['gres']}"
    else:
        return None
    return per_node * nodes, f"{said} x nodes={nodes}", "gpus_per_node"


def check_launcher_devices(needed: int, launcher: Mapping[str, Any]) -> None:
    """ConfigError (one line) when the launcher (``hydra.launcher``'s settings) gives a point fewer GPUs than
    `needed` (evalkit.config.devices_needed)."""
    given = launcher_gpus(launcher)
    if given is not None and given[0] < needed:
        count, said, key = given
        raise ConfigError(f"this point needs {needed} GPUs and the launcher gives it {count} "
                          f"(hydra.launcher.{said}): pass hydra.launcher.{key}={needed}")


def point_launcher() -> Optional[dict[str, Any]]:
    """The settings of the launcher running this point (those of ``hydra.launcher`` the check reads), or None
    when this process is not a point of a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    launcher = HydraConfig.get().launcher
    return {key: OmegaConf.select(launcher, key) for key in KEYS}
