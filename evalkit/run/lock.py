"""One run per set of answers, wherever it runs: the lock ``<output_dir>/<model_name>/.lock-<key>`` lives with the results.

The key (evalkit/engine/store.py, ``answers_key``) covers what decides the request store a run writes, so two
runs that could write one store never run at once, while runs of one model with other answers (a sweep's
points over dtype or context length) may share the folder: run folders are published under free names.

The lock is a file created atomically (``O_CREAT | O_EXCL``, which local file systems and NFS v3+ honour)
holding its holder's host, pid and start time, so two machines that share the file system cannot write one
folder at once, and a refusal names the holder. A holder that died without releasing (``kill -9``, a power
cut) leaves its file behind: on the same host a dead pid is detected and the lock taken over; from another
host it cannot be, and the message says which file to delete once that run is known to be gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from evalkit.config import ConfigError

LOCK_NAME = ".lock"
TORN_AFTER = 30.0  # seconds: a lock file still unreadable this long after it was made was torn by a crash


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def read_holder(path: Path) -> dict[str, Any] | None:
    """The holder written in a lock file, or None when the file is gone or unreadable."""
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else None
    except (OSError, ValueError):
        return None


def is_stale(path: Path, holder: dict[str, Any] | None) -> bool:
    if holder is None:
        try:
            return time.time() - path.stat().st_mtime > TORN_AFTER
        except FileNotFoundError:
            return True
    return holder.get("host") == socket.gethostname() and not pid_alive(int(holder.get("pid", -1)))


class LockHeld(ConfigError):
    """A live run holds the lock."""


class ResultLock:
    """Held while a run (or an ``evalkit.compare.noise`` pair) writes to one ``<output_dir>/<model_name>`` folder."""

    def __init__(self, folder: str | Path, name: str = LOCK_NAME) -> None:
        self.folder = Path(folder)
        self.path = self.folder / name
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.held = False
        self.created: list[Path] = []  # folders made for the lock, deepest first: removed again if left empty

    def acquire(self, wait: float = 0.0, poll: float = 2.0) -> "ResultLock":
        """Take the lock; a live holder is waited for up to `wait` seconds (a sweep's points), then refused."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return self._acquire()
            except LockHeld:
                if time.monotonic() + poll > deadline:
                    raise
                time.sleep(poll)

    def _acquire(self) -> "ResultLock":
        self.created = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create the result folder {self.folder} ({error.strerror}); "
                              "pass output_dir= a writable folder") from None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                if is_stale(self.path, holder):
                    self._take_over(holder)
                    continue
                raise LockHeld(self._refusal(holder)) from None
            except OSError as error:
                raise ConfigError(f"cannot write to the result folder {self.folder} ({error.strerror}); "
                                  "pass output_dir= a writable folder") from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.me))
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return self
        raise ConfigError(f"could not take the lock {self.path}; another evalkit run keeps taking it")

    def _take_over(self, holder: dict[str, Any] | None) -> None:
        """Remove a stale lock, unless another process on this host already replaced it."""
        with open(self.path.with_name(f"{self.path.name}.takeover"), "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            if read_holder(self.path) == holder:
                self.path.unlink(missing_ok=True)

    def _refusal(self, holder: dict[str, Any] | None) -> str:
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
               if holder else "a run whose lock file is being written")
        return (f"another evalkit run ({who}) is writing to {self.folder}; wait for it to finish, or pass "
                f"output_dir= or model_name= for a separate folder (if that run is gone, delete {self.path})")

    def release(self) -> None:
        if self.held and read_holder(self.path) == self.me:
            self.path.unlink(missing_ok=True)
        self.held = False
        for folder in self.created:  # a run that wrote nothing leaves nothing
            try:
                folder.rmdir()
            except OSError:
                break

    def __enter__(self) -> "ResultLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def result_lock(output_dir: str, model_name: str, key: str | None = None) -> ResultLock:
    """The lock of one model's result folder; with key, of one set of answers in it."""
    return ResultLock(Path(output_dir) / model_name, f"{LOCK_NAME}-{key}" if key else LOCK_NAME)
