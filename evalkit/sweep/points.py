"""Records what became of each point of a sweep (running, ok, failed, skipped), in the point's own sweep folder.

``python -m evalkit -m max_model_len=1024,2048`` runs every point as a full evalkit run, whose run folder lands
in ``<output_dir>/<model_name>/<run id>/`` as usual. The point's Hydra folder (``<sweep dir>/<job num>/``) gets
``point.json`` (:class:`PointRecord`), written "running" when the point starts and again with its final
status, each time atomically. The records are plain files, so any launcher (Hydra's sequential one, a Ray
launcher) can write and read them; the sweep's progress line and report are built from them alone.

A point whose answers an earlier run in ``<output_dir>/<model_name>/`` already has (:func:`completed_run`: its
config, the request store's fingerprint of the model's files, library versions, hardware, vLLM environment
and evalkit's answer code, and the content its tasks read) is recorded "skipped" with that run's folder: a sweep
run again only runs what is missing, and after an upgrade, on other hardware, with another model in the folder or
after a task's prompt or data changed it runs again (saying why, for a changed task).
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from evalkit import untrusted
from evalkit.store.replay import described_here, machine_here, runs_with_config
from evalkit.untrusted import printable

POINT_FILE = "point.json"
FINAL = ("ok", "failed", "skipped")  # the statuses of a point that is done
COMPLETED = ("ok", "skipped")  # the statuses whose run folder holds results (a skipped point's: the earlier run's)


class SweepError(ValueError):
    """Not a sweep folder, no point records in it, or a point that cannot serve: one line for people."""


@dataclass
class PointRecord:
    num: int  # hydra.job.num
    overrides: list[str]  # HydraConfig.get().overrides.task: what sets this point apart
    status: str  # "running" | "ok" | "failed" | "skipped"
    run_dir: str | None  # the run folder (for skipped: the earlier run that already has this config)
    error: str | None  # one line for failed points
    wall_seconds: float | None  # from the point's start to its end (None while running)
    devices: str | None  # CUDA_VISIBLE_DEVICES when the point ran (None if unset)
    host: str
    started: str  # ISO time, with the UTC offset


def now_iso() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write one file of the sweep folder through a temporary created exclusively and a rename
    (untrusted.write_atomic): readers never see half a file, and no link planted in the folder redirects it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return untrusted.write_atomic(path, data)


def write_point(folder: Path, record: PointRecord) -> None:
    """Write (or replace) the record of the point whose Hydra output folder is folder."""
    write_atomic(Path(folder) / POINT_FILE, json.dumps(asdict(record), indent=2) + "\n")


def read_point(path: Path) -> PointRecord:
    """The record in path, each field of its type: a point.json is data (a sweep folder may come from elsewhere),
    and its num names the report's files, so a num that is not a whole number is no record."""
    try:
        data = untrusted.json_data(untrusted.read_bounded(Path(path)))  # a FIFO or a huge file: refused
        record = PointRecord(**{f.name: data[f.name] for f in fields(PointRecord)})
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SweepError(f"{path} is not a point record ({type(error).__name__}: {error})") from None
    wrong = next((name for name, ok in checks(record) if not ok), None)
    if wrong:
        raise SweepError(f"{path} is not a point record ({wrong}={printable(repr(getattr(record, wrong)))[:80]})")
    # shown line by line (the report, the terminal): a newline or an escape in a received value stays in its line
    return replace(record, overrides=[printable(o) for o in record.overrides],
                   **{f: printable(getattr(record, f)) for f in ("error", "devices", "host", "started")
                      if getattr(record, f) is not None})


def checks(record: PointRecord) -> list[tuple[str, bool]]:
    def text(value: Any, *, optional: bool = True) -> bool:
        return isinstance(value, str) or (optional and value is None)

    return [("num", type(record.num) is int and record.num >= 0),
            ("overrides", isinstance(record.overrides, list) and all(isinstance(o, str) for o in record.overrides)),
            ("status", record.status in ("running", *FINAL)), ("run_dir", text(record.run_dir)),
            ("error", text(record.error)), ("devices", text(record.devices)),
            ("wall_seconds", record.wall_seconds is None or (type(record.wall_seconds) in (int, float))),
            ("host", text(record.host, optional=False)), ("started", text(record.started, optional=False))]


def record_failure(folder: Path, *, num: int, overrides: list[str], error: str) -> None:
    """Mark point `num` (its Hydra folder) failed with `error`, as a launcher does for a point it lost (a Ray worker
    killed, a Slurm job without a result); a record the point wrote as failed is kept."""
    path = Path(folder) / POINT_FILE
    try:
        record = read_point(path) if path.is_file() else None
    except SweepError:
        record = None  # torn by the kill that lost the point
    if record is not None and record.status == "failed":
        return
    if record is None:
        record = PointRecord(num=num, overrides=overrides, status="running", run_dir=None, error=None,
                             wall_seconds=0.0, devices=None, host=socket.gethostname(), started=now_iso())
    elapsed = (datetime.now().astimezone() - datetime.fromisoformat(record.started)).total_seconds()
    write_point(folder, replace(record, status="failed", error=error, wall_seconds=round(elapsed, 1)))


