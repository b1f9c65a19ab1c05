"""Ending a process group and knowing it has ended (evalkit/engine/machine/process_group.py), for a run's try
(evalkit/run/supervise.py), a server evalkit started and a data-parallel actor's engine processes, with real
processes: a member that ignores SIGTERM, a try that leaves one behind, an owner killed by SIGKILL.

Run: pytest tests/engine/machine/test_process_group.py
"""

import os
import signal
import subprocess
import sys
import time

import psutil

from evalkit.config import EvalConfig
from evalkit.engine.machine.process_group import end_group, ended, live_members

# a group leader whose child ignores SIGTERM and holds memory (it takes a while to tear down), as an engine
# process may; both print their pid and wait
LEADER = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); held = bytearray(256 << 20); "
    "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


def start_group() -> tuple[subprocess.Popen, int]:
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    return leader, int(leader.stdout.readline())


def test_end_group_returns_once_every_member_is_gone_and_reaps_the_leader():
    leader, child = start_group()
    assert sorted(live_members(leader.pid)) == sorted([leader.pid, child])
    started = time.monotonic()
    assert end_group(leader.pid, leader=leader, grace=1.0) is True  # SIGTERM, 1 s, SIGKILL
    print(f"\nthe group ended {time.monotonic() - started:.2f} s after SIGTERM (1 s grace, then SIGKILL)")
    assert live_members(leader.pid) == [] and ended(leader.pid)
    assert leader.returncode == -signal.SIGTERM  # reaped here: no zombie of ours left in the group
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


# a try (stand-in for python -m evalkit.run.attempt) that leaves a member of its group behind and exits; the
# member does not hold the try's output pipe (reading that pipe to its end used to be the only wait)
LEAVING_TRY = r"""
import json, subprocess, sys
left = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); held = bytearray(256 << 20); "
    "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
left.stdout.readline()
open(sys.argv[-2], "w").write(json.dumps({"status": "error", "message": f"ValueError: left {left.pid}"}))
"""


def test_a_try_is_waited_for_until_its_group_is_empty_and_its_folder_is_gone(tmp_path, monkeypatch):
    """Attempt.wait returns only when nothing of the try's group is left (the next try then finds its memory
    free), and its temporary folder is removed."""
    from evalkit.run.supervise import Attempt

    script, python = tmp_path / "try.py", tmp_path / "python"
    script.write_text(LEAVING_TRY)
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    attempt = Attempt(EvalConfig(model_name="m", vllm_path="/x"), [], on_line=lambda line: None)
    outcome = attempt.wait()
    left = int(outcome.message.split()[-1])
    assert not psutil.pid_exists(left) or psutil.Process(left).status() == psutil.STATUS_ZOMBIE, "still alive"
    assert live_members(attempt.process.pid) == []
    assert not attempt.work.exists()


# a data-parallel actor (stand-in): a Ray worker leads its own process group; its engine processes are a forked
# child (vLLM forks its EngineCore on GPUs) and a started one (spawned, as on CPUs, or a worker)
OWNER = r"""
import multiprocessing, subprocess, sys, time
from evalkit.engine.machine.process_group import guard_own_group

guard_own_group()
forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
forked.start()
started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(forked.pid, started.pid, flush=True)
time.sleep(600)
"""


def test_engine_processes_die_with_the_actor_that_started_them_even_by_sigkill():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    engines = [int(pid) for pid in owner.stdout.readline().split()]
    owner.kill()  # ray.kill, or a crash: the actor cannot clean up
    owner.wait()
    killed = time.monotonic()
    deadline = killed + 10
    alive = lambda: [p for p in engines if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive() == [], "engine processes outlived their actor"
    print(f"\nthe actor's engine processes were gone {time.monotonic() - killed:.2f} s after its SIGKILL")
    for pid in engines:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
