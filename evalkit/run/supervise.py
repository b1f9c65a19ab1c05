"""Runs that survive: each try of a run in a fresh process, memory back-off between tries, no leftovers.

``python -m evalkit`` calls :func:`supervise`. It holds the lock of ``<output_dir>/<model_name>`` (a second
run there is refused, evalkit/run/lock.py), then starts ``python -m evalkit.run.attempt`` in a new process group.
When a try fails for lack of memory it is retried with smaller settings (:func:`next_settings`,
``oom_retry.*``); answers already computed are reused from the request store, so a retry redoes no
finished work. A try stopped by a signal from outside is not retried (:class:`RunStopped`); any other
failure stops at once with its message. After every try the whole process group is killed, so no
``VLLM::EngineCore`` or worker outlives it; Ctrl-C and SIGTERM stop the try the same way, and a try whose
supervisor dies kills its own group when the pipe it watches closes (evalkit/run/attempt.py).

Output: every line a try prints (vLLM's log, lm-eval's, tracebacks, evalkit's) goes to one log per run,
``<output_dir>/<model_name>/.logs/<start time>-<pid>.log``, written as it comes, with a line
``=== try N ...`` before each try's output. The terminal (stderr) shows only evalkit's own lines, those
starting with ``evalkit:`` (:class:`Terminal`). When the run succeeds its log becomes ``engine.log`` in the
run folder, holding every try; when it fails the cause and the log's last lines are shown and the log stays
where it is; bad input (a ConfigError from the try) and a stopped run leave no log, as they leave nothing else.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from evalkit.engine import preflight
from evalkit.config import ConfigError, EvalConfig, memory_settings, validate
from evalkit.engine.backoff import classify, next_settings
from evalkit.engine.fingerprint import answers_key
from evalkit.run.lock import result_lock
from evalkit.run.progress import RunLog, Terminal, show_failure

class RunFailed(RuntimeError):
    """A run failed for a reason other than bad input; the message says why and what was tried."""


class RunStopped(RunFailed):
    """A try was stopped by a signal from outside (a scheduler, a user): not retried."""

    def __init__(self, message: str, signal_name: str) -> None:
        super().__init__(message)
        self.exit_code = 128 + int(signal.Signals[signal_name])


@dataclass
class Outcome:
    status: str  # ok | config | memory | stopped | error
    message: str = ""
    run_dir: str | None = None
    memory_kind: str | None = None  # pressure | kv_cache, for status "memory"
    signal: str | None = None  # SIGTERM | SIGINT, for status "stopped"


ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)")


def root_cause(log: str) -> str | None:
    """The engine's own error line from a try's output (vLLM reports it from its worker processes):
    the last one that names a memory failure, else the last error line of all."""
    found = [m.group(1) + ": " + m.group(2).strip() for m in map(ERROR_LINE.search, log.splitlines()) if m]
    memory = [line for line in found if classify(line)]
    return (memory or found or [None])[-1]


def run_with_retries(cfg: EvalConfig, attempt: Callable[[EvalConfig, list], Outcome]) -> tuple[Outcome, list]:
    """Call attempt until it succeeds, fails for another reason, or the back-off runs out.

    Returns the last outcome and every try: settings, status, error, seconds."""
    attempts: list[dict[str, Any]] = []
    current: EvalConfig | None = cfg
    while current is not None:
        started = time.perf_counter()
        outcome = attempt(current, attempts)
        attempts.append({"settings": memory_settings(current), "status": outcome.status, "error": outcome.message or None,
                         "seconds": round(time.perf_counter() - started, 1)})
        if outcome.status != "memory" or not cfg.oom_retry.enabled or len(attempts) >= cfg.oom_retry.max_attempts:
            return outcome, attempts
        current = next_settings(current, outcome.memory_kind or "pressure", cfg.oom_retry)
    return outcome, attempts


def started_at() -> float:
    """When this process (``python -m evalkit``) started, as time.time() does."""
    import psutil

    return psutil.Process().create_time()


class Attempt:
    """One try in ``python -m evalkit.run.attempt``, its own process group; each line of its output goes to
    on_line (from a reader thread) and its tail is kept."""

    def __init__(self, cfg: EvalConfig, history: list, *, on_line: Callable[[str], None]) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="evalkit-attempt-"))
        spec = self.work / "spec.json"
        spec.write_text(json.dumps({"config": asdict(cfg), "attempts": history, "started_at": started_at()}))
        self.outcome_file = self.work / "outcome.json"
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        # The try watches the read end: when this process dies, even by SIGKILL, the kernel closes the
        # write end, the try reads end-of-file and kills its group (evalkit/run/attempt.py).
        death_read, self.death_write = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "evalkit.run.attempt", str(spec), str(self.outcome_file), str(death_read)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            start_new_session=True, pass_fds=(death_read,))
        os.close(death_read)
        self.reader = threading.Thread(target=self._read, args=(on_line,), daemon=True)
        self.reader.start()

    def _read(self, on_line: Callable[[str], None]) -> None:
        # vLLM logs to stdout; none of the try's output reaches stdout, which is left to the score table
        for line in self.process.stdout:
            on_line(line)
            self.tail.append(line)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Signal the whole group, wait, then kill whatever is left of it."""
        for s, wait in ((sig, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, s)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue

    def wait(self) -> Outcome:
        code = self.process.wait()
        self.stop(signal.SIGKILL, grace=1.0)  # engine processes left in the group, if any
        os.close(self.death_write)
        self.reader.join(timeout=5)
        log = "".join(self.tail)
        if self.outcome_file.is_file():
            outcome = Outcome(**json.loads(self.outcome_file.read_text()))
        else:
            outcome = Outcome(status="error", message=f"the try exited with code {code} and no outcome")
            if code == -signal.SIGKILL:  # not by us: the kernel's out-of-memory killer
                outcome = Outcome(status="memory", message="killed by SIGKILL (the system ran out of memory?)",
                                  memory_kind="pressure")
        if outcome.status == "error":
            cause = root_cause(log)
            if cause and cause not in outcome.message:
                outcome.message = f"{cause} (engine log) <- {outcome.message}"
            kind = classify(outcome.message)
            if kind:
                outcome = Outcome(status="memory", message=outcome.message, memory_kind=kind)
        for f in self.work.iterdir():
            f.unlink()
        self.work.rmdir()
        return outcome


def supervise(cfg: EvalConfig, *, wait_for_lock: float = 0.0) -> Path:
    """Run cfg with memory back-off in fresh processes; return the run folder.

    wait_for_lock: seconds to wait for a run that holds these answers' lock (a sweep's points), else refuse."""
    validate(cfg)  # the checks here, before any process starts; the try repeats them
    preflight.check_devices(cfg)
    preflight.check_model(cfg, preflight.resolve_model_path(cfg.vllm_path))
    lock = result_lock(cfg.output_dir, cfg.model_name, answers_key(cfg)).acquire(wait=wait_for_lock)
    try:
        log = RunLog(Path(cfg.output_dir) / cfg.model_name / ".logs")
    except ConfigError:
        lock.release()
        raise
    current: list[Attempt] = []

    def on_signal(signum, frame):
        for attempt in current:
            attempt.stop(signal.SIGTERM)
        name = signal.Signals(signum).name
        raise RunStopped(f"by {name}; finished answers are kept for a rerun", name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    outcome: Outcome | None = None
    try:
        terminal = Terminal(sys.stderr, tty=sys.stderr.isatty())
        outcome, attempts = run_with_retries(cfg, attempt_in_fresh_process(log, terminal, current))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        # before the lock goes: an empty folder is removed with it
        log_path = log.finish(outcome.status if outcome else None, outcome.run_dir if outcome else None)
        lock.release()
    if outcome.status == "config":
        raise ConfigError(outcome.message)
    if outcome.status == "stopped":
        raise RunStopped(f"{outcome.message}; nothing was retried, finished answers are kept for a rerun",
                         outcome.signal or "SIGTERM")
    if outcome.status != "ok":
        show_failure(root_cause("".join(current[-1].tail)), list(current[-1].tail), log_path)
        tries = "; ".join(f"{a['settings']}: {a['status']}" for a in attempts)
        raise RunFailed(f"{outcome.message} (tries: {tries})")
    if len(attempts) > 1:
        print(f"evalkit: succeeded on try {len(attempts)} with {attempts[-1]['settings']}; "
              f"pin these settings to skip the failed tries", file=sys.stderr)
    return Path(outcome.run_dir)


def attempt_in_fresh_process(log: RunLog, terminal: Terminal,
                       current: list[Attempt]) -> Callable[[EvalConfig, list], Outcome]:
    """The attempt function for run_with_retries: each try in a fresh process, its output to the log and
    the terminal, the try under way in current (for the signal handler)."""

    def on_line(line: str) -> None:
        log.write(line)
        try:
            terminal.show(line)
        except (OSError, ValueError):  # the terminal went away: the try goes on, the log keeps every line
            pass

    def attempt(settings: EvalConfig, history: list) -> Outcome:
        number = len(history) + 1
        log.header(number, memory_settings(settings))
        if number > 1:
            print(f"evalkit: try {number} with {memory_settings(settings)}", file=sys.stderr)
        current[:] = [Attempt(settings, history, on_line=on_line)]
        outcome = current[0].wait()
        terminal.end()
        if outcome.status == "memory":
            print(f"evalkit: try {number} ran out of memory: {outcome.message}", file=sys.stderr)
        return outcome

    return attempt
