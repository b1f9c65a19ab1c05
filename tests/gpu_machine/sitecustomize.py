"""A GPU machine recreated on this CPU one, in every Python process started with this folder on PYTHONPATH
(tests/test_gpu_start.py runs ``python -m evalkit`` so: the supervisor and its try both get it).

Set by the environment, and only where EVALKIT_TEST_GPU_ROOT is set:

* EVALKIT_TEST_GPU_ROOT: a folder holding a fake NVIDIA driver (proc/driver/nvidia, dev/nvidiactl, dev/nvidia<N>),
  where evalkit/engine/machine/gpus.py looks for one instead of /;
* FAKE_NVML: the GPUs NVML reports (pynvml.py beside this file stands in for nvidia-ml-py; torch's own NVML
  reads, ``torch.cuda._raw_device_count_nvml``/``_raw_device_uuid_nvml``, report the same);
* EVALKIT_TEST_RECORD: a file that gets one JSON line per call of the CUDA runtime (each then fails, as
  nothing may call it before vLLM starts), and one for the call of ``vllm.LLM``, with the environment and
  arguments it was called with; the call then fails, so the run ends there (with EVALKIT_TEST_LLM_ERROR's text
  where that is set, e.g. vLLM's out-of-memory error, for the memory back-off);
* EVALKIT_TEST_CUDA_INITIALISED=1: the process has the CUDA driver loaded (a libcuda.so line in what evalkit
  reads for /proc/self/maps), as after a library called the CUDA runtime before vLLM started.

evalkit takes the installed vLLM for its CUDA build (evalkit.config.installed_vllm_build), as a GPU machine has it;
the vLLM imported underneath stays the CPU build, its engine never started (vllm.LLM records and fails).

torch here is the CPU build: with ``torch._C._cuda_getDeviceCount`` present it takes itself for a CUDA build
(torch/cuda/__init__.py, _is_compiled), so torch.cuda.is_available() takes the paths it takes on a GPU machine.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# torch._C's CUDA entry points, each a recorder that fails: the runtime's, and what a module imports by name from a
# CUDA build (torch._dynamo.device_interface: _cuda_getCurrentRawStream, imported with transformers' tokenizers)
RUNTIME_C = ("_cuda_getDeviceCount", "_cuda_init", "_cuda_getDevice", "_cuda_setDevice", "_cuda_getDeviceProperties",
             "_cuda_getCurrentRawStream")
RUNTIME_PY = ("_lazy_init", "init", "get_device_name", "get_device_properties", "get_device_capability",
              "mem_get_info", "set_device", "current_device", "synchronize", "memory_allocated")


def record(kind: str, **fields) -> None:
    with open(os.environ["EVALKIT_TEST_RECORD"], "a", encoding="utf-8") as out:
        out.write(json.dumps({"kind": kind, "pid": os.getpid(), **fields}, default=repr) + "\n")


def where() -> list[str]:
    frames = traceback.extract_stack()[:-2]
    return [f"{f.filename}:{f.lineno} {f.name}" for f in frames if "gpu_machine" not in f.filename][-8:]


def failing(name: str):
    def call(*args, **kwargs):
        record("cuda_runtime", call=name, stack=where())
        raise RuntimeError(f"CUDA runtime called before vLLM started: {name} (recorded by tests/gpu_machine)")
    return call


def fake_nvml() -> list[dict]:
    return json.loads(os.environ.get("FAKE_NVML", "[]"))


def patch_torch(torch) -> None:
    for name in RUNTIME_C:
        setattr(torch._C, name, failing(f"torch._C.{name}"))
    for name in RUNTIME_PY:
        setattr(torch.cuda, name, failing(f"torch.cuda.{name}"))
    torch.cuda._raw_device_count_nvml = lambda: len(fake_nvml())
    torch.cuda._raw_device_uuid_nvml = lambda: [gpu["uuid"] for gpu in fake_nvml()]
    torch._C._cuda_isInBadFork = lambda: False


class Recorder:
    """vllm.LLM: records how it was called, then fails."""

    def __init__(self, *args, **kwargs):
        env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "PYTORCH_", "CUDA_"))}
        record("vllm.LLM", env=env, kwargs=kwargs)
        raise RuntimeError(os.environ.get("EVALKIT_TEST_LLM_ERROR", "vllm.LLM was reached (recorded by tests/gpu_machine)"))


def patch_vllm(vllm) -> None:
    vllm.LLM = Recorder


def recreate() -> None:
    root = os.environ["EVALKIT_TEST_GPU_ROOT"]
    from evalkit import config
    from evalkit.engine.machine import environment

    config.installed_vllm_build = lambda: "cuda"  # before any module imports the name

    if hasattr(environment, "GPU_DRIVER_FILES"):  # evalkit before gpus.py looked for these absolute paths
        environment.GPU_DRIVER_FILES = (os.path.join(root, "proc/driver/nvidia"),)
    else:
        from evalkit.engine.machine import gpus

        gpus.ROOT = root
    if os.environ.get("EVALKIT_TEST_CUDA_INITIALISED") == "1":
        maps = os.path.join(root, "maps")
        with open("/proc/self/maps", encoding="utf-8") as real, open(maps, "w", encoding="utf-8") as out:
            out.write(real.read() + "7f3a1c000000-7f3a1d2a4000 r-xp 00000000 08:01 1234 "
                                    "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
        environment.MAPS = maps
    # the import hook both process models share (only this folder is on PYTHONPATH: its home is added at the end)
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "process_model"))
    from after_import import patch_after_import

    patch_after_import({"torch": patch_torch, "vllm": patch_vllm})


if os.environ.get("EVALKIT_TEST_GPU_ROOT"):
    recreate()
