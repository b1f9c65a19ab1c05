"""evalkit/engine/machine/gpus.py: GPUs counted and named through NVML, faked at the pynvml boundary (tests/gpu_machine/pynvml.py),
on a driver recreated in a temporary folder. Run: ``.venv/bin/python -m pytest tests/engine/machine/test_gpus.py -q``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.engine.machine import gpus
from tests.fake_gpus import driver_files, on_fake_gpus

GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
FOUR = [{"name": H100 if i < 2 else "NVIDIA A100-SXM4-80GB", "uuid": f"GPU-{i}{i}aa-{i}", "total": 80 * GIB,
         "free": 80 * GIB - i * GIB} for i in range(4)]


@pytest.fixture
def machine(tmp_path, monkeypatch):
    return on_fake_gpus(monkeypatch, tmp_path, FOUR)


def test_every_gpu_through_nvml(machine):
    found, how = gpus.discover()
    assert how == "nvml"
    assert [(g.index, g.name, g.free_bytes) for g in found] == [(i, FOUR[i]["name"], FOUR[i]["free"]) for i in range(4)]
    assert machine.CALLS[-1] == "nvmlShutdown"


@pytest.mark.parametrize("visible, indexes", [
    ("2,0", [2, 0]), ("1,7,2", [1]), ("1,-1,2", [1]), ("", []), ("-1", []), ("0,0", []),
    ("GPU-22,GPU-00", [2, 0]), ("GPU-,GPU-11", []),  # "GPU-" fits every UUID: ambiguous, which ends the list
])
def test_cuda_visible_devices_as_cuda_reads_it(machine, monkeypatch, visible, indexes):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert [g.index for g in gpus.visible_gpus()] == indexes


def test_device_nodes_where_nvml_cannot_load(machine, monkeypatch):
    monkeypatch.setenv("FAKE_NVML", '"missing"')
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,9")
    found, how = gpus.discover()
    assert how == "device nodes"
    assert [(g.index, g.name, g.total_bytes) for g in found] == [(3, gpus.NO_NAME, None), (1, gpus.NO_NAME, None)]


def test_no_driver(tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "ROOT", str(tmp_path))
    found, how = gpus.discover()
    assert found == [] and how.startswith("none: no NVIDIA driver")


def test_runs_as_a_plain_script_with_the_standard_library(machine, tmp_path):
    """What install.sh runs: python3 -S (no site-packages, so no nvidia-ml-py) on this machine, with no driver."""
    done = subprocess.run([sys.executable, "-S", "-I", str(Path(gpus.__file__))], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("0 (how: none: no NVIDIA driver")


def test_summary_line():
    found = [gpus.Gpu(i, H100, None, None, None) for i in range(2)]
    assert gpus.summary(found, "nvml") == f"2 {H100}; {H100} (how: nvml)"


def test_the_real_bindings_without_libnvidia_ml_fall_back_to_device_nodes(tmp_path, monkeypatch):
    """A container without the NVIDIA "utility" capability: the driver's nodes are there, libnvidia-ml is not.
    nvidia-ml-py itself (a dependency) raises NVMLError_LibraryNotFound, as it does on this machine."""
    import ctypes.util

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has libnvidia-ml")
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(gpus, "ROOT", str(driver_files(tmp_path, nodes=2)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    found, how = gpus.discover()
    assert how == "device nodes" and [g.name for g in found] == [gpus.NO_NAME] * 2
