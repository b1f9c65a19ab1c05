"""One run per result folder (evalkit/store/lock.py): the lock lives with the results, held with the kernel's flock.

Run: pytest tests/store/test_lock.py (the race of two processes on a torn lock: 20 rounds, a few seconds)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from evalkit.config import ConfigError
from evalkit.store.lock import LOCK_NAME, LockHeld, ResultLock

HOLD = ("import sys, time; from evalkit.store.lock import ResultLock; ResultLock(sys.argv[1]).acquire(); "
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
    with ResultLock(folder) as lock:  # the kernel dropped the dead holder's lock
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert not (folder / LOCK_NAME).exists()


def held_by_another_process(folder, name=LOCK_NAME):
    """A process holding the lock folder/name (kill it when done)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_NAMED, str(folder), name], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


HOLD_NAMED = ("import sys, time; from evalkit.store.lock import ResultLock; ResultLock(sys.argv[1], sys.argv[2]).acquire(); "
              "print('held', flush=True); time.sleep(600)")


def dead_pid():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


@pytest.mark.parametrize("says", [{"host": "node-17", "pid": 1},  # a run on another machine sharing the folder
                                  {"host": socket.gethostname(), "pid": None}])  # another PID namespace: no such pid here
def test_a_held_lock_is_refused_whatever_its_holder_looks_like_from_here(tmp_path, says):
    says = {**says, "pid": says["pid"] or dead_pid(), "started": "2026-11-30T01:00:00"}
    holder = held_by_another_process(tmp_path)
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps(says))  # in place: what the holder's host would have written
        with pytest.raises(LockHeld) as refused:
            ResultLock(tmp_path).acquire()
        message = str(refused.value)
        assert f"pid {says['pid']} on {says['host']}" in message and str(tmp_path / LOCK_NAME) in message
        assert "\n" not in message
    finally:
        holder.kill()
        holder.wait()
    ResultLock(tmp_path).acquire().release()  # its holder gone, the lock is free at once


def test_a_torn_lock_file_of_a_dead_holder_is_free_at_once(tmp_path):
    (tmp_path / LOCK_NAME).write_text('{"host": "')  # the holder died while writing it
    with ResultLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


RACER = """
import os, sys, time
from pathlib import Path
from evalkit.store.lock import ResultLock
folder, rounds, me = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
for n in range(rounds):
    while not (folder.parent / f"go-{n}").exists():
        time.sleep(0.001)
    lock = ResultLock(folder).acquire(wait=60, poll=0.005)
    try:
        os.close(os.open(folder.parent / "inside", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        print(f"round {n}: both held the lock", flush=True)
    else:
        time.sleep(0.02)
        os.unlink(folder.parent / "inside")
    lock.release()
    (folder.parent / f"done-{n}-{me}").touch()
"""


def test_two_processes_racing_on_a_torn_lock_hold_it_one_at_a_time(tmp_path):
    folder, rounds = tmp_path / "model", 20
    folder.mkdir()
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(folder), str(rounds), me],
                               stdout=subprocess.PIPE, text=True) for me in "ab"]
    try:
        for n in range(rounds):
            torn = folder / LOCK_NAME
            torn.write_text('{"host": "')  # a holder that died while writing it, long ago
            os.utime(torn, (time.time() - 120, time.time() - 120))
            (tmp_path / f"go-{n}").touch()
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"done-{n}-{me}").exists() for me in "ab"):
                # a racer that finished its last round may exit before the other touches its file
                alive = all(r.poll() in (None, 0) for r in racers)
                assert time.monotonic() < deadline and alive, f"round {n} hangs"
                time.sleep(0.005)
        outputs = [r.communicate(timeout=60)[0] for r in racers]
    finally:
        for racer in racers:
            racer.kill()
    assert [r.returncode for r in racers] == [0, 0] and outputs == ["", ""], outputs


def test_release_removes_only_its_own_lock_and_other_folders_are_free(tmp_path):
    first = ResultLock(tmp_path / "a").acquire()
    ResultLock(tmp_path / "b").acquire().release()
    replaced = tmp_path / "replaced"
    replaced.write_text(json.dumps({"host": "node-17", "pid": 1, "started": "x"}))
    os.replace(replaced, tmp_path / "a" / LOCK_NAME)  # someone deleted ours and made their own
    first.release()  # not ours any more: left alone
    assert (tmp_path / "a" / LOCK_NAME).exists()


