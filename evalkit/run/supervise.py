"""Runs that survive: each try of a run in a fresh process, memory back-off between tries, no leftovers.

``python -m evalkit`` calls :func:`supervise`. It holds the lock of ``<output_dir>/<model_name>`` (a second
run there is refused, evalkit/store/lock.py), then starts ``python -m evalkit.run.attempt`` in a new process group.
When a try fails for lack of memory it is retried with smaller settings (:func:`next_settings`,
``oom_retry.*``); answers already computed are reused from the request store, so a retry redoes no
finished work. A try stopped by a signal from outside is not retried (:class:`RunStopped`); any other
failure stops at once with its message. After every try the whole process group is killed and waited for
until it is empty (evalkit/engine/machine/process_group.py), so no ``VLLM::EngineCore`` or worker outlives it, and
then, on GPUs, waited for until NVML shows each of the engine's GPUs (:func:`engine_devices`, not every GPU of a
shared node) with its memory free again as before the first try, at most ``GPU_MEMORY_WAIT`` seconds (engine
processes outside the group, a data-parallel actor's, may hold it a little longer), so the next try's start does not fit itself to memory that is about to come back. Ctrl-C, SIGTERM and a Slurm job's notice (SIGUSR2, attempt.stop_signals) send SIGTERM to the try's group (the try records "stopped"
and kills its group) and never wait in the handler: the main thread sits in the try's ``wait()``, which then
returns, and ends the run in its own time (the group gone, the try's temporary folder removed). A try whose
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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from evalkit.engine.machine import environment, forks, gpus, preflight
from evalkit.config import ConfigError, EvalConfig, devices_needed, memory_settings, validate
from evalkit.engine.backoff import classify, next_settings, resolved_tokens, root_cause, weights_failure
from evalkit.engine.machine.process_group import end_group, signal_group
from evalkit.store.fingerprint import answers_key
from evalkit.engine.machine.tuning import Choice
from evalkit.store.lock import result_lock
from evalkit.run.attempt import stop_signals
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
    memory_kind: str | None = None  # a kind of backoff.classify but "weights", for status "memory"
    signal: str | None = None  # SIGTERM | SIGINT | SIGUSR2 (attempt.stop_signals), for status "stopped"
    batched_tokens: int | None = None  # the max_num_batched_tokens the try's vLLM resolved, read off its log


STOP_GRACE = 10.0  # seconds a signalled try has to end its group before SIGKILL
# the kernel's counters; oom_kill counts the processes its out-of-memory killer ended on this machine (Linux 4.13)
VMSTAT = "/proc/vmstat"
HOST_OOM = "the kernel's out-of-memory killer ended {what}: the machine's memory ran out"
GPU_MEMORY_WAIT = gpus.MEMORY_WAIT  # seconds, at most, the GPUs' memory has to come back after a try before the run goes on


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
        following = next_settings(current, outcome.memory_kind or "pressure", cfg.oom_retry,
                                  batched_tokens=outcome.batched_tokens)
        if following is current and len(attempts) > 1 and attempts[-2]["settings"] == attempts[-1]["settings"]:
            return outcome, attempts  # the same settings twice already (an unsteady profiling run): not a third time
        current = following
    return outcome, attempts


def started_at() -> float:
    """When this process (``python -m evalkit``) started, as time.time() does."""
    import psutil

    return psutil.Process().create_time()


class Attempt:
    """One try in ``python -m evalkit.run.attempt``, its own process group; each line of its output goes to
    on_line (from a reader thread) and its tail is kept."""

    def __init__(self, cfg: EvalConfig, history: list, *, on_line: Callable[[str], None],
                 on_gpus: bool = False) -> None:
        self.on_gpus = on_gpus  # the engine's memory is its GPUs' (else the machine's own: vLLM's CPU build)
        self.oom_kills = oom_kills()
        self.work = Path(tempfile.mkdtemp(prefix="evalkit-attempt-"))
        spec = self.work / "spec.json"
        spec.write_text(json.dumps({"config": asdict(cfg), "attempts": history, "started_at": started_at()}))
        self.outcome_file = self.work / "outcome.json"
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        self.stop_asked: float | None = None  # when a signal asked the try to stop (time.monotonic)
        self.ended = False  # the try's group has ended
        # The try watches the read end: when this process dies, even by SIGKILL, the kernel closes the
        # write end, the try reads end-of-file and kills its group (evalkit/run/attempt.py).
        death_read, death_write = os.pipe()
        self.death_write: int | None = death_write
        forks.close_in_child(death_write)  # a forked child of this process must not keep the try watching
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

    def interrupt(self) -> None:
        """From a signal handler: SIGTERM to the try's group (the try records "stopped" and kills its group),
        SIGKILL STOP_GRACE seconds later if any of it is left; a second call kills at once. Never waits: the main
        thread may be inside this try's wait(), holding the lock that reaping it needs; it takes no lock."""
        if self.ended:  # its number may be reused
            return
        if self.stop_asked is not None:
            signal_group(self.process.pid, signal.SIGKILL)
            return
        self.stop_asked = time.monotonic()
        signal_group(self.process.pid, signal.SIGTERM)

    def _wait_for_try(self) -> int:
        """The try's exit code; SIGKILL to its group STOP_GRACE seconds after a stop was asked for."""
        while True:
            try:
                return self.process.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if self.stop_asked is not None and time.monotonic() - self.stop_asked > STOP_GRACE:
                    signal_group(self.process.pid, signal.SIGKILL)

    def wait(self) -> Outcome:
        """Wait for the try, end what is left of its group, and read its outcome; the temporary folder goes."""
        try:
            code = self._wait_for_try()
            self._end()
            return self._outcome(code, "".join(self.tail))
        finally:
            self.close()

    def _end(self) -> None:
        """Kill what is left of the try's group (engine processes) and wait until it is empty: then its memory
        is free, and every line it wrote has been read."""
        if not end_group(self.process.pid, leader=self.process, first=signal.SIGKILL, grace=STOP_GRACE):
            print(f"evalkit: processes of the try outlived SIGKILL by {2 * STOP_GRACE:g} s (stuck in the kernel, "
                  "in a driver call?); their memory may not be free", file=sys.stderr, flush=True)
        self.ended = True
        self.reader.join(timeout=5)

    def close(self) -> None:
        """End the try's group if it has not ended, stop the watch and remove the temporary folder."""
        if not self.ended:
            self._end()
        if self.death_write is not None:
            forks.forget(fds=(self.death_write,))
            os.close(self.death_write)
            self.death_write = None
        shutil.rmtree(self.work, ignore_errors=True)

    def _outcome(self, code: int, log: str) -> Outcome:
        if self.outcome_file.is_file():
            outcome = Outcome(**json.loads(self.outcome_file.read_text()))
        else:
            outcome = Outcome(status="error", message=f"the try exited with code {code} and no outcome")
            if code == -signal.SIGKILL and self.stop_asked is None:  # not by us
                return self._killed(self.host_oom())
        if outcome.status == "error":
            cause = root_cause(log)
            if cause and cause not in outcome.message:
                outcome.message = f"{cause} (engine log) <- {outcome.message}"
            kind = classify(outcome.message)
            if kind == "weights":
                outcome = Outcome(status="error", message=weights_failure(outcome.message))
            elif kind:
                outcome = Outcome(status="memory", message=outcome.message, memory_kind=kind,
                                  batched_tokens=resolved_tokens(log))
            elif self.host_oom():  # an engine process killed for the machine's memory: the try saw it die
                what = HOST_OOM.format(what="a process of the try")
                outcome = (Outcome(status="error", message=f"{what} (not the GPUs') <- {outcome.message}")
                           if self.on_gpus else
                           Outcome(status="memory", message=f"{what} <- {outcome.message}", memory_kind="pressure"))
        return outcome

    def host_oom(self) -> bool | None:
        """Whether the kernel's out-of-memory killer ended a process on this machine since the try started (None:
        its counter cannot be read)."""
        now = oom_kills()
        return None if now is None or self.oom_kills is None else now > self.oom_kills

    def _killed(self, host_oom: bool | None) -> Outcome:
        """The outcome of a try killed by SIGKILL not sent by evalkit. The kernel's out-of-memory killer is memory
        pressure only where the engine's memory is the machine's (vLLM's CPU build): on GPUs no smaller GPU
        setting gives the machine memory, so the run fails in one line saying so. Another's SIGKILL is no lack
        of memory at all."""
        if host_oom is False:
            return Outcome(status="error", message="the try was killed by SIGKILL from outside (not by evalkit, nor by "
                                                   "the kernel's out-of-memory killer)")
        what = (HOST_OOM.format(what="the try (SIGKILL)") if host_oom else "the try was killed by SIGKILL, not by "
                "evalkit (the kernel's out-of-memory killer? the machine's memory ran out?)")
        if not self.on_gpus:
            return Outcome(status="memory", message=what, memory_kind="pressure")
        return Outcome(status="error", message=f"{what}; that is the machine's memory, not the GPUs', which no "
                                               "smaller GPU setting frees: stop what else holds it, or run where "
                                               "more is free")


