"""One run per result folder (evalkit/run/lock.py): the lock lives with the results. Run: pytest tests/test_lock.py"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from evalkit.config import ConfigError
from evalkit.run.lock import LOCK_NAME, ResultLock

HOLD = ("import sys, time; from evalkit.run.lock import ResultLock; ResultLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(600)")


def test_a_second_process_is_refused_with_the_holder_named_and_a_dead_holder_is_taken_over(tmp_path):
    folder = tmp_path / "result" / "model"
    other_tmp = tmp_path / "elsewhere"
    other_tmp.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(other_tmp)})  # a lock in TMPDIR would miss it
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"another evalkit run \(pid {holder.pid} on "
                                              rf"{socket.gethostname()}, started .*\) is writing to {folder}"):
            ResultLock(folder).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the lock file stays behind
        holder.wait()
    assert json.loads((folder / LOCK_NAME).read_text())["pid"] == holder.pid
    with ResultLock(folder) as lock:  # stale (dead pid on this host): taken over
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert not (folder / LOCK_NAME).exists()


def test_a_lock_held_on_another_host_is_refused_with_the_file_to_delete(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node-17", "pid": 1, "started": "2026-11-30T01:00:00"}))
    with pytest.raises(ConfigError) as refused:
        ResultLock(tmp_path).acquire()
    message = str(refused.value)
    assert "pid 1 on node-17" in message and f"delete {tmp_path / LOCK_NAME}" in message and "\n" not in message


def test_a_torn_lock_file_is_taken_over_once_it_is_old(tmp_path):
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text('{"host": "')  # the holder died while writing it
    with pytest.raises(ConfigError):
        ResultLock(tmp_path).acquire()  # fresh: its writer may still be at it
    os.utime(lock_file, (time.time() - 120, time.time() - 120))
    ResultLock(tmp_path).acquire().release()


def test_release_removes_only_its_own_lock_and_other_folders_are_free(tmp_path):
    first = ResultLock(tmp_path / "a").acquire()
    ResultLock(tmp_path / "b").acquire().release()
    (tmp_path / "a" / LOCK_NAME).write_text(json.dumps({"host": "node-17", "pid": 1, "started": "x"}))
    first.release()  # not ours any more: left alone
    assert (tmp_path / "a" / LOCK_NAME).exists()


def test_runs_that_could_share_a_store_share_a_lock_and_others_of_the_model_do_not():
    from evalkit.config import compose_config
    from evalkit.engine.store import answers_key

    base = answers_key(compose_config([]))
    for scheduling in (["gpu_memory_utilization=0.3"], ["batch_size=4"], ["data_parallel_size=2"],
                       ["tasks=[evalkit_facts]", "limit=3"], ["+engine_kwargs.enforce_eager=true"]):
        assert answers_key(compose_config(scheduling)) == base, scheduling
    for answers in (["dtype=bfloat16"], ["max_model_len=2048"], ["seed=1"], ["+engine_kwargs.quantization=fp8"]):
        assert answers_key(compose_config(answers)) != base, answers


def test_a_sweeps_point_waits_for_the_run_holding_its_answers_then_takes_the_lock(tmp_path):
    from evalkit.run.lock import LockHeld, result_lock

    folder = tmp_path / "model"
    other = result_lock(str(tmp_path), "model", "bbbbbbbbbbbb").acquire()  # other answers: no conflict
    release_after = "import sys, time; from evalkit.run.lock import ResultLock; l = ResultLock(sys.argv[1], '.lock-aaaaaaaaaaaa').acquire(); " \
                    "print('held', flush=True); time.sleep(3); l.release()"
    holder = subprocess.Popen([sys.executable, "-c", release_after, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld):
            result_lock(str(tmp_path), "model", "aaaaaaaaaaaa").acquire()
        started = time.monotonic()
        lock = result_lock(str(tmp_path), "model", "aaaaaaaaaaaa").acquire(wait=60, poll=0.2)
        assert lock.held and 0.5 < time.monotonic() - started < 30
        lock.release()
    finally:
        holder.kill()
        other.release()
