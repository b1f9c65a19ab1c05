"""benchmarks/gpu_check.py on a machine without a GPU: it runs, records the GPU parts as skipped, and its guard
part, with evalkit's real attempt.guard() and a forked child terminated by SIGTERM, finds no byte in the try's
pipe (and one where the guard's state is left to the child). Run: ``.venv/bin/python -m pytest tests/test_gpu_check.py``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import NO_CUDA

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"guard_fork", "memory", "release", "collect_env", "driver_cuda", "hf_batch"}


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def test_every_part_is_recorded_and_the_gpu_parts_are_skipped(record):
    assert record["benchmark"] == "benchmarks.gpu_check" and record["date"] and record["machine"]["torch"]
    assert set(record["parts"]) == PARTS
    for name in ("memory", "release", "hf_batch"):
        assert record["parts"][name] == {"status": NO_CUDA}
    for name in ("guard_fork", "collect_env", "driver_cuda"):
        assert record["parts"][name]["status"] == "ok", record["parts"][name]


def test_a_forked_child_terminated_by_sigterm_leaves_the_trys_pipe_empty(record):
    guard = record["parts"]["guard_fork"]
    fixed, unfixed = guard["fixed"], guard["unfixed"]
    assert guard["evalkit_pipe_saw_byte"] is False and fixed["outcome_written"] is None
    assert fixed["child"]["wakeup_fd_inherited"] is False and fixed["child"]["gemm"].startswith("ran on cpu")
    assert fixed["child_end"] == {"terminated": "SystemExit from its own SIGTERM handler"}
    # the contrast shows the check can see a byte: the child keeps the wakeup fd, and its SIGTERM reads as a stop
    assert guard["without_the_child_reset_pipe_saw_byte"] is True and unfixed["child"]["wakeup_fd_inherited"]
    assert unfixed["outcome_written"]["status"] == "stopped" and guard["as_expected"] is True


def test_collect_env_and_driver_read_without_a_gpu(record):
    env = record["parts"]["collect_env"]
    assert env["evalkit_touches_cuda"] is False and env["evalkit"]["chars"] > 0 and env["torch"]["chars"] > 0
    assert record["parts"]["driver_cuda"]["driver_cuda"] is None
