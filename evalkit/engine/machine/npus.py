"""The Ascend NPUs this process would get, found without starting the NPU runtime.

Why not torch_npu: ``torch.npu.device_count()`` and ``mem_get_info()`` start the runtime in the calling process
(torch-npu counts through the driver only where ``PYTORCH_HAL_BASED_NPU_CHECK=1``, as torch counts CUDA through
NVML), and a forked child of a process that started it dies with "Cannot re-initialize NPU in forked subprocess".
So NPUs are counted and named here from ``npu-smi info`` (names and HBM, run with ``LC_ALL=C``), and where it
cannot run, from the ``/dev/davinci<N>`` device nodes (with ``/dev/davinci_manager`` beside them), without names.

Numbering: each chip is one device to the runtime (an Atlas A2 NPU has one chip, an A3 NPU two). ``npu-smi`` and
the device nodes keep the host's numbers inside a container (``davinci5``, ``davinci7``), while the runtime numbers
the chips it is given 0, 1, ... in that order; ``ASCEND_RT_VISIBLE_DEVICES`` (digits and commas) picks among those
runtime numbers, as ``CUDA_VISIBLE_DEVICES`` picks among CUDA's.

Standard library only, so that install.sh can run it as a plain script and find NPUs exactly as a run does:
``python3 evalkit/engine/machine/npus.py`` prints one line, ``N <name>; <name> (how: npu-smi|device nodes|none:
<why>)``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

NO_NAME = "Ascend NPU (name unknown: npu-smi unavailable)"
# ROOT is "/" except in tests that recreate an Ascend machine in a temporary folder (tests/test_ascend.py).
ROOT = "/"
MANAGER = "dev/davinci_manager"
DEVICE_NODE = re.compile(r"^davinci(\d+)$")
VISIBLE = "ASCEND_RT_VISIBLE_DEVICES"
SMI = "npu-smi"
SMI_SECONDS = 20
# the rows of `npu-smi info` (Atlas A2 and A3 layouts, npu-smi 23 to 26): a chip's first row names its NPU and
# model, its second gives the chip (and on A3 its physical id), the bus id and, last, HBM used / total in MB
NAME_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|\s*\S+\s*\|")
BUS_ID = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d"
CHIP_ROW = re.compile(rf"^\|\s*(\d+)(?:\s+(\d+))?\s*\|\s*{BUS_ID}\s*\|(.*)\|\s*$")
USAGE = re.compile(r"(\d+)\s*/\s*(\d+)")
MIB = 2**20


@dataclass(frozen=True)
class Npu:
    index: int  # the host's number of the chip (its davinci node; npu-smi's physical id on A3, its NPU id on A2)
    name: str  # "910B3", "Ascend910", or NO_NAME
    total_bytes: int | None  # HBM, as npu-smi reports it (None where it is unavailable)
    free_bytes: int | None  # HBM no process holds now


class VisibleError(ValueError):
    """ASCEND_RT_VISIBLE_DEVICES that names no chip of this machine, or is not digits and commas."""


def visible_npus() -> list[Npu]:
    """The chips the NPU runtime would give this process, in ASCEND_RT_VISIBLE_DEVICES order ([] with no NPU)."""
    return discover()[0]


def discover() -> tuple[list[Npu], str]:
    """(the visible chips, how they were found: "npu-smi", "device nodes" or "none: <why>")."""
    chips, how = smi_npus()
    if chips is None:
        chips, how = node_npus(Path(ROOT) / "dev"), "device nodes"
        if not chips:
            return [], "none: no npu-smi answered and no /dev/davinci<N> device node"
    return pick(chips, os.environ.get(VISIBLE)), how


def pick(chips: list[Npu], visible: str | None) -> list[Npu]:
    """The chips ASCEND_RT_VISIBLE_DEVICES names, in its order; VisibleError where it names one there is not."""
    if visible is None:
        return chips
    if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", visible):
        raise VisibleError(f"{VISIBLE}={visible!r} must be chip numbers and commas (0,1,2,3)")
    wanted = [int(part) for part in visible.split(",")]
    missing = [n for n in wanted if n >= len(chips)]
    if missing or len(set(wanted)) != len(wanted):
        raise VisibleError(f"{VISIBLE}={visible!r} names chip(s) this machine has not: it has {len(chips)}, "
                           f"numbered 0 to {len(chips) - 1} in this container")
    return [chips[n] for n in wanted]


def smi_npus() -> tuple[list[Npu] | None, str]:
    """The chips `npu-smi info` lists, or (None, why) where it cannot run or lists none."""
    try:
        done = subprocess.run([SMI, "info"], capture_output=True, text=True, timeout=SMI_SECONDS,
                              env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"none: {SMI} did not run ({error.__class__.__name__})"
    chips = parse_smi(done.stdout) if done.returncode == 0 else []
    return (chips, "npu-smi") if chips else (None, f"none: {SMI} info listed no NPU (exit {done.returncode})")


def parse_smi(text: str) -> list[Npu]:
    """The chips of an `npu-smi info` table, in its order; its process table (below) is not read."""
    chips, name = [], None
    for line in text.splitlines():
        if "Process id" in line or "Process name" in line:
            break
        chip = CHIP_ROW.match(line)
        if chip and name is not None:
            npu, model = name
            usage = USAGE.findall(chip.group(3))
            used, total = (int(usage[-1][0]) * MIB, int(usage[-1][1]) * MIB) if usage else (None, None)
            index = int(chip.group(2)) if chip.group(2) is not None else npu
            chips.append(Npu(index=index, name=model, total_bytes=total or None,
                             free_bytes=total - used if total else None))
            name = None
            continue
        row = NAME_ROW.match(line)
        if row and not CHIP_ROW.match(line):
            name = (int(row.group(1)), row.group(2))
    return chips


def node_npus(dev: Path) -> list[Npu]:
    """Without npu-smi: one chip per /dev/davinci<N> node, where the driver's /dev/davinci_manager is there too."""
    if not (dev / "davinci_manager").exists():
        return []
    try:
        numbers = sorted(int(m.group(1)) for m in map(DEVICE_NODE.match, os.listdir(dev)) if m)
    except OSError:
        return []
    return [Npu(index=n, name=NO_NAME, total_bytes=None, free_bytes=None) for n in numbers]


def summary(chips: list[Npu], how: str) -> str:
    names = "; ".join(chip.name for chip in chips)
    return f"{len(chips)} {names} (how: {how})" if chips else f"0 (how: {how})"


if __name__ == "__main__":
    ROOT = os.environ.get("EVALKIT_NPU_ROOT", ROOT)  # tests/test_install.py: an Ascend machine recreated in a folder
    try:
        print(summary(*discover()))
    except VisibleError as error:
        print(f"0 (how: none: {error})")
        sys.exit(0)
