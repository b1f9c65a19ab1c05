"""A stand-in for nvidia-ml-py's ``pynvml`` module, for tests that recreate a GPU machine on this one.

The GPUs it reports come from the environment variable FAKE_NVML: a JSON list of
``{"name", "uuid", "total", "free"}`` objects, or ``"missing"`` for a machine whose libnvidia-ml cannot be loaded
(nvmlInit fails as nvidia-ml-py's does); ``@<file>`` reads that JSON from the file at each call. Tests put it in ``sys.modules["pynvml"]`` or, for a subprocess,
put this folder on PYTHONPATH (tests/gpu_machine/sitecustomize.py). Only the calls evalkit/engine/machine/gpus.py makes are here.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

CALLS: list[str] = []


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


def _gpus() -> list[dict]:
    spec = os.environ.get("FAKE_NVML", "[]")
    if spec.startswith("@"):  # read from that file at each call: GPU memory that processes take and give back
        with open(spec[1:], encoding="utf-8") as gpus:
            spec = gpus.read()
    spec = json.loads(spec)
    if spec == "missing":
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    return spec


def nvmlInit() -> None:
    CALLS.append("nvmlInit")
    _gpus()


def nvmlShutdown() -> None:
    CALLS.append("nvmlShutdown")


def nvmlDeviceGetCount() -> int:
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> dict:
    gpus = _gpus()
    if not 0 <= index < len(gpus):
        raise NVMLError("Invalid Argument")
    return gpus[index]


def nvmlDeviceGetHandleByUUID(uuid: str) -> dict:
    for gpu in _gpus():
        if gpu["uuid"] == uuid:
            return gpu
    raise NVMLError("Not Found")


def nvmlDeviceGetName(handle: dict) -> str:
    return handle["name"]


def nvmlDeviceGetUUID(handle: dict) -> str:
    return handle["uuid"]


def nvmlDeviceGetMemoryInfo(handle: dict) -> SimpleNamespace:
    return SimpleNamespace(total=handle["total"], free=handle["free"], used=handle["total"] - handle["free"])


def nvmlSystemGetCudaDriverVersion() -> int:
    """The newest CUDA the driver supports, as NVML gives it (12040 for 12.4): FAKE_NVML_CUDA, else 13000."""
    _gpus()
    return int(os.environ.get("FAKE_NVML_CUDA", "13000"))
