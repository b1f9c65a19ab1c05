"""What an engine's own processes printed, read back by the process that started them (a data-parallel actor).

vLLM runs its engine in processes of its own (``EngineCore``, its workers) whenever it runs on GPUs. When one
of them fails, the caller only gets "Engine core initialization failed. See root cause above. Failed core
proc(s): ..." (``vllm/v1/engine/utils.py``, ``wait_for_engine_startup``) or ``EngineDeadError`` ("See stack
trace (above) for the root cause", ``vllm/v1/engine/exceptions.py``): the cause, such as CUDA's out-of-memory
error, is only in what that process printed. It inherited this process's stdout and stderr, which in a Ray
actor are files (Ray's ``worker-*.out`` and ``.err``), or pipes to Ray's log monitor where Ray rotates its logs
(``RAY_ROTATION_MAX_BYTES``): a pipe cannot be read back, so :func:`keep_tails` puts a pipe of this process's
own in front of each (:class:`Tail`: a thread copies every byte on to Ray's and keeps the last READ_LIMIT).
:class:`OutputMark` notes where they end before an engine call; :func:`explained` reads what was written after
it and puts the engine's own error line in front of the caller's, so the memory back-off (backoff.classify)
reads it as a supervisor reads a try's log.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import struct
import termios
import threading
import time
from typing import Any, Callable

from evalkit.engine.backoff import root_cause
from evalkit.engine.machine import forks

READ_LIMIT = 1 << 20  # bytes read back per stream: the end of what the engine printed
# vLLM's errors whose cause is in a process's output, not in the error: "See root cause above", EngineDeadError's
# "See stack trace (above) for the root cause", a worker's "See stack trace for root cause"
POINTS_TO_OUTPUT = re.compile(r"root cause")


class Tail:
    """fd (a pipe, say) replaced by a pipe of this process's own: what this process and its children write to fd
    goes on to where fd went before, copied by a thread that keeps the last READ_LIMIT bytes and counts them all.
    A forked child keeps writing into the pipe and closes its copies of the read end and of the original."""

    def __init__(self, fd: int) -> None:
        self.original = os.dup(fd)
        self.read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        forks.close_in_child(self.read, self.original)
        self.kept, self.written, self.lock = bytearray(), 0, threading.Lock()
        threading.Thread(target=self._copy, name=f"evalkit-tail-{fd}", daemon=True).start()

    def _copy(self) -> None:
        while chunk := os.read(self.read, 1 << 16):
            view = memoryview(chunk)
            while view:
                view = view[os.write(self.original, view):]
            with self.lock:
                self.kept += chunk
                del self.kept[:-READ_LIMIT]
                self.written += len(chunk)

    def mark(self) -> int:
        with self.lock:
            return self.written

    def since(self, mark: int, wait: float = 1.0) -> str:
        """What was written after mark, at most READ_LIMIT bytes, once the pipe is drained (at most wait s)."""
        deadline = time.monotonic() + wait
        while _pending(self.read) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.01)  # the last chunk read, being kept
        with self.lock:
            new = self.written - mark
            return bytes(self.kept[-new:] if 0 < new <= len(self.kept) else self.kept if new > 0 else b"").decode(
                errors="replace")


def _pending(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


TAILS: dict[int, Tail] = {}  # fd -> the tail in front of it (keep_tails)


def keep_tails(fds: tuple[int, ...] = (1, 2)) -> None:
    """A Tail in front of each of fds that is not a regular file (a pipe, a socket), once per process, so what
    the engine's processes print there can be read back."""
    for fd in fds:
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:  # closed: nothing to keep
            continue
        if not regular and fd not in TAILS:
            TAILS[fd] = Tail(fd)


class OutputMark:
    """Where this process's stdout and stderr end now: those that are regular files, and those a Tail keeps
    (keep_tails); others cannot be read back."""

    def __init__(self, fds: tuple[int, ...] = (1, 2)) -> None:
        self.files: list[tuple[str, int]] = []
        self.tails = [(TAILS[fd], TAILS[fd].mark()) for fd in fds if fd in TAILS]
        for fd in fds:
            try:
                status = os.fstat(fd)
                if fd not in TAILS and stat.S_ISREG(status.st_mode):
                    self.files.append((os.readlink(f"/proc/self/fd/{fd}"), status.st_size))
            except OSError:  # closed, or no /proc (not Linux): nothing to read back
                continue

    def since(self) -> str:
        """What was written to those files after the mark (by this process or any child), at most READ_LIMIT each."""
        texts = [tail.since(mark) for tail, mark in self.tails]
        for path, offset in self.files:
            try:
                with open(path, "rb") as f:
                    end = f.seek(0, os.SEEK_END)
                    f.seek(max(offset, end - READ_LIMIT) if end >= offset else 0)
                    texts.append(f.read().decode(errors="replace"))
            except OSError:
                continue
        return "\n".join(texts)


def explained(error: BaseException, output: str) -> str | None:
    """The message for error with the engine's own error line from its output in front, or None when error
    does not point to the output for its cause, or the output has no error line that its message lacks."""
    if not POINTS_TO_OUTPUT.search(str(error)):
        return None
    cause = root_cause(output)
    if cause is None or cause in str(error):
        return None
    return f"{cause} (engine log) <- {type(error).__name__}: {error}"


def call_explained(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """call(*args, **kwargs); when it raises, a RuntimeError that leads with the engine's own error line printed
    during the call (chained to the original), else the original error."""
    mark = OutputMark()
    try:
        return call(*args, **kwargs)
    except Exception as error:
        message = explained(error, mark.since())
        if message is None:
            raise
        raise RuntimeError(message) from error