def read_points(sweep_dir: Path) -> list[PointRecord]:
    """Every point record under sweep_dir, sorted by num; folders without point.json are left out."""
    return sorted((read_point(p) for p in Path(sweep_dir).rglob(POINT_FILE)), key=lambda r: r.num)


def sweep_total(overrides: list[str]) -> int:
    """How many points the sweep arguments (``max_model_len=1024,2048 seed=range(0,3)``) make: the product of
    every sweep's choices, as Hydra's basic sweeper crosses them. 0 when a sweep cannot be counted (a glob)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    total = 1
    try:
        for override in OverridesParser.create().parse_overrides(overrides=list(overrides)):
            if override.is_sweep_override():
                total *= len(list(override.sweep_string_iterator()))
    except Exception:  # Hydra's own errors (a glob needs its config loader): count the records instead
        return 0
    return total


def duration(seconds: float) -> str:
    """4m10s, 45s, 1h02m: short enough for a progress line."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s" if seconds % 60 else f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def sweep_line(points: list[PointRecord], total: int, elapsed_seconds: float) -> str:
    """One progress line of a sweep, e.g.
    ``evalkit: sweep 3/8 points done (1 failed, 1 skipped), 2 running, 4m10s, ETA 7m``.

    total: the sweep's points (at least the records given). The ETA is the mean wall time of the points that
    ran (not the skipped) times the points left, shared among those running now; it is left out until a
    point has run, and once all are done."""
    total = max(total, len(points))
    done = [p for p in points if p.status in FINAL]
    counts = {s: sum(p.status == s for p in points) for s in ("failed", "skipped", "running")}
    line = f"evalkit: sweep {len(done)}/{total} points done"
    extra = [f"{counts[s]} {s}" for s in ("failed", "skipped") if counts[s]]
    if extra:
        line += f" ({', '.join(extra)})"
    if counts["running"]:
        line += f", {counts['running']} running"
    line += f", {duration(elapsed_seconds)}"
    ran = [p.wall_seconds for p in done if p.status != "skipped" and p.wall_seconds is not None]
    left = total - len(done)
    if ran and left > 0:
        eta = sum(ran) / len(ran) * left / max(1, counts["running"])
        line += f", ETA {duration(60 * math.ceil(eta / 60)) if eta >= 60 else duration(eta)}"
    return line


def sweep_elapsed(points: list[PointRecord], now: datetime | None = None) -> float:
    """Seconds since the first point started (0 with no points)."""
    if not points:
        return 0.0
    first = min(datetime.fromisoformat(p.started) for p in points)
    return ((now or datetime.now().astimezone()) - first).total_seconds()


def distinct_overrides(points: list[PointRecord]) -> dict[int, str]:
    """point -> the overrides that set it apart (those shared by every point left out), as one string."""
    common = set.intersection(*(set(p.overrides) for p in points)) if len(points) > 1 else set()
    return {p.num: " ".join(o for o in p.overrides if o not in common) for p in points}


def completed_run(output_dir: str, model_name: str, config: dict[str, Any]) -> Path | None:
    """The newest run folder in ``<output_dir>/<model_name>/`` that has this point's answers, or None
    (:func:`find_completed`, without the reason)."""
    return find_completed(output_dir, model_name, config)[0]


def find_completed(output_dir: str, model_name: str, config: dict[str, Any]) -> tuple[Path | None, str | None]:
    """The newest run folder in ``<output_dir>/<model_name>/`` that has this point's answers, or None, with one
    line saying why a run with this config was passed over, if one was. A run has them when its results.json
    records this very config (``evalkit.config``, ``dataclasses.asdict`` of the EvalConfig: store.replay's
    runs_with_config), the request store's
    fingerprint (``evalkit.provenance.model_fingerprint``) that this point's run would have, by
    evalkit.store.fingerprint.fingerprint of the model folder now and :func:`described_here`, and the hash of
    what its tasks read (``evalkit.provenance.task_sources``, evalkit/run/sources.py: task YAMLs, data files,
    hub datasets' revisions) as they are now. Run folders appear complete or not at all
    (evalkit/run/results.py), so a results.json found here belongs to a finished run.
    Raises ConfigError when a run has the config and the model cannot be found (the run would fail alike)."""
    from evalkit.engine.machine.preflight import resolve_model_path
    from evalkit.store.fingerprint import fingerprint
    from evalkit.run.sources import task_sources

    model_dir, machine, sources, passed = None, None, None, None
    for run_dir, section in runs_with_config(output_dir, model_name, config):
        model_dir, machine = model_dir or resolve_model_path(config["vllm_path"]), machine or machine_here()
        recorded = section["provenance"]["model_fingerprint"]
        if recorded != fingerprint(model_dir, described_here(section.get("engine") or {}, machine)):
            continue
        sources = sources or task_sources(names=list(config["tasks"]), tasks_dirs=list(config["tasks_dirs"]),
                                          task_data=dict(config["task_data"]))
        if section["provenance"].get("task_sources") == sources:
            return run_dir, None
        passed = passed or (f"{run_dir} has this config, but its tasks read other files (task YAMLs, "
                            "data files or a hub dataset's revision changed since)")
    return None, passed
