"""``python -m evalkit [key=value ...]``: compose the Hydra config, run it, print the scores.

Examples: ``python -m evalkit`` (embedded model and tasks), ``python -m evalkit model=qwen2-7b
tensor_parallel_size=4 tasks=[gsm8k]``, a sweep: ``python -m evalkit -m max_model_len=2048,4096``.

In a sweep every point is recorded in its sweep folder (evalkit/sweep/points.py); a point whose config an
earlier run already has is skipped, and a point that fails is recorded with its error while the sweep goes on
to the next one (a stop by Ctrl-C or SIGTERM still ends the sweep). The report and the exit status come at
the end of the sweep (evalkit/sweep/callback.py).
"""

from __future__ import annotations

import json
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

from evalkit.config import CONF_DIR, ConfigError, EvalConfig, compose_config, register_configs, validate
from evalkit.engine.machine.environment import use_nvml_for_cuda_checks
from evalkit.overrides import arguments_to_check, check_overrides, prepared


# a point running beside another whose answers it shares (one store) waits for it, then reuses them
POINT_LOCK_WAIT = 24 * 3600.0
GATE_FAILED = 3  # the exit status of a gated run that failed: 1 is the gate's "worse" there


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
    except RunFailed as error:  # with a gate, 1 is its verdict (worse): a run that failed has no verdict
        fail(str(error), code=GATE_FAILED if cfg.gate.reference else 1)
    print(f"\n{(run_dir / 'summary.md').read_text()}\nwritten to {run_dir}")
    gated = gate_verdict(run_dir)
    if gated:  # gate.reference: the gate's verdict is the exit status (1: worse, or not shown equivalent)
        sys.exit(gated["exit_code"])


def gate_verdict(run_dir: Path) -> dict | None:
    """The gate's record of a run made with gate.reference, its verdict printed in one line; None without one."""
    gated = json.loads((run_dir / "results.json").read_text())["evalkit"].get("gate")
    if gated:
        early = "stopped early" if gated["stopped_early"] else "every document evaluated"
        print(f"gate: {gated['verdict']} ({early}: {sum(gated['documents'].values())} of "
              f"{sum(gated['of'].values())} documents): {gated['reason']}")
    return gated


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
    gate_verdict(run_dir)  # a point's gate decides its own run only: the sweep's exit status counts failed points


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


MULTIRUN = {"-m", "--multirun"}
SHOWS = {"-c", "--cfg", "-i", "--info"}  # Hydra's options that print and run nothing: one run's config only


def points(overrides: list[str]) -> list[list[str]] | None:
    """Each point's overrides, as Hydra's basic sweeper expands a sweep (every combination of the values, in the
    order given); hydra's own keys left out. None where Hydra expands them itself (glob, an interval for another
    sweeper) or cannot parse them (its own error follows)."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    try:
        for override in OverridesParser.create().parse_overrides(overrides=overrides):
            if override.key_or_group.startswith("hydra"):
                continue
            if override.is_sweep_override() and not override.is_discrete_sweep():
                return None
            if not override.is_sweep_override():
                choices.append([override.input_line])
                continue
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
    except Exception:
        return None
    return [list(point) for point in itertools.product(*choices)]


def check_point(overrides: list[str], *, full: bool) -> EvalConfig:
    """One point's config, checked as its run checks it before the engine starts (full: every check,
    evalkit/run/evaluate.py prepare: the model's files, the devices, the tasks; else the config's values, the
    weights' folder and length, and the task names)."""
    from evalkit.engine.machine import preflight
    from evalkit.harness.tasks import indexed

    cfg = compose_config(overrides)
    if full:
        from evalkit.run.evaluate import Stopwatch, prepare

        prepare(cfg, check_devices=True, watch=Stopwatch())
        return cfg
    validate(cfg)
    model_dir = preflight.resolve_model_path(cfg.vllm_path)
    stated = preflight.model_context_length(model_dir) if Path(model_dir).is_dir() else None
    if stated and cfg.max_model_len > stated[0]:
        preflight.check_model(cfg, model_dir)  # its one line
    indexed(list(cfg.tasks), task_data=dict(cfg.task_data), extra_dirs=list(cfg.tasks_dirs))
    return cfg


def check_sweep(argv: list[str]) -> None:
    """A sweep none of whose points could start an engine is one line (the first point's mistake), before any sweep
    folder, report or engine. On this machine (Hydra's basic launcher) each point's config and weights are checked;
    points a launcher sends elsewhere, their config only (their weights are there). A sweep where some points pass
    runs, and records the others' mistakes as each point's failure."""
    overrides = arguments_to_check(argv)
    local = not any(o.split("=", 1)[0].lstrip("+~") == "hydra/launcher" for o in overrides)
    every = points(overrides) or []
    mistakes = []
    for point in every:
        try:
            if local:
                check_point(point, full=False)
            else:
                validate(compose_config(point))
        except ConfigError as error:
            mistakes.append(f"{' '.join(point)}: {error}" if len(every) > 1 else str(error))
        else:
            return
    if mistakes:
        more = len(mistakes) - 1
        raise ConfigError(mistakes[0] + (f" (and {more} more point{'s' * (more > 1)})" if more else ""))


def validate_main(argv: list[str], prog: str = "evalkit validate") -> int:
    """``evalkit validate [-m] key=value ...``: every check a run (or each point of a sweep) makes before its engine
    starts, and nothing else: exit 0 when all pass, else one line and exit 2."""
    if {"-h", "--help"} & set(argv):
        print(f"usage: {prog} [-m] [key=value ...]\n\n{validate_main.__doc__.split(':', 1)[1].strip()}")
        return 0
    argv = prepared(argv)
    options = [a for a in argv if a.startswith("-") and a not in MULTIRUN]
    try:
        if options:
            raise ConfigError(f"{options[0]}: {prog} takes key=value overrides (and -m for a sweep) only")
        overrides = arguments_to_check(argv)
        check_overrides(overrides)
        every = points(overrides)
        if every is None:
            raise ConfigError("this sweep is expanded by Hydra itself (glob or interval): validate its points "
                              "one value at a time")
        for point in every:
            try:
                cfg = check_point(point, full=True)
            except ConfigError as error:
                raise ConfigError(f"{' '.join(point)}: {error}" if len(every) > 1 else str(error)) from None
    except ConfigError as error:
        print(f"evalkit: error: {error}", file=sys.stderr)
        return 2
    what = f"{len(every)} points" if len(every) > 1 else f"{cfg.model_name} on {', '.join(cfg.tasks)}"
    print(f"evalkit: {what}: every check before the engine passed (no engine was started)")
    return 0


def main() -> None:
    use_nvml_for_cuda_checks()  # before anything imports torch (evalkit/engine/machine/environment.py says why)
    sys.argv = [sys.argv[0], *prepared(sys.argv[1:])]
    arguments = set(sys.argv[1:])
    try:
        if arguments & MULTIRUN and arguments & SHOWS:
            raise ConfigError(f"{sorted(arguments & SHOWS)[0]} shows one run's config, not a sweep's: drop -m, or "
                              "check every point with evalkit validate -m key=a,b ...")
        check_overrides(arguments_to_check(sys.argv[1:]))
        if arguments & MULTIRUN:
            check_sweep(sys.argv[1:])
    except ConfigError as error:
        fail(str(error))
    register_configs()
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(run_one)()


if __name__ == "__main__":
    main()
