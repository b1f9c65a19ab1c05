"""evalkit's own progress output: one line per request kind, at most one every few seconds, and a final line.

The try prints, to stderr, lines a person reads on the terminal (the supervisor shows lines starting with
``evalkit:`` and sends everything else to the run's log, evalkit/run/supervise.py)::

    evalkit: progress loglikelihood 120/160 requests, 1,830 tok/s, ETA 0:04
    evalkit: done loglikelihood 160/160 requests in 12.3 s, 1,830 tok/s

Tokens are prompt plus generated tokens as sent to the engine (a cached prompt prefix counts too); the rate
and the ETA are averages since the :class:`Progress` was made. :meth:`Progress.engine_bar` stands in for
vLLM's tqdm bar, so vLLM prints no bar of its own and its finished requests reach :meth:`Progress.advance`.
One Progress is used from one thread. :class:`Terminal` is the other end, in the supervisor: it shows
these lines (and evalkit's other ``evalkit:`` lines) without flooding a terminal or a CI log, and
:class:`RunLog` keeps every line of a run (vLLM's log included) for its ``engine.log``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from evalkit.config import ConfigError
from evalkit.engine.vllm.bar import EngineBar

PROGRESS_LINE = re.compile(r"evalkit: progress (\S+) ")  # as Progress.advance prints it; group 1: the label
# The speeds vLLM 0.32 writes into its bar's postfix (vllm/entrypoints/common/offline.py, _run_engine).


def clock_text(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour on."""
    hours, rest = divmod(int(round(seconds)), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Progress of one request kind (``label``) over ``total`` requests, printed to ``stream``."""

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None, interval: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.interval, self.clock = interval, clock
        self.started = self.printed = clock()
        self.done = self.tokens = 0
        self.closed = False

    def advance(self, requests: int = 1, tokens: int = 0) -> None:
        """Count finished requests and their tokens; print a progress line if `interval` s passed since the last."""
        self.done += requests
        self.tokens += tokens
        now = self.clock()
        if self.closed or now - self.printed < self.interval:
            return
        self.printed = now
        elapsed = now - self.started
        eta = clock_text((self.total - self.done) * elapsed / self.done) if self.done else "?"
        self._print(f"progress {self.label} {self.done}/{self.total} requests{self._speed(elapsed)}, ETA {eta}")

    def close(self) -> None:
        """Print the final line (once)."""
        if self.closed:
            return
        self.closed = True
        elapsed = self.clock() - self.started
        took = f"{elapsed:.1f} s" if elapsed < 60 else clock_text(elapsed)
        self._print(f"done {self.label} {self.done}/{self.total} requests in {took}{self._speed(elapsed)}")

    def engine_bar(self) -> Callable[..., Any]:
        """A callable to pass as ``vllm.LLM.generate(..., use_tqdm=...)``: vLLM calls it once per generate
        call to render prompts (it gets them back, untouched and unreported) and once to count finished
        requests (it gets an :class:`EngineBar` feeding this Progress)."""

        def bar(iterable: Any = None, **tqdm_kwargs: Any) -> Any:
            return iterable if iterable is not None else EngineBar(self)

        return bar

    def _speed(self, elapsed: float) -> str:
        return f", {self.tokens / elapsed:,.0f} tok/s" if self.tokens and elapsed > 0 else ""

    def _print(self, text: str) -> None:
        self.stream.write(f"evalkit: {text}\n")
        self.stream.flush()


class Terminal:
    """What a person sees of a try's output: evalkit's own lines only. On a TTY each ``evalkit: progress``
    line overwrites the one before ('\\r'); elsewhere (a file, a CI log) at most one progress line per label
    every `every` seconds. Every other evalkit line (``evalkit: done ...``, errors) is shown in full."""

    def __init__(self, stream: TextIO, *, tty: bool, every: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.tty, self.every, self.clock = stream, tty, every, clock
        self.shown: dict[str, float] = {}  # label -> when its last progress line was shown (not a TTY)
        self.open = 0  # width of the progress line the cursor is on (TTY), 0 when none

    def show(self, line: str) -> None:
        if not line.startswith("evalkit:"):
            return
        text = line.rstrip("\r\n")
        progress = PROGRESS_LINE.match(text)
        if progress and self.tty:
            self.stream.write("\r" + text.ljust(self.open))  # padded over a longer line before it
            self.open = len(text)
        elif progress:
            now, last = self.clock(), self.shown.get(progress[1])
            if last is not None and now - last < self.every:
                return
            self.shown[progress[1]] = now
            self.stream.write(text + "\n")
        else:
            self.end()
            self.stream.write(text + "\n")
        self.stream.flush()

    def end(self) -> None:
        """Move past a progress line the cursor is on, so the next line starts on a line of its own."""
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = 0


FAILING_LINES = 20  # of the log, shown when a run fails


class RunLog:
    """One run's log: every line of every try, a header line before each try (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        try:
            folder.mkdir(exist_ok=True)
            self.path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
            self.file: TextIO | None = open(self.path, "x", encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"cannot write the run's log into {folder} ({error.strerror}); "
                              "free space or pass output_dir= a writable folder") from None
        self.error: str | None = None  # why writing stopped part-way, if it did

    def header(self, number: int, settings: dict[str, Any]) -> None:
        self.write(f"=== try {number} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')} with {settings} ===\n")

    def write(self, line: str) -> None:
        """Append a line, flushed (a run killed part-way keeps its log); a full disk stops the log, not the run."""
        if self.file is None:
            return
        try:
            self.file.write(line if line.endswith("\n") else line + "\n")
            self.file.flush()
        except OSError as error:
            self.error = error.strerror or str(error)
            self.close()
        except ValueError:  # closed meanwhile, by a wait that gave up on its reader thread
            pass

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None

    def finish(self, status: str | None, run_dir: str | None = None) -> Path | None:
        """Close the log and put it where the outcome wants it: into the run folder as engine.log (ok), left
        in place (a failure: its path is returned), or removed (bad input, a stop, the supervisor stopped)."""
        self.close()
        kept: Path | None = self.path
        if status is None or status in ("config", "stopped"):
            self.path.unlink(missing_ok=True)
            kept = None
        elif status == "ok":
            from evalkit.run.results import attach_log  # here: results imports pandas, slow for every start

            try:
                kept = attach_log(Path(run_dir), self.path)
            except OSError as error:
                print(f"evalkit: the log stays at {self.path}: it could not move into the run folder "
                      f"({error.strerror or error})", file=sys.stderr)
        if self.error and kept:
            print(f"evalkit: the log {kept} stopped part-way ({self.error})", file=sys.stderr)
        try:
            self.path.parent.rmdir()  # .logs, when no failed run's log is left in it
        except OSError:
            pass
        return kept


def show_failure(cause: str | None, tail: list[str], log_path: Path | None) -> None:
    """The lines that say why a try failed, on the terminal: the engine's error line, the log's last lines."""
    if cause:
        print(f"evalkit: engine error: {cause}", file=sys.stderr)
    if tail:
        print(f"evalkit: last {min(len(tail), FAILING_LINES)} lines of the log:", file=sys.stderr)
        sys.stderr.write("".join("    " + line.rstrip("\n") + "\n" for line in tail[-FAILING_LINES:]))
    if log_path:
        print(f"evalkit: full log: {log_path}", file=sys.stderr)