def oom_kills() -> int | None:
    """The kernel's count of processes its out-of-memory killer ended on this machine (VMSTAT), or None."""
    try:
        found = re.search(r"^oom_kill (\d+)$", Path(VMSTAT).read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None


def supervise(cfg: EvalConfig, *, wait_for_lock: float = 0.0) -> Path:
    """Run cfg with memory back-off in fresh processes; return the run folder.

    wait_for_lock: seconds to wait for a run that holds these answers' lock (a sweep's points), else refuse."""
    validate(cfg)  # the checks here, before any process starts; the try repeats them
    preflight.check_devices(cfg)
    fits = preflight.check_model(cfg, preflight.resolve_model_path(cfg.vllm_path))
    if fits < cfg.gpu_memory_utilization:  # the tries start there, and the memory back-off lowers from there
        print(Choice("gpu_memory_utilization", fits, f"{cfg.gpu_memory_utilization:g} of the GPU is not free: other "
                     "processes hold part of it").line(), file=sys.stderr, flush=True)
        cfg = replace(cfg, gpu_memory_utilization=fits)
    lock = result_lock(cfg.output_dir, cfg.model_name, answers_key(cfg)).acquire(wait=wait_for_lock)
    try:
        log = RunLog(Path(cfg.output_dir) / cfg.model_name / ".logs")
    except ConfigError:
        lock.release()
        raise
    current: list[Attempt] = []
    stops: list[str] = []  # the signals that asked this run to stop

    def on_signal(signum, frame):  # asks and returns: the main thread ends the try (Attempt.interrupt)
        stops.append(signal.Signals(signum).name)
        for attempt in current:
            attempt.interrupt()

    previous = {s: signal.signal(s, on_signal) for s in stop_signals()}
    forks.handlers_in_child(previous)  # a forked child does not stop this run's tries
    outcome: Outcome | None = None
    try:
        terminal = Terminal(sys.stderr, tty=sys.stderr.isatty())
        before = engine_devices(cfg, environment.devices_now())
        outcome, attempts = run_with_retries(cfg, attempt_in_fresh_process(log, terminal, current, stops, before))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        forks.forget(signals=tuple(previous))
        # before the lock goes: an empty folder is removed with it
        log_path = log.finish(outcome.status if outcome else None, outcome.run_dir if outcome else None)
        lock.release()
    if outcome.status == "config":
        raise ConfigError(outcome.message)
    if outcome.status == "stopped":
        said = f"by {stops[0]}" if stops else f"{outcome.message}; nothing was retried"
        raise RunStopped(f"{said}; finished answers are kept for a rerun", outcome.signal or "SIGTERM")
    if outcome.status != "ok":
        if cfg.engine == "served":  # the server's failure: no engine log of ours to quote, no memory settings tried
            show_failure(None, [], log_path)
            raise RunFailed(outcome.message)
        show_failure(root_cause("".join(current[-1].tail)), list(current[-1].tail), log_path)
        tries = "; ".join(f"{a['settings']}: {a['status']}" for a in attempts)
        raise RunFailed(f"{outcome.message} (tries: {tries})")
    if len(attempts) > 1:
        print(f"evalkit: succeeded on try {len(attempts)} with {attempts[-1]['settings']}; "
              f"pin these settings to skip the failed tries", file=sys.stderr)
    return Path(outcome.run_dir)


def engine_devices(cfg: EvalConfig, visible: list[Any]) -> list[Any]:
    """The devices of visible (this process's, in CUDA_VISIBLE_DEVICES order) the run's engines compute on, whose
    memory the supervisor waits for after each try: a vLLM engine's ranks take the first tensor x pipeline of them,
    and the data-parallel engines of a Ray started here the first of them in turn (devices_needed); the HF engine
    one (all with device_map=auto, none on the CPU); a server evalkit did not start, none. Where Ray places
    engines on a cluster, evalkit cannot tell which of this machine's devices they take: all of them."""
    if cfg.engine == "served" and not cfg.endpoint.serve:
        return []
    if cfg.cluster.address is not None or cfg.distributed_executor_backend == "ray":
        return list(visible)
    if cfg.engine == "hf":
        device_map = cfg.engine_kwargs.get("device_map")
        return list(visible) if device_map == "auto" else [] if device_map == "cpu" else list(visible[:1])
    return list(visible[:devices_needed(cfg)])


def attempt_in_fresh_process(log: RunLog, terminal: Terminal, current: list[Attempt], stops: list[str],
                             before: list[Any]) -> Callable[[EvalConfig, list], Outcome]:
    """The attempt function for run_with_retries: each try in a fresh process, its output to the log and
    the terminal, the try under way in current (for the signal handler). Once stops names a signal, no try
    starts and the one under way ends as stopped (unless it finished its run). After each try, the GPUs of
    before (read before the first) get their memory back (:func:`wait_for_gpu_memory`)."""

    def on_line(line: str) -> None:
        log.write(line)
        try:
            terminal.show(line)
        except (OSError, ValueError):  # the terminal went away: the try goes on, the log keeps every line
            pass

    def attempt(settings: EvalConfig, history: list) -> Outcome:
        stopped = lambda: Outcome(status="stopped", signal=stops[0], message=f"by {stops[0]}")
        if stops:
            return stopped()
        number = len(history) + 1
        log.header(number, memory_settings(settings))
        if number > 1:
            print(f"evalkit: try {number} with {memory_settings(settings)}", file=sys.stderr)
        current[:] = [Attempt(settings, history, on_line=on_line, on_gpus=bool(before))]
        if stops and current[0].stop_asked is None:  # the signal came while the try was being started
            current[0].interrupt()
        outcome = current[0].wait()
        terminal.end()
        if not stops:  # a stopped run ends now
            wait_for_gpu_memory(before)
        if stops and outcome.status != "ok":
            return stopped()
        if outcome.status == "memory":
            print(f"evalkit: try {number} ran out of memory: {outcome.message}", file=sys.stderr)
        return outcome

    return attempt


def wait_for_gpu_memory(before: list[Any]) -> None:
    """Wait until each GPU (or Ascend chip's HBM) has the memory free that it had in before, at most GPU_MEMORY_WAIT
    seconds; one line for each that has not. vLLM's engine processes free a device's memory only as they end, and
    some are outside the try's group (a data-parallel actor's lead their own; Ray frees an actor's GPU when it
    kills it)."""
    for then, now in environment.memory_back(before, timeout=GPU_MEMORY_WAIT):
        print(f"evalkit: {gpus.short_line(then, now, GPU_MEMORY_WAIT, after='the try ended', before='the run')}",
              file=sys.stderr, flush=True)
