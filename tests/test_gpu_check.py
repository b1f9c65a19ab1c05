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
    for name in ("memory", "release", "driver_cuda", "hf_batch"):
        assert record["parts"][name] == {"status": NO_CUDA}
    for name in ("guard_fork", "collect_env"):
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


# pynvml hidden from every process of the check (its children too: PYTHONPATH), as on a GPU machine that has torch
# but not nvidia-ml-py
NO_PYNVML = """
import sys


class NoPynvml:
    def find_spec(self, name, path=None, target=None):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")


sys.meta_path.insert(0, NoPynvml())
"""


def test_without_pynvml_no_part_passes_that_it_did_not_measure(tmp_path):
    """Without NVML a part that reads it (the driver's CUDA version, memory totals, memory coming back) has nothing
    to compare: its status says so, and no part says "ok" with an empty reading."""
    import os

    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(NO_PYNVML)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "hide"), str(ROOT)])}
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    parts = json.loads(out.read_text())["parts"]
    assert {name for name, part in parts.items() if part["status"] == "ok"} == {"guard_fork", "collect_env"}
    assert parts["driver_cuda"] == {"status": NO_CUDA}


def test_on_a_gpu_machine_without_nvml_the_nvml_parts_say_they_did_not_measure():
    """What main decides from what gpus.discover() found: GPUs counted from their device nodes (no pynvml) leave
    memory, release and driver_cuda unmeasured, each saying why; through NVML they run."""
    from benchmarks.gpu_check import cannot_measure
    from evalkit.engine.machine.gpus import NO_NAME, Gpu

    nodes = [Gpu(0, NO_NAME, None, None, None)]
    why = cannot_measure(nodes, "device nodes", "12.8")
    assert set(why) == {"memory", "release", "driver_cuda"}
    assert all(reason.startswith("not measured: NVML unavailable (GPUs found by device nodes); nvidia-ml-py's "
                                 "pynvml is evalkit's dependency") for reason in why.values())
    nvml = [Gpu(0, "NVIDIA H100 80GB HBM3", "GPU-0", 80 << 30, 79 << 30)]
    assert cannot_measure(nvml, "nvml", "12.8") == {"memory": None, "release": None, "driver_cuda": None}
    assert set(cannot_measure(nvml, "nvml", None).values()) == {NO_CUDA}  # torch's CPU build


def test_pack_deps_brings_pynvml(tmp_path):
    from benchmarks.gpu_check import pack_deps

    assert pack_deps(tmp_path / "deps") > 0
    assert (tmp_path / "deps" / "pynvml.py").is_file() and list((tmp_path / "deps").glob("nvidia_ml_py-*.dist-info"))
