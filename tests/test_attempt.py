"""The try's outcome file (evalkit/run/attempt.py): written once, the first writer wins, and a stop that comes
while the main thread records its finished run leaves that record. Deterministic: the signal is sent from
inside the write, at the instant the outcome is being published.

Run: pytest tests/test_attempt.py
"""

import json
import os
import signal
import subprocess
import sys
import threading

from evalkit.run.attempt import OutcomeFile, stop

# A try's signal handling (attempt.guard: the main thread's handler and the watchdog thread) around the main
# thread's last act, recording "ok" for a published run; SIGTERM arrives from outside in the middle of that
# write, after its temporary file is written and before it is published, and the write then takes 0.5 s more.
SIGNAL_DURING_WRITE = r"""
import os, signal, sys, time
from pathlib import Path
from evalkit.run import attempt

real_link = os.link
def link(src, dst, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # the main thread's own handler runs right after this call
    time.sleep(0.5)  # the watchdog thread is awake meanwhile
    return real_link(src, dst, **kwargs)

outcome = attempt.OutcomeFile(Path(sys.argv[1]))
attempt.guard(outcome, None)
os.link = link
outcome.write(status="ok", run_dir="/result/m/run1")
time.sleep(10)  # the watchdog ends this process (SIGKILL to its group) before this ends
sys.exit(3)
"""


def test_a_stop_during_the_record_of_a_finished_run_keeps_the_record(tmp_path):
    script, path = tmp_path / "try.py", tmp_path / "outcome.json"
    script.write_text(SIGNAL_DURING_WRITE)
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=60,
                          start_new_session=True)  # the watchdog kills its own group
    assert done.returncode == -signal.SIGKILL, done.stderr  # the stop still ended the try, and raised nothing
    assert json.loads(path.read_text()) == {"status": "ok", "run_dir": "/result/m/run1"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outcome.json", "try.py"]  # no temporary file left


def test_the_first_writer_wins_and_the_later_one_neither_overwrites_nor_raises(tmp_path, monkeypatch):
    """Two writers interleaved at the publish step: the watchdog's stop waits for the main thread's record."""
    path, kills = tmp_path / "outcome.json", []
    outcome = OutcomeFile(path)
    real_link, watchdog = os.link, []

    def link(src, dst, **kwargs):  # the main thread is publishing: the watchdog stops the try now
        if not watchdog:
            watchdog.append(threading.Thread(target=stop, args=(signal.SIGTERM, outcome),
                                             kwargs={"wait": True, "kill": lambda: kills.append("watchdog")}))
            watchdog[0].start()
            watchdog[0].join(timeout=0.5)
            stop(signal.SIGINT, outcome, wait=False, kill=lambda: kills.append("main"))  # its own handler, too
        return real_link(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", link)
    assert outcome.write(status="ok", run_dir="/r") is True
    watchdog[0].join(timeout=5)
    assert json.loads(path.read_text()) == {"status": "ok", "run_dir": "/r"} and kills == ["watchdog"]
    assert outcome.write(status="error", message="late") is False
    assert json.loads(path.read_text())["status"] == "ok"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outcome.json"]
