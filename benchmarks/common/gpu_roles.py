"""What ``benchmarks/gpu_check.py`` runs in fresh processes, one role each, so that its own process never
initialises CUDA (a CUDA process cannot fork a working child) and a crash costs one figure, not the check.

``python -m benchmarks.common.gpu_roles ROLE [ARG ...]`` prints one JSON line, the role's figures:

* ``guard fixed|unfixed cuda|cpu``: evalkit's real ``attempt.guard()``, then a child forked as CUDA vLLM forks
  its EngineCore: it sets its own SIGTERM handler (vLLM's raises SystemExit), runs a GEMM (cuBLAS on cuda) and is
  SIGTERMed. Says whether the try's pipe saw a byte (its watchdog woke and wrote "stopped"). ``unfixed`` takes
  the guard's state back out of ``forks`` before the fork (``forks.forget``), so the child keeps it, as
  before evalkit dropped it in a forked child.
* ``context``: NVML's total and free against ``torch.cuda.mem_get_info()``, and what the CUDA context took.
* ``hold FRACTION``: holds that share of the GPU's free memory (plain cudaMalloc through torch) until killed.
* ``env torch|evalkit``: torch's ``collect_env.get_pretty_env_info()`` or evalkit's ``pretty_env_info()``, and
  whether CUDA was touched after it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path

from evalkit.engine.machine import gpus
from evalkit.engine.machine.environment import cuda_touched, use_nvml_for_cuda_checks

LINE_WAIT = 180.0  # seconds a parent waits for a child's line (CUDA's start in a fresh child takes a few)


def read_line(fd: int, timeout: float) -> dict:
    """One JSON line from fd, or {"error": ...} when none comes in time or the writer closed it."""
    data, deadline = b"", time.monotonic() + timeout
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            return {"error": f"no line from the child ({'closed' if ready else 'timed out'}); read {data[-200:]!r}"}
        data += chunk
    return json.loads(data.decode().splitlines()[-1])


def pipe_ends(fd: int) -> tuple[int, ...]:
    """This process's descriptors on the same pipe as fd (its two ends), found through /proc/self/fd."""
    inode = os.fstat(fd).st_ino
    ends = []
    for name in os.listdir("/proc/self/fd"):
        try:
            found = os.fstat(int(name))
        except OSError:  # the listing's own descriptor, closed since
            continue
        if stat.S_ISFIFO(found.st_mode) and found.st_ino == inode:
            ends.append(int(name))
    return tuple(ends)


def engine_core(report: int, device: str) -> None:
    """The forked child: what it inherited, its own SIGTERM handler, a GEMM; then it waits to be terminated."""
    try:
        wakeup = signal.set_wakeup_fd(-1)
        if wakeup != -1:
            signal.set_wakeup_fd(wakeup)
        inherited = signal.getsignal(signal.SIGTERM)

        def shutdown(signum, frame):  # vLLM's EngineCore: signal.signal(SIGTERM, ...) raising SystemExit
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, shutdown)
        facts = {"wakeup_fd_inherited": wakeup != -1,
                 "sigterm_handler_inherited": getattr(inherited, "__qualname__", None) or repr(inherited)}
        try:
            import torch

            a = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
            product = a @ a
            if device == "cuda":
                torch.cuda.synchronize()
            facts["gemm"] = f"ran on {device}: 1024x1024 {str(a.dtype).removeprefix('torch.')}, " \
                            f"checksum {float(product.float().abs().sum()):.4g}"
        except Exception as error:  # a CUDA child of a CUDA parent: "initialization error"
            facts["gemm"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        os.write(report, (json.dumps(facts) + "\n").encode())
        while True:
            time.sleep(0.05)
    except SystemExit:
        os.write(report, b'{"terminated": "SystemExit from its own SIGTERM handler"}\n')
    except BaseException as error:
        os.write(report, (json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n").encode())
    finally:
        os._exit(0)


def guard(fixed: bool, device: str) -> dict:
    use_nvml_for_cuda_checks()  # as a try does first (attempt.main)
    import torch

    from evalkit.engine.machine import forks
    from evalkit.run import attempt

    woke = threading.Event()
    with tempfile.TemporaryDirectory() as scratch:
        outcome = attempt.OutcomeFile(Path(scratch) / "outcome.json")
        attempt.guard(outcome, None, end=lambda *_, **__: woke.set())  # end: record, never kill this group
        if not fixed:
            wakeup = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(wakeup)
            forks.forget(fds=pipe_ends(wakeup), signals=(signal.SIGTERM, signal.SIGINT), wakeup=wakeup)
        parent_cuda = cuda_touched()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            engine_core(write, device)
        os.close(write)
        child = read_line(read, LINE_WAIT)
        started = time.perf_counter()
        os.kill(pid, signal.SIGTERM)  # vLLM's shutdown terminates its EngineCore
        ending = read_line(read, 30.0)
        _, status = os.waitpid(pid, 0)
        gone_in = time.perf_counter() - started
        woke.wait(1.0)  # the watchdog, had a byte come, wakes within milliseconds
        written = json.loads(outcome.path.read_text()) if outcome.path.exists() else None
    return {"fix": fixed, "device": device, "parent_cuda_touched_before_fork": parent_cuda, "child": child,
            "child_end": ending, "child_exit": os.waitstatus_to_exitcode(status),
            "terminate_seconds": round(gone_in, 3),
            "pipe_saw_byte": woke.is_set() or written is not None, "outcome_written": written}


def context() -> dict:
    use_nvml_for_cuda_checks()
    import torch

    before = gpus.visible_gpus()[0]
    free, total = torch.cuda.mem_get_info()  # creates the context on GPU 0, allocates nothing
    after = gpus.visible_gpus()[0]
    return {"gpu": before.name, "nvml_total": before.total_bytes, "torch_total": total,
            "nvml_free_before_context": before.free_bytes, "nvml_free_after_context": after.free_bytes,
            "torch_free": free, "context_bytes": before.free_bytes - after.free_bytes,
            "torch_reserved": torch.cuda.memory_reserved(), "cuda_touched": cuda_touched()}


def hold(fraction: float) -> None:
    use_nvml_for_cuda_checks()
    import torch

    free, _ = torch.cuda.mem_get_info()
    held = torch.empty(int(free * fraction), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print(json.dumps({"held_bytes": held.numel()}), flush=True)
    while True:
        time.sleep(1)


def env(which: str) -> dict:
    use_nvml_for_cuda_checks()
    import torch

    started = time.perf_counter()
    if which == "torch":
        from torch.utils.collect_env import get_pretty_env_info as pretty
    else:
        from evalkit.harness.lm_eval_compat import pretty_env_info as pretty
    text = pretty()
    return {"which": which, "seconds": round(time.perf_counter() - started, 2), "chars": len(text),
            "torch_cuda_initialized": torch.cuda.is_initialized(), "cuda_touched": cuda_touched()}


def main(argv: list[str]) -> int:
    role, args = argv[0], argv[1:]
    if role == "hold":
        hold(float(args[0]))
    figures = {"guard": lambda: guard(args[0] == "fixed", args[1]), "context": context,
               "env": lambda: env(args[0])}[role]()
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
