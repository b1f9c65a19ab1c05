"""One run per set of answers, wherever it runs: the lock ``<output_dir>/<model_name>/.lock-<key>`` lives with the results.

The key (evalkit/store/fingerprint.py, ``answers_key``) covers what decides the request store a run writes, so two
runs that could write one store never run at once, while runs of one model with other answers (a sweep's
points over dtype or context length) may share the folder: run folders are published under free names.

The lock is the kernel's: ``fcntl.flock`` on the lock file, held for the run. The kernel drops it when its
holder's process ends, however it ends (``kill -9``, the OOM killer, a segfault) and in whatever PID namespace
or container it ran, so no one guesses whether a holder still lives and no lock is ever taken over. Linux's NFS
client turns flock into NFS locks, which keep two machines that share the file system apart too, and which the
server frees when a crashed client's lease runs out; a file system without locks is refused with one line.
The file holds its holder's host, pid and start time, only to name it in a refusal. Its holder deletes it while
still holding it; a waiter that then gets the lock of the deleted file finds another (or no) file at the path
and tries again, so the lock is always the one file at the path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from evalkit.config import ConfigError
from evalkit.engine.machine import forks
from evalkit.untrusted import open_own

LOCK_NAME = ".lock"


def read_holder(path: Path) -> dict[str, Any] | None:
    """The holder written in a lock file, or None when the file is gone, unreadable or still being written."""
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else None
    except (OSError, ValueError):
        return None


def at_path(fd: int, path: Path) -> bool:
    """Whether the open file fd is the file at path now (not one deleted, or replaced, since it was opened)."""
    try:
        here, opened = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (opened.st_dev, opened.st_ino)


class LockHeld(ConfigError):
    """A live run holds the lock."""


class ResultLock:
    """Held while a run (or an ``evalkit.compare.noise`` pair) writes to one ``<output_dir>/<model_name>`` folder."""

    def __init__(self, folder: str | Path, name: str = LOCK_NAME) -> None:
        self.folder = Path(folder)
        self.path = self.folder / name
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.fd: int | None = None  # the locked lock file while held
        self.created: list[Path] = []  # folders made for the lock, deepest first: removed again if left empty

    @property
    def held(self) -> bool:
        return self.fd is not None

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
        for _ in range(100):  # another turn only when the file was deleted between our open and our lock
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise LockHeld(self._refusal(read_holder(self.path))) from None
                raise ConfigError(f"cannot lock files in the result folder {self.folder} ({error.strerror}); "
                                  "pass output_dir= a folder on a file system with file locks") from None
            if at_path(fd, self.path):
                self.fd = fd
                forks.close_in_child(fd)  # a forked child must not hold the run's lock after this process ends
                self._write_me()
                return self
            os.close(fd)  # its holder deleted it as we opened it: the path is free or holds a newer lock
        raise ConfigError(f"could not take the lock {self.path}; other evalkit runs keep taking it")

    def _open(self) -> int:
        try:
            return open_own(self.path, os.O_CREAT | os.O_RDWR)  # not inherited by the run's processes
        except OSError as error:
            raise ConfigError(f"cannot write to the result folder {self.folder} ({error.strerror}); "
                              "pass output_dir= a writable folder") from None

    def _write_me(self) -> None:
        """Name this process in the file, for the refusals of others (the lock itself is the flock)."""
        data = json.dumps(self.me).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def _refusal(self, holder: dict[str, Any] | None) -> str:
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
               if holder else "a run whose lock file is being written")
        return (f"another evalkit run ({who}) is writing to {self.folder}; wait for it to finish, or pass "
                f"output_dir= or model_name= for a separate folder (its lock {self.path} frees itself when it ends)")

    def release(self) -> None:
        if self.fd is not None:
            try:
                if at_path(self.fd, self.path):  # ours: deleted while still locked (see the module docstring)
                    self.path.unlink(missing_ok=True)
            finally:
                forks.forget(fds=(self.fd,))
                fcntl.flock(self.fd, fcntl.LOCK_UN)  # also for a process forked while it was held
                os.close(self.fd)
                self.fd = None
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
