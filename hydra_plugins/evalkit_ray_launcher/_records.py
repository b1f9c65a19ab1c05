"""Failures the launcher sees, written into the point's record (evalkit/sweep/points.py) as evalkit's own points
write theirs: a point too large for the cluster (never started), one whose Ray worker was lost (killed for
memory, its node gone), one whose task ended with an exit code or an exception. The sweep goes on; the
end-of-sweep callback (evalkit/sweep/callback.py) lists every failed point and sets the exit status."""

from __future__ import annotations

import socket
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from evalkit.sweep.points import POINT_FILE, PointRecord, SweepError, now_iso, read_point, write_point


def record_failure(folder: Path, *, num: int, overrides: list[str], error: str) -> None:
    """Mark point `num` (its Hydra folder) failed with `error`; a record the point wrote as failed is kept."""
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
