"""``python -m evalkit.run.attempt SPEC OUTCOME [DEATH_FD]``: one try of a run, started by evalkit/run/supervise.py.

Reads the config and the earlier tries from SPEC (JSON), runs it, and writes an Outcome to OUTCOME
(JSON, atomically). It leads its own process group, which holds the vLLM engine processes too. A watchdog
thread, not the main thread (which may sit in a long C call), kills the whole group at once when

* the try gets SIGTERM or SIGINT from outside (a scheduler preempting the job, a user): the outcome says
  "stopped" first, so the supervisor neither retries nor reads the kill as a lack of memory;
* the supervisor dies, even by SIGKILL: the pipe DEATH_FD, whose only writer is the supervisor, reads
  end-of-file (and PR_SET_PDEATHSIG sends SIGTERM as a second line of defence).

Finished answers are safe in the request store either way.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import threading
import traceback
from pathlib import Path

from omegaconf import OmegaConf

from evalkit.config import ConfigError, EvalConfig
from evalkit.engine.environment import use_nvml_for_cuda_checks

PR_SET_PDEATHSIG = 1


def die_with_group(signum=None, frame=None) -> None:
    os.killpg(0, signal.SIGKILL)


def die_with_parent() -> None:
    """Ask the kernel to send SIGTERM when the supervisor goes away (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the supervisor was already gone
        die_with_group()


def write_outcome(path: Path, **outcome) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(outcome))
    os.replace(tmp, path)


def stop(signum: int, outcome: Path) -> None:
    """Record that the try was stopped from outside (unless it already finished), then kill the group."""
    if not outcome.exists():
        write_outcome(outcome, status="stopped", signal=signal.Signals(signum).name,
                      message=f"the try was stopped by {signal.Signals(signum).name} from outside")
    die_with_group()


def watchdog(signals: int, death: int | None, outcome: Path) -> None:
    """Block until a signal arrives (its number written to the signals pipe by the C-level handler) or the
    supervisor's pipe closes; then kill the group, this process and its engine included."""
    ready, _, _ = select.select([signals] + ([death] if death is not None else []), [], [])
    if signals in ready:
        stop(os.read(signals, 1)[0], outcome)
    die_with_group()


def guard(outcome: Path, death: int | None) -> None:
    """SIGTERM/SIGINT and the supervisor's death handled off the main thread (see the module docstring);
    the main thread's own handler does the same when it gets there first (or when a library took the wakeup fd)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)  # the C-level handler writes the signal number here at once
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop(signum, outcome))
    threading.Thread(target=watchdog, args=(read, death, outcome), daemon=True, name="evalkit-watchdog").start()


def main(spec_file: str, outcome_file: str, death_fd: str | None = None) -> int:
    use_nvml_for_cuda_checks()  # before lm-eval, transformers or vLLM import torch (evalkit/engine/environment.py)
    outcome = Path(outcome_file)
    die_with_parent()
    guard(outcome, int(death_fd) if death_fd else None)
    from evalkit.harness.budget import PromptTooLong
    from evalkit.run.evaluate import evaluate

    spec = json.loads(Path(spec_file).read_text())
    cfg: EvalConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalConfig), spec["config"]))
    try:
        run_dir = evaluate(cfg, attempts=spec["attempts"], started_at=spec.get("started_at"))
    except (ConfigError, PromptTooLong) as error:
        write_outcome(outcome, status="config", message=str(error))
        return 2
    except Exception as error:  # any other failure: the supervisor decides whether memory was the cause
        traceback.print_exc()
        causes = []
        while error is not None and len(causes) < 5:
            causes.append(f"{type(error).__name__}: {error}")
            error = error.__cause__ or error.__context__
        write_outcome(outcome, status="error", message=" <- ".join(causes))
        return 1
    write_outcome(outcome, status="ok", run_dir=str(run_dir))
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