def test_a_process_holds_a_lock_once_and_frees_it_on_release(tmp_path):
    with ResultLock(tmp_path) as lock:
        with pytest.raises(LockHeld):
            ResultLock(tmp_path).acquire()  # a second ResultLock in the same process is another holder
    assert not lock.held and not (tmp_path / LOCK_NAME).exists()
    ResultLock(tmp_path).acquire().release()


def test_a_model_folder_named_two_ways_is_one_lock(tmp_path):
    from evalkit.config import compose_config
    from evalkit.store.fingerprint import answers_key

    model = tmp_path / "models" / "X"
    model.mkdir(parents=True)
    (tmp_path / "link").symlink_to(model)
    keys = {answers_key(compose_config([f"vllm_path={path}"]))
            for path in (model, f"{model}/", tmp_path / "models" / "." / "X", tmp_path / "link")}
    assert len(keys) == 1


def test_runs_that_could_share_a_store_share_a_lock_and_others_of_the_model_do_not():
    from evalkit.config import compose_config
    from evalkit.store.fingerprint import answers_key

    base = answers_key(compose_config([]))
    for scheduling in (["gpu_memory_utilization=0.3"], ["batch_size=4"], ["data_parallel_size=2"],
                       ["tasks=[evalkit_facts]", "limit=3"], ["+engine_kwargs.enforce_eager=true"]):
        assert answers_key(compose_config(scheduling)) == base, scheduling
    for answers in (["dtype=bfloat16"], ["max_model_len=2048"], ["seed=1"], ["+engine_kwargs.quantization=fp8"]):
        assert answers_key(compose_config(answers)) != base, answers


def test_a_sweeps_point_waits_for_the_run_holding_its_answers_then_takes_the_lock(tmp_path):
    from evalkit.store.lock import result_lock

    folder = tmp_path / "model"
    other = result_lock(str(tmp_path), "model", "bbbbbbbbbbbb").acquire()  # other answers: no conflict
    release_after = "import sys, time; from evalkit.store.lock import ResultLock; l = ResultLock(sys.argv[1], '.lock-aaaaaaaaaaaa').acquire(); " \
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


def test_a_tokenizer_named_as_the_model_folder_is_the_models_lock(tmp_path):
    """tokenizer=null and tokenizer=<the model folder> write one request store (the fingerprint leaves out a
    tokenizer that is the model's): they take one lock, so the second waits or is refused before its engine
    starts; a store they still reach by names the key cannot see is held by the store itself (test_store.py)."""
    from evalkit.config import compose_config
    from evalkit.store.fingerprint import answers_key

    model = tmp_path / "X"
    model.mkdir()
    plain = answers_key(compose_config([f"vllm_path={model}"]))
    assert answers_key(compose_config([f"vllm_path={model}", f"tokenizer={model}/"])) == plain
    other = tmp_path / "T"
    other.mkdir()
    assert answers_key(compose_config([f"vllm_path={model}", f"tokenizer={other}"])) != plain


def test_a_link_planted_at_the_lock_path_is_refused_and_its_target_kept(tmp_path):
    """The lock's name (.lock-<key>) is a hash anyone can compute: a link another user plants there, to a file of
    the user who runs evalkit, is refused in one line (a ConfigError: exit 2), and the file it points at is
    neither truncated nor written."""
    folder = tmp_path / "result" / "model"
    folder.mkdir(parents=True)
    victim = tmp_path / "notes.txt"
    victim.write_text("the victim's notes\n")
    (folder / f"{LOCK_NAME}-abc").symlink_to(victim)
    with pytest.raises(ConfigError, match=rf"^{folder}/{LOCK_NAME}-abc is a link: evalkit writes nothing through "
                                          r"it \(another user may have planted it\); remove it, or pass output_dir="):
        ResultLock(folder, f"{LOCK_NAME}-abc").acquire()
    assert victim.read_text() == "the victim's notes\n"
