"""What a process sets up for itself does not reach a child it forks (evalkit/engine/machine/forks.py): the try's
signal guard, the request store's flock, the environment facts' lock. Each child here is a real os.fork, as vLLM's
fork context makes one; tests/test_forked_engine.py runs the real engine so.
Run: pytest tests/engine/machine/test_forks.py
"""

import json
import os
import subprocess
import sys

from evalkit.engine.machine import forks

# The try's guard (attempt.guard), then a child forked as vLLM forks its EngineCore: the child installs its own
# Python SIGTERM handler (as vLLM's EngineCore does) and is SIGTERMed by its parent (as vLLM's shutdown does at
# engine.close()); the try then records its finished run. The child reports what it inherited.
FORKED_AFTER_GUARD = r"""
import json, os, signal, sys, time
from pathlib import Path
from evalkit.run import attempt

outcome = attempt.OutcomeFile(Path(sys.argv[1]))
before = set(map(int, os.listdir("/proc/self/fd")))
handlers = {"sigterm_before": repr(signal.getsignal(signal.SIGTERM)), "sigint_before": repr(signal.getsignal(signal.SIGINT))}
attempt.guard(outcome, None)
fds = sorted(set(map(int, os.listdir("/proc/self/fd"))) - before)  # the guard's
report, child_end = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(report)
    seen = {"wakeup": signal.set_wakeup_fd(-1), "sigterm": repr(signal.getsignal(signal.SIGTERM)),
            "sigint": repr(signal.getsignal(signal.SIGINT)), "guard": fds,
            "closed": [fd for fd in fds if not os.path.exists(f"/proc/self/fd/{fd}")], **handlers}
    signal.set_wakeup_fd(seen["wakeup"]) if seen["wakeup"] != -1 else None  # as it was, for what follows
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    os.write(child_end, json.dumps(seen).encode())
    os.close(child_end)
    time.sleep(30)
    os._exit(1)
os.close(child_end)
seen = json.loads(os.read(report, 4096))
os.kill(pid, signal.SIGTERM)
os.waitpid(pid, 0)
time.sleep(0.5)  # the watchdog would have read a byte written into its pipe by now
outcome.write(status="ok", run_dir="/result/m/run1")
print(json.dumps(seen))
"""


def test_a_child_forked_after_the_guard_keeps_none_of_it_and_its_sigterm_is_no_stop(tmp_path):
    """The child has no wakeup fd and the default handlers; the guard's pipe is closed in it; the SIGTERM its
    parent sends it (vLLM's shutdown) leaves the try's outcome to the try, which records its finished run."""
    out = tmp_path / "outcome.json"
    done = subprocess.run([sys.executable, "-c", FORKED_AFTER_GUARD, str(out)], capture_output=True, text=True,
                          timeout=60, start_new_session=True)  # a stop would kill this process's group
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == {"status": "ok", "run_dir": "/result/m/run1"}
    seen = json.loads(done.stdout)
    assert seen["wakeup"] == -1
    # the handlers the process had before the guard: SIGTERM's default, and SIGINT's Python one, or SIG_IGN where
    # the process started with SIGINT ignored (a background job of a non-interactive shell, as CI may start it)
    assert seen["sigterm"] == seen["sigterm_before"] == "<Handlers.SIG_DFL: 0>"
    assert seen["sigint"] == seen["sigint_before"]
    assert len(seen["guard"]) == 2 and seen["closed"] == seen["guard"]  # the guard's two pipe ends


def test_a_store_its_holder_closed_is_free_while_a_child_forked_from_it_lives(tmp_path):
    """Another run may take a request store once its holder closed it, though an engine process forked while
    it was held is still alive."""
    from evalkit.store.requests import RequestStore, hold

    path = tmp_path / "store.jsonl"
    store = RequestStore(path)
    child = os.fork()
    if child == 0:
        os.read(os.pipe()[0], 1)  # blocks until killed: a child that outlives the store
    try:
        store.close()
        os.close(hold(path))  # another run: refused with StoreHeld while the child held the flock
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def test_a_descriptor_forgotten_by_its_owner_is_left_to_whoever_reuses_its_number():
    read, write = os.pipe()
    forks.close_in_child(read, write)
    forks.forget(fds=(read,))
    child = os.fork()
    if child == 0:
        os._exit(int(os.path.exists(f"/proc/self/fd/{read}")) + 2 * int(not os.path.exists(f"/proc/self/fd/{write}")))
    _, status = os.waitpid(child, 0)
    forks.forget(fds=(write,))
    os.close(read)
    os.close(write)
    assert os.waitstatus_to_exitcode(status) == 3  # read kept, write closed


def test_the_environment_facts_lock_is_free_in_a_forked_child():
    """A child forked while another thread gathers the facts (holding the lock) gathers its own."""
    from evalkit.harness import lm_eval_compat

    with lm_eval_compat._GATHERING:
        child = os.fork()
        if child == 0:
            os._exit(0 if lm_eval_compat._GATHERING.acquire(timeout=2) and not lm_eval_compat._GATHERED else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
