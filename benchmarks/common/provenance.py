"""What a benchmark's output names so that a page can quote it: the date, the machine and the commit measured."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

from benchmarks.common import ROOT


def machine() -> str:
    """The cores this process may use and the CPU's model name, e.g. '2 cores, AMD EPYC 7B13'."""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    return f"{len(os.sched_getaffinity(0))} cores, {cpu}"


def commit() -> str:
    """The checked-out commit, '+ local changes' when the working tree differs from it; 'unknown' outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} + local changes" if dirty else head


def provenance() -> str:
    """One line: the date (UTC), the machine and the commit, e.g. 'measured 2026-12-03 on 2 cores, ... at 4184c15'."""
    return f"measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} on {machine()} at commit {commit()}"
