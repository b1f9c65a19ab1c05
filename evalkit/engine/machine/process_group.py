"""Ending a process group and knowing it has ended; a guard that ends an engine's group when its owner dies.

Used for a run's try (evalkit/run/supervise.py), a vLLM server evalkit started (served/start.py) and the
engine processes of a data-parallel actor (pool/engine.py). A group has ended when no member is left that
can hold memory: ``os.killpg(pgid, 0)`` finds none, or only zombies (they hold no memory; their parent reaps
them). The caller's own child, the group's leader, is reaped here, or it would stay in the group as a zombie.

``python -m evalkit.engine.machine.process_group GUARD PGID`` (stdlib only) waits for end-of-file on its stdin, whose
only writer is the process that started it, then kills group PGID: the owner died, however it died.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL = 0.05  # seconds between looks at a group that is ending


def signal_group(pgid: int, sig: int) -> bool:
    """Send sig to the group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def live_members(pgid: int) -> list[int]:
    """The pids of group pgid that are not zombies (Linux's /proc; elsewhere, every member is taken as live)."""
    if not os.path.isdir("/proc/self"):
        return [pgid]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "(comm)": state ppid pgrp ...
        except OSError:  # it exited while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            found.append(int(name))
    return found


def ended(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a member we may not signal: look
        pass
    return not live_members(pgid)


def wait_ended(pgid: int, timeout: float, leader: subprocess.Popen | None = None) -> bool:
    """Wait up to timeout seconds for the group to end, reaping leader (our child) when it exits."""
    deadline = time.monotonic() + timeout
    while True:
        if leader is not None:
            leader.poll()  # never blocks: returns at once when another thread is waiting for it
        if ended(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)


def end_group(pgid: int, *, leader: subprocess.Popen | None = None, first: int = signal.SIGTERM,
              grace: float = 10.0, kill_wait: float = 10.0) -> bool:
    """Send first to the group and wait up to grace seconds for it to end; then SIGKILL and wait up to kill_wait.
    True when the group has ended (every member gone or a zombie, leader reaped)."""
    for sig, wait in ((first, grace), (signal.SIGKILL, kill_wait)):
        if not signal_group(pgid, sig) or wait_ended(pgid, wait, leader):
            if leader is not None:
                leader.poll()
            return True
    return False


def guard_own_group() -> subprocess.Popen:
    """Make this process lead a process group (a Ray worker already does) and start a guard that kills the
    group when this process dies, so the engine processes it started (vLLM's EngineCore, its workers: they
    inherit the group) never outlive it holding GPU memory. Returns the guard."""
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)
    read, write = os.pipe()
    guard = subprocess.Popen([sys.executable, "-m", "evalkit.engine.machine.process_group", "GUARD", str(os.getpid())],
                             stdin=read, stdout=subprocess.DEVNULL, close_fds=True)
    os.close(read)
    # a forked child (vLLM forks its EngineCore on GPUs) must not hold the write end, or the guard never sees
    # end-of-file while that child lives; spawned children do not inherit it (os.pipe is non-inheritable)
    os.register_at_fork(after_in_child=lambda: os.close(write))
    return guard


def guard(pgid: int) -> int:
    """Block until stdin reads end-of-file (its only writer, the group's owner, has gone), then kill the group."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the owner's terminal
    while os.read(0, 4096):
        pass
    signal_group(pgid, signal.SIGKILL)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["GUARD"]:
    sys.exit(guard(int(sys.argv[2])))
