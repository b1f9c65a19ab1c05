"""What a sweep does after each point and at its end: a Hydra callback (conf/config.yaml, ``hydra.callbacks``).

* after each point, with Hydra's basic (sequential) launcher, whose points run in this very process: the sweep's
  progress line (evalkit/sweep/points.py, ``sweep_line``), counted from the point records in the sweep folder;
* when the sweep ends, whatever the launcher (``on_multirun_end`` runs in the driver): the sweep report
  (evalkit/sweep/report.py) written into the sweep folder, where it is, a line for each failed point (naming its
  machine where that is not this one), a line for each point whose gate (gate.reference) failed, and the exit
  status, as a single run's: 1 when a point's gate says worse (or not equivalent, asked to be); else, when any
  point failed, 3 in a gated sweep (1 means only a gate's verdict there) and 1 in another. Hydra turns an
  exception from a callback into a warning, so the status is set with SystemExit.

Nothing happens in a single run.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"  # its _target_ in hydra.launcher


def sweep_arguments(config: DictConfig) -> list[str]:
    """The overrides the sweep was started with, and the sweeper's own params, as multirun.yaml keeps them."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    return [*OmegaConf.select(config, "hydra.overrides.task", default=[]), *(f"{k}={v}" for k, v in params.items())]


def progress(sweep_dir: Path) -> tuple[str, list]:
    """The sweep's progress line and its point records."""
    from evalkit.sweep.points import read_points, sweep_elapsed, sweep_line, sweep_total

    points = read_points(sweep_dir)
    multirun = sweep_dir / "multirun.yaml"
    total = sweep_total(sweep_arguments(OmegaConf.load(multirun))) if multirun.is_file() else 0
    return sweep_line(points, total, sweep_elapsed(points)), points


def scrub_multirun(sweep_dir: Path) -> None:
    """Hydra saves the sweep's config with its command line as multirun.yaml before the first point starts: the
    user:password of a URL in it (endpoint.url=http://user:pass@host/v1) is taken out, as from every record."""
    from evalkit.sweep.points import write_atomic
    from evalkit.untrusted import scrubbed

    multirun = sweep_dir / "multirun.yaml"
    try:
        text = multirun.read_text()
    except OSError:
        return
    if scrubbed(text) != text:
        write_atomic(multirun, scrubbed(text))


def refuse_pickled_passwords(config: DictConfig) -> None:
    """submitit's launchers pickle each point's config into the sweep folder (.submitit/): a URL's literal password
    in the sweep's config or overrides (hydra.overrides.task, the sweeper's params) would be kept there. Such a
    sweep stops in one line (exit 2) before any job is written; a password as an interpolation
    (``${oc.env:VAR}``) is resolved by each job, never pickled."""
    from evalkit.untrusted import literal_password

    if "submitit" not in str(OmegaConf.select(config, "hydra.launcher._target_", default="")):
        return
    # unresolved: an override that holds ${oc.env:VAR} would read as the variable's value
    if any(literal_password(str(text)) for text in leaves(OmegaConf.to_container(config, resolve=False))):
        print("evalkit: error: a URL in this sweep holds a password, which submitit would write into its job files "
              "in the sweep folder; pass it through the environment instead: "
              "endpoint.url='http://USER:${oc.env:VARIABLE}@HOST:PORT/v1'", file=sys.stderr)
        raise SystemExit(2)


def leaves(value: Any) -> list[Any]:
    """The values of a config's dicts and lists, nested ones included."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in leaves(v)]
    return [value]


class SweepCallback(Callback):
    """Progress after each point (basic launcher), the report and the exit status at the end of a sweep."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_pickled_passwords(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            scrub_multirun(Path(config.hydra.sweep.dir))

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or config.hydra.launcher.get("_target_") != BASIC_LAUNCHER:
            return
        print(progress(Path(config.hydra.sweep.dir))[0], file=sys.stderr, flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from evalkit.sweep.points import SweepError, distinct_overrides
        from evalkit.sweep.report import write_report

        sweep_dir = Path(config.hydra.sweep.dir)
        scrub_multirun(sweep_dir)
        line, points = progress(sweep_dir)
        if config.hydra.launcher.get("_target_") != BASIC_LAUNCHER:  # the basic launcher's last point printed it
            print(line, file=sys.stderr)
        try:
            output_dir = OmegaConf.select(config, "output_dir", default=None)  # this sweep's own runs
            written = write_report(sweep_dir, runs_under=Path(output_dir).resolve() if output_dir else None)
            names = ", ".join(p.name for p in written if p.name.startswith("report."))
            print(f"evalkit: sweep report in {sweep_dir}: {names} (evalkit report {sweep_dir} "
                  "--reference N compares with another point)", file=sys.stderr)
        except (SweepError, OSError) as error:
            print(f"evalkit: the sweep report could not be written: {error}", file=sys.stderr)
        failed = [p for p in points if p.status not in ("ok", "skipped")]  # failed, or still "running": it died
        apart = distinct_overrides(points)
        here = socket.gethostname()
        for p in failed:  # a point that failed on another machine names it: a node may lack what this one has
            where = f" on {p.host}" if p.host != here else ""
            print(f"evalkit: point {p.num} ({apart[p.num]}) {p.status}{where}: {p.error}", file=sys.stderr)
        gates = {p.num: gate_record(p.run_dir) for p in points if p.status in ("ok", "skipped") and p.run_dir}
        failed_gates = {num: gate for num, gate in gates.items() if gate and gate.get("exit_code") == 1}
        for num, gate in failed_gates.items():
            print(f"evalkit: point {num} ({apart[num]}) gate: {gate.get('verdict')}: {gate.get('reason')}",
                  file=sys.stderr)
        if failed_gates:
            raise SystemExit(1)
        if failed:  # with a gate, 1 is its verdict: a point that failed has none (as a gated run that fails)
            gated = OmegaConf.select(config, "gate.reference") or any(gates.values())
            raise SystemExit(3 if gated else 1)


def gate_record(run_dir: str) -> dict | None:
    """The gate's record in a point's run folder (results.json, evalkit.gate), None without one. The folder is
    the one the point record names (a sweep folder may come from elsewhere): read bounded, no link followed out."""
    from evalkit.untrusted import OutsideFolder, TooLarge, inside, json_data, read_bounded

    try:
        results = json_data(read_bounded(inside(Path(run_dir), "results.json")))
        gate = results["evalkit"].get("gate") if isinstance(results, dict) else None
    except (OSError, ValueError, TooLarge, OutsideFolder, KeyError, TypeError, AttributeError):
        return None
    return gate if isinstance(gate, dict) else None
