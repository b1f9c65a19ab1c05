"""What evalkit's process and GPU handling does on a real NVIDIA GPU, measured in one command, in a few minutes.

Each part runs evalkit's own modules (the GPU parts in fresh processes: benchmarks/common/gpu_roles.py and
gpu_hf.py) and records its figures, or its error, in one JSON file; one part's failure leaves the others to run.

1. ``guard_fork``: a try's signal guard (``evalkit.run.attempt.guard``), then a child forked as CUDA vLLM forks
   its EngineCore, which sets its own SIGTERM handler, runs a cuBLAS GEMM and is terminated: did the try's pipe
   see a byte (it must not), and, for contrast, the same with the guard's state left to the child.
2. ``memory``: NVML's total and free against ``torch.cuda.mem_get_info()``, and the CUDA context's size.
3. ``release``: how long the GPU's memory takes to come back after ``process_group.end_group`` kills a process
   holding most of it.
4. ``collect_env``: whether torch's ``collect_env`` and evalkit's ``pretty_env_info`` touch CUDA.
5. ``driver_cuda``: the driver's CUDA version (``gpus.driver_cuda``) against ``torch.version.cuda``.
6. ``hf_batch``: the HF engine's bfloat16 log-likelihoods at batch 1 against batch 16, on a small random Llama.

Without a GPU, parts 2, 3, 5 and 6 are recorded as skipped and the rest run on the CPU. A part that cannot measure
what it is for says so in its status ("not measured: ..."), never "ok": on a GPU machine without nvidia-ml-py's
``pynvml`` (evalkit's dependency, not torch's), parts 2, 3 and 5, which read NVML. On a machine without
hydra-core, omegaconf or nvidia-ml-py, ``--pack-deps DIR`` here copies them (pure Python, about 2 MB) and
``--deps DIR`` there puts them on the path.

Run from the repository root: ``python -m benchmarks.gpu_check --out gpu_check.json``. Exit status: 0 every
part ran, was skipped or could not measure (its status says which), 1 one failed (its error is in the file).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
# module: dist-info (pynvml is one file, nvidia-ml-py's)
DEPS = {"hydra": "hydra_core", "omegaconf": "omegaconf", "antlr4": "antlr4_python3_runtime", "pynvml": "nvidia_ml_py"}
NO_CUDA = "skipped: no CUDA device"
NOT_MEASURED = "not measured: "
NO_NVML = (NOT_MEASURED + "NVML unavailable (GPUs found by {how}); nvidia-ml-py's pynvml is evalkit's dependency, "
           "not torch's: pip install nvidia-ml-py, or bring it with --pack-deps/--deps")


class NotMeasured(Exception):
    """A part found nothing to measure (a reading it needs came back empty); the message says which."""
HOLD = 0.9  # share of the free GPU memory the killed process holds
BACK_WAIT = 60.0  # seconds to wait for the memory to come back


def pack_deps(folder: Path) -> int:
    """Copy the pure-Python packages evalkit's config needs (and their dist-info) into folder; returns its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for module, dist in DEPS.items():
        origin = Path(importlib.util.find_spec(module).origin)
        if origin.name == "__init__.py":
            package = origin.parent
            shutil.copytree(package, folder / module, ignore=skip, dirs_exist_ok=True)
        else:  # a module of one file
            package = origin
            shutil.copy2(origin, folder / origin.name)
        for info in package.parent.glob(f"{dist}-*.dist-info"):
            shutil.copytree(info, folder / info.name, ignore=skip, dirs_exist_ok=True)
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def child_env(deps: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (ROOT, deps, env.get("PYTHONPATH")) if p)
    return env


def role(module: str, *args: str, deps: Path | None, timeout: float = 240) -> dict[str, Any]:
    """Run ``python -m module args`` in a fresh process; its last stdout line, as JSON."""
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=child_env(deps))
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


def each(module: str, variants: tuple[str, ...], *args: str, deps: Path | None) -> dict[str, dict[str, Any]]:
    """One fresh process per variant; a variant that fails records its error and leaves the others."""
    found = {}
    for variant in variants:
        try:
            found[variant] = role(module, *args[:1], variant, *args[1:], deps=deps)
        except Exception as error:
            found[variant] = {"error": f"{type(error).__name__}: {error}"}
    return found


def guard_fork(device: str, deps: Path | None) -> dict[str, Any]:
    """"fixed": evalkit as it is; "unfixed": the guard's state left to the forked child, for contrast."""
    cases = each("benchmarks.common.gpu_roles", ("fixed", "unfixed"), "guard", device, deps=deps)
    byte = {name: case.get("pipe_saw_byte") for name, case in cases.items()}
    return {"evalkit_pipe_saw_byte": byte["fixed"], "without_the_child_reset_pipe_saw_byte": byte["unfixed"],
            "as_expected": byte == {"fixed": False, "unfixed": True}, **cases}


def memory(deps: Path | None) -> dict[str, Any]:
    return role("benchmarks.common.gpu_roles", "context", deps=deps)


