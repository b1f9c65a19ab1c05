"""What evalkit's NPU handling rests on, measured on a real Ascend machine in one command, in a few minutes.

evalkit counts and sizes Ascend chips through ``npu-smi`` (evalkit/engine/machine/npus.py), never the NPU runtime,
and always has vLLM spawn its processes there. Each part below checks one fact that this rests on, in a fresh
process where the runtime is involved, and records its figures, or its error, in one JSON file; one part's failure
leaves the others to run. It needs only what the Ascend image has (torch, torch-npu, CANN) and evalkit's own
files: nothing is installed, no registry is needed.

1. ``platform``: the platform evalkit decides (``config.installed_vllm_build``), the Ascend versions it records,
   and what npus.py finds (how, names).
2. ``count``: npus.py's chips against ``torch.npu.device_count()`` and ``get_device_name`` (with
   ``PYTORCH_HAL_BASED_NPU_CHECK=1``), under no ``ASCEND_RT_VISIBLE_DEVICES`` and under a reversed one.
3. ``memory``: npu-smi's total and free HBM of chip 0 against ``torch.npu.mem_get_info()``, and the runtime
   context's size (npu-smi before and after).
4. ``fork``: a child forked after its parent started the NPU runtime, calling it again (expected to fail: the
   reason evalkit spawns), and a spawned one (expected to work).
5. ``release``: how long chip 0's HBM takes to come back, as npu-smi reads it, after
   ``process_group.end_group`` kills a process holding most of it.

Without an NPU (npus.py finds none, or torch-npu does not load), parts 2 to 5 are recorded as skipped.
Run from the repository root: ``python -m benchmarks.npu_check --out npu_check.json``. Exit status: 0 every part
ran or was skipped, 1 one failed (its error is in the file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
NO_NPU = "skipped: no Ascend NPU (npus.py found none, or torch-npu does not load)"
HOLD = 0.9  # share of chip 0's free HBM the killed process holds
BACK_WAIT = 60.0  # seconds to wait for the HBM to come back

COUNT = """
import json, os, torch, torch_npu
print(json.dumps({"device_count": torch.npu.device_count(),
                  "names": [torch.npu.get_device_name(i) for i in range(torch.npu.device_count())]}))
"""
MEMORY = """
import json, torch, torch_npu
free, total = torch.npu.mem_get_info(0)
print(json.dumps({"free": free, "total": total}))
"""
FORK = """
import json, multiprocessing, torch, torch_npu

def child(queue):
    try:
        torch.ones(4, device="npu:0").sum().item()
        queue.put("ok")
    except Exception as error:
        queue.put(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")

if __name__ == "__main__":
    torch.ones(4, device="npu:0").sum().item()  # the runtime started in the parent
    said = {}
    for method in ("fork", "spawn"):
        context = multiprocessing.get_context(method)
        queue = context.Queue()
        process = context.Process(target=child, args=(queue,))
        process.start()
        process.join(120)
        said[method] = queue.get(timeout=5) if not queue.empty() else f"no answer (exit {process.exitcode})"
    print(json.dumps(said))
"""
HOLDER = """
import os, sys, time, torch, torch_npu
free, _ = torch.npu.mem_get_info(0)
held = torch.empty(int(free * float(sys.argv[1])) // 2, dtype=torch.float16, device="npu:0")
print("held", flush=True)
time.sleep(600)
"""


def python(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 240) -> dict[str, Any]:
    """code run by this Python in a fresh process from the repository root; its last stdout line, as JSON."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def chips() -> list[Any]:
    from evalkit.engine.machine import npus

    return npus.visible_npus()


def has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401  (CANN and torch-npu load)
    except Exception:
        return False
    return bool(chips())


def platform_part() -> dict[str, Any]:
    from evalkit import config
    from evalkit.engine.machine import environment, npus

    found, how = npus.discover()
    return {"platform": config.installed_vllm_build(), "plugins": list(config.platform_plugins()),
            "versions": environment.ascend_versions(), "npus": [c.name for c in found], "how": how}


def names_under(visible: str | None) -> list[str]:
    """npus.py's chip names with ASCEND_RT_VISIBLE_DEVICES set to visible (unset for None), as a run would read it."""
    saved = os.environ.pop("ASCEND_RT_VISIBLE_DEVICES", None)
    if visible is not None:
        os.environ["ASCEND_RT_VISIBLE_DEVICES"] = visible
    try:
        return [c.name for c in chips()]
    finally:
        os.environ.pop("ASCEND_RT_VISIBLE_DEVICES", None)
        if saved is not None:
            os.environ["ASCEND_RT_VISIBLE_DEVICES"] = saved


def count() -> dict[str, Any]:
    seen = {}
    everything = names_under(None)
    for name, visible in (("all", None), ("reversed", ",".join(str(n) for n in reversed(range(len(everything)))))):
        env = {"PYTORCH_HAL_BASED_NPU_CHECK": "1"}
        if visible is not None:
            env["ASCEND_RT_VISIBLE_DEVICES"] = visible
        torch_side = python(COUNT, env=env)
        ours = names_under(visible)
        seen[name] = {"visible": visible, "npu_smi": ours, "torch": torch_side,
                      "same_count": len(ours) == torch_side["device_count"]}
    return seen


def memory() -> dict[str, Any]:
    before = chips()[0]
    torch_side = python(MEMORY)
    return {"npu_smi_total": before.total_bytes, "npu_smi_free": before.free_bytes, "torch_total": torch_side["total"],
            "torch_free": torch_side["free"],
            "context_bytes": (before.free_bytes - torch_side["free"]) if before.free_bytes is not None else None}


def fork() -> dict[str, Any]:
    return python(FORK)


def release() -> dict[str, Any]:
    from evalkit.engine.machine.process_group import end_group

    before = chips()[0]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(HOLD)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              start_new_session=True)
    try:
        if holder.stdout.readline().strip() != "held":
            raise RuntimeError("the holding process did not start")
        held = chips()[0]
        clock = time.monotonic()
        end_group(holder.pid)
        while time.monotonic() - clock < BACK_WAIT:
            now = chips()[0]
            if now.free_bytes is not None and now.free_bytes >= before.free_bytes - 2**29:
                break
            time.sleep(0.25)
        return {"free_before": before.free_bytes, "free_held": held.free_bytes, "free_after": now.free_bytes,
                "seconds_to_come_back": round(time.monotonic() - clock, 2)}
    finally:
        if holder.poll() is None:
            holder.kill()


def run_part(name: str, part: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    if part is None:
        return {"status": NO_NPU}
    clock = time.monotonic()
    try:
        found = part()
        return {"status": "ok", "seconds": round(time.monotonic() - clock, 2), **found}
    except Exception as error:
        return {"status": "failed", "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, default=Path("npu_check.json"), help="the JSON file to write")
    out = parser.parse_args(argv).out
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("PYTORCH_HAL_BASED_NPU_CHECK", "1")
    npu = has_npu()
    parts = {"platform": platform_part, "count": count if npu else None, "memory": memory if npu else None,
             "fork": fork if npu else None, "release": release if npu else None}
    record: dict[str, Any] = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "host": platform.node(), "machine": platform.machine(), "parts": {}}
    for name, part in parts.items():
        record["parts"][name] = run_part(name, part)
        print(f"npu_check: {name}: {record['parts'][name]['status']}", flush=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
    return 1 if any(p["status"] == "failed" for p in record["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
