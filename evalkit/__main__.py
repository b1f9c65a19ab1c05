"""``python -m evalkit [key=value ...]``: compose the Hydra config, run it, print the scores.

Examples: ``python -m evalkit`` (embedded model and tasks), ``python -m evalkit model=qwen2-7b
tensor_parallel_size=4 tasks=[gsm8k]``, a sweep: ``python -m evalkit -m max_model_len=2048,4096``.

In a sweep every point is recorded in its sweep folder (evalkit/sweep/points.py); a point whose config an
earlier run already has is skipped, and a point that fails is recorded with its error while the sweep goes on
to the next one (a stop by Ctrl-C or SIGTERM still ends the sweep). The report and the exit status come at
the end of the sweep (evalkit/sweep/callback.py).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from evalkit.config import CONF_DIR, ConfigError, EvalConfig, register_configs
from evalkit.engine.machine.environment import use_nvml_for_cuda_checks
from evalkit.overrides import arguments_to_check, check_overrides


# a point running beside another whose answers it shares (one store) waits for it, then reuses them
POINT_LOCK_WAIT = 24 * 3600.0


def fail(message: str, code: int = 2) -> None:
    from evalkit.untrusted import scrubbed

    print(f"evalkit: error: {scrubbed(message)}", file=sys.stderr)  # a URL's password in a message: not shown
    sys.exit(code)


def run_one(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        hydra_cfg = HydraConfig.get()
        run_point(OmegaConf.to_object(cfg), num=hydra_cfg.job.num, overrides=list(hydra_cfg.overrides.task),
                  folder=Path(hydra_cfg.runtime.output_dir))
        return
    from evalkit.run.supervise import RunFailed, RunStopped, supervise

    try:
        run_dir = supervise(OmegaConf.to_object(cfg))
    except ConfigError as error:
        fail(str(error))
    except RunStopped as error:
        fail(f"stopped: {error}", code=error.exit_code)
    except RunFailed as error:
        fail(str(error), code=1)
    print(f"\n{(run_dir / 'summary.md').read_text()}\nwritten to {run_dir}")


def run_point(cfg: EvalConfig, *, num: int, overrides: list[str], folder: Path) -> None:
    """One point of a sweep: recorded "running", then skipped (an earlier run has its config), ok or failed.

    A failure is recorded and returns, so the sweep goes on; a stop (RunStopped, Ctrl-C) is recorded and ends it."""
    from evalkit.config import devices_needed
    from evalkit.run.supervise import RunFailed, RunStopped, supervise
    from evalkit.sweep.devices import check_launcher_devices, point_launcher
    from evalkit.sweep.points import PointRecord, find_completed, now_iso, write_point
    from evalkit.untrusted import scrubbed

    record = PointRecord(num=num, overrides=scrubbed(overrides), status="running", run_dir=None, error=None,
                         wall_seconds=None, devices=os.environ.get("ASCEND_RT_VISIBLE_DEVICES",
                                                                   os.environ.get("CUDA_VISIBLE_DEVICES")),
                         host=socket.gethostname(), started=now_iso())
    write_point(folder, record)
    started = time.perf_counter()

    def finish(status: str, run_dir: Path | None = None, error: str | None = None) -> None:
        folder_name = str(Path(run_dir).resolve()) if run_dir else None  # readable from any working directory
        write_point(folder, replace(record, status=status, run_dir=folder_name, error=error and one_line(error),
                                    wall_seconds=round(time.perf_counter() - started, 1)))

    try:
        done, passed = find_completed(cfg.output_dir, cfg.model_name, asdict(cfg))
        if done is None and passed:
            print(f"evalkit: point {num} runs again: {passed}", file=sys.stderr)
        if done is not None:
            done = done.resolve()
            finish("skipped", done)
            print(f"evalkit: point {num} was done in {done}; skipped", file=sys.stderr)
            return
        check_launcher_devices(devices_needed(cfg), point_launcher() or {})  # Slurm's jobs: before the engine
        run_dir = supervise(cfg, wait_for_lock=POINT_LOCK_WAIT)
    except RunStopped as error:
        finish("failed", error=f"stopped: {error}")
        notice_to_launcher(error.exit_code - 128, num=num)
        fail(f"stopped: {error}", code=error.exit_code)
    except (ConfigError, RunFailed) as error:
        finish("failed", error=one_line(str(error)))
        print(f"evalkit: error: point {num} failed: {one_line(str(error))}", file=sys.stderr)
        return
    except Exception as error:  # a bug, not bad input: its traceback, and the sweep goes on
        traceback.print_exc()
        finish("failed", error=one_line(f"{type(error).__name__}: {error}"))
        print(f"evalkit: error: point {num} failed: {one_line(f'{type(error).__name__}: {error}')}", file=sys.stderr)
        return
    except BaseException as error:  # Ctrl-C or SIGTERM in this process: the sweep ends here
        what = f"exit code {error.code}" if isinstance(error, SystemExit) else type(error).__name__
        finish("failed", error=f"stopped ({what})")
        raise
    finish("ok", run_dir)
    print(f"\n{(run_dir / 'summary.md').read_text()}\nwritten to {run_dir}")


def notice_to_launcher(signum: int, *, num: int) -> None:
    """A point stopped by a signal that its launcher handles too reaches that handler once the point is recorded:
    submitit's, in a Slurm job, takes SIGUSR2 (the notice of the time limit, ``--signal=USR2@N``, or of a
    preemption) to requeue the job where its rules allow, and the requeued job resumes the point from the request
    store. SIGTERM and SIGINT are the stop itself; a signal no one else handles goes nowhere."""
    handler = signal.getsignal(signum)
    if signum in (signal.SIGTERM, signal.SIGINT) or not callable(handler):
        return
    try:
        handler(signum, None)  # submitit: requeues the job and exits
    except Exception as error:  # submitit's UncompletedJobError: not requeued (timed out too often, not checkpointable)
        print(f"evalkit: point {num} is not requeued: {one_line(str(error))}", file=sys.stderr)


def one_line(text: str) -> str:
    """text on one line, a URL's user:password taken out (a point's error is recorded in its point.json)."""
    from evalkit.untrusted import scrubbed

    return scrubbed(" ".join(text.split()))


def main() -> None:
    use_nvml_for_cuda_checks()  # before anything imports torch (evalkit/engine/machine/environment.py says why)
    try:
        check_overrides(arguments_to_check(sys.argv[1:]))
    except ConfigError as error:
        fail(str(error))
    register_configs()
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(run_one)()


if __name__ == "__main__":
    main()
