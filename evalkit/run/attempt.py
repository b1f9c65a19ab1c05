"""``python -m evalkit.run.attempt SPEC OUTCOME [DEATH_FD]``: one try of a run, started by evalkit/run/supervise.py.

Reads the config and the earlier tries from SPEC (JSON), runs it, and writes an Outcome to OUTCOME
(JSON, atomically). It leads its own process group, which holds the vLLM engine processes too. A watchdog
thread, not the main thread (which may sit in a long C call), kills the whole group at once when

* the try gets SIGTERM, SIGINT or a Slurm job's notice (:func:`stop_signals`) from outside (a scheduler
  preempting the job or warning of its time limit, a user): the outcome says
  "stopped" first, so the supervisor neither retries nor reads the kill as a lack of memory;
* the supervisor dies, even by SIGKILL: the pipe DEATH_FD, whose only writer is the supervisor, reads
  end-of-file (and PR_SET_PDEATHSIG sends SIGTERM as a second line of defence).

Finished answers are safe in the request store either way. The outcome is written once (:class:`OutcomeFile`):
the first writer wins, and a stop that comes while the main thread records its finished run leaves that record.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from evalkit.config import ConfigError, EvalConfig
from evalkit.engine.machine import forks
from evalkit.engine.machine.environment import use_nvml_for_cuda_checks

PR_SET_PDEATHSIG = 1
GONE_WAIT = 0.2  # seconds a stop by signal looks for the supervisor's end (forsaken)


def die_with_group(*_: object, **__: object) -> None:
    """Kill this process's group (the try and its engine); a signal handler's or end()'s arguments are ignored."""
    os.killpg(0, signal.SIGKILL)


def forsaken(work: Path, supervisor: int, death: int | None) -> Callable[..., None]:
    """die_with_group, removing the try's folder (SPEC's and OUTCOME's) first where the supervisor that made it is
    gone (killed, even by SIGKILL): no one is left to read the outcome or to remove the folder.

    gone: the supervisor's pipe closed. A stop by signal looks at that pipe for GONE_WAIT seconds first: the
    kernel's parent-death SIGTERM can come while the supervisor's last threads still hold the pipe and its pid
    (PR_SET_PDEATHSIG fires when the thread that started the try exits), so the new parent is no sign either."""

    def end(gone: bool = False) -> None:
        if not gone and death is not None:
            ready, _, _ = select.select([death], [], [], GONE_WAIT)
            gone = bool(ready) and not os.read(death, 1)  # end-of-file: its only writer is gone
        if gone or os.getppid() != supervisor:
            shutil.rmtree(work, ignore_errors=True)
        die_with_group()

    return end


def die_with_parent() -> None:
    """Ask the kernel to send SIGTERM when the supervisor goes away (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the supervisor was already gone
        die_with_group()


class OutcomeFile:
    """The try's outcome, written once: whoever writes first (the main thread's result, or "stopped" from a
    signal) wins, atomically, and a later writer leaves it (a unique temporary file hard-linked to the name,
    which fails when the name exists). The lock orders the two writers: a stop waits while the main thread
    records its result, so a run that was published is never recorded as stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()

    def write(self, *, wait: bool = True, **outcome) -> bool | None:
        """Write outcome unless one is written: True when this call wrote it, False when one was there, None
        when another writer holds the file and wait is False."""
        if not self.lock.acquire(blocking=wait):
            return None
        try:
            return self._link(outcome)
        finally:
            self.lock.release()

    def _link(self, outcome: dict) -> bool:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(outcome))
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)


def stop(signum: int, outcome: OutcomeFile, *, wait: bool, kill: Callable[[], None] | None = None) -> None:
    """Record that the try was stopped from outside (unless it already has an outcome), then kill the group.

    wait: wait for a writer that holds the outcome (the watchdog thread). The main thread's own handler passes
    False: it may have interrupted the main thread in the middle of its write, which then finishes and ends the
    try; the watchdog, which got the same signal, kills the group after it."""
    name = signal.Signals(signum).name
    if outcome.write(wait=wait, status="stopped", signal=name,
                     message=f"the try was stopped by {name} from outside") is not None:
        (kill or die_with_group)()