def release(deps: Path | None) -> dict[str, Any]:
    from evalkit.engine.machine import gpus
    from evalkit.engine.machine.process_group import end_group

    before = gpus.visible_gpus()
    if not before or before[0].free_bytes is None:
        raise NotMeasured(f"NVML gives no free memory for the GPU ({gpus.how_found()})")
    holder = subprocess.Popen([sys.executable, "-m", "benchmarks.common.gpu_roles", "hold", str(HOLD)],
                              stdout=subprocess.PIPE, cwd=ROOT, env=child_env(deps), start_new_session=True)
    try:
        from benchmarks.common.gpu_roles import read_line

        held = read_line(holder.stdout.fileno(), 180.0)
        holding = gpus.visible_gpus()[0].free_bytes
        started = time.perf_counter()
        ended = end_group(holder.pid, leader=holder)
        ended_at = time.perf_counter() - started
        short = gpus.memory_back(before, timeout=BACK_WAIT, poll=0.02)
        back_at = time.perf_counter() - started
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
    return {**held, "free_before": before[0].free_bytes, "free_while_held": holding, "group_ended": ended,
            "end_group_seconds": round(ended_at, 3), "memory_back": not short,
            "memory_back_seconds": round(back_at, 3) if not short else f"not back after {BACK_WAIT:g} s",
            "free_after": gpus.visible_gpus()[0].free_bytes, "slack_bytes": gpus.MEMORY_SLACK}


def collect_env(deps: Path | None) -> dict[str, Any]:
    found = each("benchmarks.common.gpu_roles", ("torch", "evalkit"), "env", deps=deps)
    return {"evalkit_touches_cuda": found["evalkit"].get("cuda_touched"), **found}


def driver_cuda() -> dict[str, Any]:
    import torch

    from evalkit.engine.machine import gpus

    driver = gpus.driver_cuda()
    if driver is None:
        raise NotMeasured("NVML gives no driver CUDA version")
    built = torch.version.cuda
    supports = None
    if driver and built:
        supports = driver >= tuple(int(n) for n in built.split(".")[:2])
    return {"driver_cuda": ".".join(map(str, driver)) if driver else None, "torch_cuda": built,
            "driver_supports_torch": supports}


def hf_batch(device: str, deps: Path | None) -> dict[str, Any]:
    return role("benchmarks.common.gpu_hf", device, deps=deps, timeout=300)


def cannot_measure(found: list[Any], how: str, torch_cuda: str | None) -> dict[str, str | None]:
    """Why each part that needs the GPU cannot measure here (NO_CUDA, NO_NVML), None for one that can."""
    if not found or torch_cuda is None:
        return {name: NO_CUDA for name in ("memory", "release", "driver_cuda")}
    nvml = None if how == "nvml" else NO_NVML.format(how=how)
    return {"memory": nvml, "release": nvml, "driver_cuda": nvml}


def run_part(name: str, part: Callable[[], dict[str, Any]] | None, why_not: str | None = None) -> dict[str, Any]:
    """The part's figures with status "ok", or "failed" with its error; without running it, why_not as its status
    (a skip or a "not measured"); a part that raises NotMeasured is "not measured" too, never "ok"."""
    if part is None or why_not:
        status = why_not or NO_CUDA
        print(f"{name}: {status}", flush=True)
        return {"status": status}
    started = time.perf_counter()
    try:
        figures = {"status": "ok", **part()}
    except NotMeasured as error:
        figures = {"status": f"{NOT_MEASURED}{error}"}
    except Exception as error:  # recorded; the other parts still run
        figures = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    figures["seconds"] = round(time.perf_counter() - started, 2)
    print(f"{name}: {figures['status']} in {figures['seconds']} s", flush=True)
    return figures


def write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON file the figures go to")
    parser.add_argument("--deps", type=Path, help="a folder made by --pack-deps, put on the path")
    parser.add_argument("--pack-deps", type=Path, metavar="DIR",
                        help="copy hydra-core, omegaconf, antlr4 and nvidia-ml-py to DIR")
    parser.add_argument("--hf-device", choices=("cuda", "cpu"), help="where part 6 runs (default: cuda, if any)")
    args = parser.parse_args(argv)
    if args.pack_deps:
        print(f"gpu_check: {pack_deps(args.pack_deps)} bytes in {args.pack_deps}", flush=True)
        return 0
    if args.deps:
        sys.path.append(str(args.deps.resolve()))
    deps = args.deps.resolve() if args.deps else None
    from evalkit.engine.machine import gpus
    from evalkit.engine.machine.environment import use_nvml_for_cuda_checks

    use_nvml_for_cuda_checks()  # this process reads torch.version.cuda, and must never start CUDA
    import torch

    found, how = gpus.discover()
    cuda = bool(found) and torch.version.cuda is not None
    device = "cuda" if cuda else "cpu"
    hf_device = args.hf_device or (device if cuda else None)
    why_not = cannot_measure(found, how, torch.version.cuda)
    started = time.perf_counter()
    parts = {
        "guard_fork": run_part("guard_fork", lambda: guard_fork(device, deps)),
        "memory": run_part("memory", lambda: memory(deps), why_not["memory"]),
        "release": run_part("release", lambda: release(deps), why_not["release"]),
        "collect_env": run_part("collect_env", lambda: collect_env(deps)),
        "driver_cuda": run_part("driver_cuda", driver_cuda, why_not["driver_cuda"]),
        "hf_batch": run_part("hf_batch", (lambda: hf_batch(hf_device, deps)) if hf_device else None),
    }
    record = {"benchmark": "benchmarks.gpu_check", "date": datetime.datetime.now().astimezone().isoformat(),
              "machine": {"gpus": gpus.summary(found, how), "python": platform.python_version(),
                          "torch": torch.__version__, "platform": platform.platform()},
              "deps": str(deps) if deps else None, "seconds": round(time.perf_counter() - started, 1),
              "parts": parts}
    write(args.out, record)
    print(f"gpu_check: {args.out} written in {record['seconds']} s", flush=True)
    return 1 if any(p["status"] == "failed" for p in parts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
