"""What a process sets up for itself and a forked child must not keep (docs/architecture.md, "Layout").

CUDA vLLM starts its EngineCore and workers by fork, so they begin as copies of the process that started the
engine (a run's try, or a process that runs evalkit in itself). A copy keeps that process's signal wakeup fd,
its Python signal handlers and its open descriptors: vLLM's shutdown SIGTERMs its EngineCore, whose C-level
handler then wrote the signal into the try's wakeup pipe, and the try's watchdog took it for a stop from outside.
A child that outlived its parent would hold the parent's flocks (the run's lock, the request store's) and the
supervisor's death pipe open. Threads are not copied, but what they hold is: the owners of such state reset it
themselves (evalkit/harness/lm_eval_compat.py).

Owners say here what a forked child drops: :func:`close_in_child` (descriptors; the parent's flock stays, as the
child only closes its copy), :func:`handlers_in_child` (the handlers the child gets back), :func:`wakeup_in_child`.
Each is undone with :func:`forget` when the owner closes or restores it, so a child never closes a number the
parent has since reused. ``os.register_at_fork`` runs these in the child of ``os.fork`` (multiprocessing's fork,
vLLM's); a subprocess started by exec closes its descriptors and resets handlers itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Mapping

_FDS: set[int] = set()
_HANDLERS: dict[int, Any] = {}
_WAKEUP: set[int] = set()  # the wakeup fd this process set, at most one


def _in_child() -> None:
    with contextlib.suppress(ValueError):  # not the main thread (a child forked from a thread): nothing was set
        for fd in _WAKEUP:
            previous = signal.set_wakeup_fd(-1)
            if previous != fd:  # another library's, set since: not ours to drop
                signal.set_wakeup_fd(previous)
        for signum, handler in _HANDLERS.items():
            if handler is not None:  # None: set outside Python, and still in place
                signal.signal(signum, handler)
    for fd in _FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _FDS.clear()
    _HANDLERS.clear()
    _WAKEUP.clear()


os.register_at_fork(after_in_child=_in_child)


def close_in_child(*fds: int) -> None:
    """A forked child closes its copies of fds (the parent keeps them, and any flock on them)."""
    _FDS.update(fds)


def handlers_in_child(handlers: Mapping[int, Any]) -> None:
    """A forked child gets these signal handlers back (those in place before this process set its own)."""
    _HANDLERS.update(handlers)


def wakeup_in_child(fd: int) -> None:
    """A forked child drops fd as its signal wakeup fd (signal.set_wakeup_fd), so its signals stay its own."""
    _WAKEUP.clear()
    _WAKEUP.add(fd)


def forget(*, fds: tuple[int, ...] = (), signals: tuple[int, ...] = (), wakeup: int | None = None) -> None:
    """The owner closed fds, restored the handlers of signals or its wakeup fd: nothing left for a child to undo."""
    _FDS.difference_update(fds)
    for signum in signals:
        _HANDLERS.pop(signum, None)
    _WAKEUP.discard(wakeup)