def watchdog(signals: int, death: int | None, outcome: OutcomeFile, end: Callable[..., None] = die_with_group) -> None:
    """Block until a signal arrives (its number written to the signals pipe by the C-level handler) or the
    supervisor's pipe closes; then kill the group (end), this process and its engine included."""
    ready, _, _ = select.select([signals] + ([death] if death is not None else []), [], [])
    if signals in ready:
        stop(os.read(signals, 1)[0], outcome, wait=True, kill=end)
    end(gone=True)  # the supervisor's pipe closed: it is gone


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a run from outside: SIGTERM, SIGINT, and the notice a Slurm job of submitit's gets
    before its time limit or a preemption (SIGUSR2, or the signal SUBMITIT_PREEMPT_SIGNAL names), whose default
    action would end every process of the run at once, without a record."""
    notice = getattr(signal, f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}", signal.SIGUSR2)
    return signal.SIGTERM, signal.SIGINT, notice


def guard(outcome: OutcomeFile, death: int | None, end: Callable[..., None] = die_with_group) -> None:
    """The stop signals (:func:`stop_signals`) and the supervisor's death handled off the main thread (see the
    module docstring); the main thread's own handler does the same when it gets there first (or when a library took the wakeup fd).

    None of it reaches a forked child (vLLM's EngineCore and workers on GPUs): the child gets the handlers back
    that were there before, no wakeup fd and none of the pipes (evalkit/engine/machine/forks.py); else the
    SIGTERM that vLLM's shutdown sends its EngineCore would be written into this pipe, and read as a stop."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    forks.close_in_child(read, write)
    forks.wakeup_in_child(write)
    signal.set_wakeup_fd(write)  # the C-level handler writes the signal number here at once
    forks.handlers_in_child({sig: signal.signal(sig, lambda signum, frame: stop(signum, outcome, wait=False, kill=end))
                             for sig in stop_signals()})
    threading.Thread(target=watchdog, args=(read, death, outcome, end), daemon=True, name="evalkit-watchdog").start()


def main(spec_file: str, outcome_file: str, death_fd: str | None = None) -> int:
    use_nvml_for_cuda_checks()  # before lm-eval, transformers or vLLM import torch (evalkit/engine/machine/environment.py)
    outcome = OutcomeFile(Path(outcome_file))
    death = int(death_fd) if death_fd else None
    if death is not None:
        forks.close_in_child(death)
    end = forsaken(Path(outcome_file).parent, os.getppid(), death)
    die_with_parent()
    guard(outcome, death, end)
    from evalkit.harness.budget import PromptTooLong
    from evalkit.run.evaluate import evaluate

    spec = json.loads(Path(spec_file).read_text())
    cfg: EvalConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalConfig), spec["config"]))
    try:
        run_dir = evaluate(cfg, attempts=spec["attempts"], started_at=spec.get("started_at"))
    except (ConfigError, PromptTooLong) as error:
        outcome.write(status="config", message=str(error))
        return 2
    except Exception as error:  # any other failure: the supervisor decides whether memory was the cause
        traceback.print_exc()
        causes = []
        while error is not None and len(causes) < 5:
            causes.append(f"{type(error).__name__}: {error}")
            error = error.__cause__ or error.__context__
        outcome.write(status="error", message=" <- ".join(causes))
        return 1
    outcome.write(status="ok", run_dir=str(run_dir))
    return 0


def leave(code: int) -> None:
    """End this try now that its outcome is written. After a finished run, without the interpreter's teardown:
    everything is on disk (the run folder and the request store are written and fsync'ed, the engine closed),
    and tearing down the imported vLLM, torch and lm-eval took 2.6 s of a 24 s default run (measured here)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    leave(main(*sys.argv[1:4]))
