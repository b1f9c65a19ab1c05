"""A GPU machine recreated in a temporary folder, in this process, for tests of evalkit/engine/machine/gpus.py and of
what reads it (the fingerprint's hardware): a driver's files under a root of its own and NVML faked at the pynvml
boundary (tests/gpu_machine/pynvml.py, which reports the GPUs of FAKE_NVML). For a subprocess on such a machine,
see tests/gpu_machine/sitecustomize.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from evalkit.engine.machine import gpus

FAKE_PYNVML = Path(__file__).parent / "gpu_machine" / "pynvml.py"


def driver_files(root: Path, nodes: int) -> Path:
    """A driver's files under root: /proc/driver/nvidia, /dev/nvidiactl, /dev/nvidia-uvm and nodes /dev/nvidia<N>."""
    (root / "proc/driver/nvidia").mkdir(parents=True)
    (root / "dev").mkdir()
    for name in ["nvidiactl", "nvidia-uvm"] + [f"nvidia{i}" for i in range(nodes)]:
        (root / "dev" / name).touch()
    return root


def on_fake_gpus(monkeypatch: pytest.MonkeyPatch, root: Path, reported: list[dict]) -> ModuleType:
    """This process on a machine of the GPUs NVML reports ({"name", "uuid", "total", "free"} each), one device node
    per GPU under root, with CUDA_VISIBLE_DEVICES unset. Returns the fake pynvml, whose CALLS records its calls."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_PYNVML)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(gpus, "ROOT", str(driver_files(root, nodes=len(reported))))
    monkeypatch.setenv("FAKE_NVML", json.dumps(reported))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake
