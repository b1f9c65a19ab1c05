"""What an engine's own processes printed, read back by the process that started them (a data-parallel actor).

vLLM runs its engine in processes of its own (``EngineCore``, its workers) whenever it runs on GPUs. When one
of them fails, the caller only gets "Engine core initialization failed. See root cause above. Failed core
proc(s): ..." (``vllm/v1/engine/utils.py``, ``wait_for_engine_startup``) or ``EngineDeadError`` ("See stack
trace (above) for the root cause", ``vllm/v1/engine/exceptions.py``): the cause, such as CUDA's out-of-memory
error, is only in what that process printed. It inherited this process's stdout and stderr, which in a Ray
actor are files (Ray's ``worker-*.out`` and ``.err``). :class:`OutputMark` notes where they end before an
engine call; :func:`explained` reads what was written after it and puts the engine's own error line in front
of the caller's, so the memory back-off (backoff.classify) reads it as a supervisor reads a try's log.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any, Callable

from evalkit.engine.backoff import root_cause

READ_LIMIT = 1 << 20  # bytes read back per stream: the end of what the engine printed
# vLLM's errors whose cause is in a process's output, not in the error: "See root cause above", EngineDeadError's
# "See stack trace (above) for the root cause", a worker's "See stack trace for root cause"
POINTS_TO_OUTPUT = re.compile(r"root cause")


class OutputMark:
    """Where this process's stdout and stderr end now (those that are regular files; others cannot be read back)."""

    def __init__(self, fds: tuple[int, ...] = (1, 2)) -> None:
        self.files: list[tuple[str, int]] = []
        for fd in fds:
            try:
                status = os.fstat(fd)
                if stat.S_ISREG(status.st_mode):
                    self.files.append((os.readlink(f"/proc/self/fd/{fd}"), status.st_size))
            except OSError:  # closed, or no /proc (not Linux): nothing to read back
                continue

    def since(self) -> str:
        """What was written to those files after the mark (by this process or any child), at most READ_LIMIT each."""
        texts = []
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
