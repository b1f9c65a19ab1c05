"""The start of a run on a GPU machine, recreated on this CPU one (issue 27, item 1): no CUDA runtime call
before vLLM starts its engine, and the variables vLLM reads set as it needs them.

``python -m evalkit`` runs as a user runs it, in a subprocess whose Python processes (the supervisor and its try)
all load tests/gpu_machine/sitecustomize.py: a fake NVIDIA driver in a temporary folder, NVML faked at the pynvml
boundary (two H100s), torch's CUDA runtime entry points replaced by recorders that fail, and ``vllm.LLM`` replaced
by a recorder of its arguments and environment, which fails too, so the run ends there (exit 1). The real CPU
build of vLLM is imported on the way. Run: ``.venv/bin/python -m pytest tests/test_gpu_start.py -q``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
MACHINE = Path(__file__).parent / "gpu_machine"


def h100(n: int, free: int) -> dict:
    return {"name": H100, "uuid": f"GPU-{n}a{n}b-0000", "total": 80 * GIB, "free": free}


def run_on_gpus(tmp_path: Path, gpus: list[dict], *args: str, initialised: bool = False, engine_error: str = ""):
    """``python -m evalkit limit=1 ...`` on the recreated machine: (the completed process, the records)."""
    root = tmp_path / "machine"
    (root / "proc/driver/nvidia").mkdir(parents=True)
    (root / "dev").mkdir()
    for name in ["nvidiactl"] + [f"nvidia{i}" for i in range(len(gpus))]:
        (root / "dev" / name).touch()
    record = tmp_path / "record.jsonl"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_NVML_BASED_CUDA_CHECK", "CUDA_VISIBLE_DEVICES") and not k.startswith("VLLM_")}
    env.update(PYTHONPATH=os.pathsep.join([str(MACHINE), env.get("PYTHONPATH", "")]), EVALKIT_TEST_GPU_ROOT=str(root),
               FAKE_NVML=json.dumps(gpus), EVALKIT_TEST_RECORD=str(record))
    if initialised:
        env["EVALKIT_TEST_CUDA_INITIALISED"] = "1"
    if engine_error:
        env["EVALKIT_TEST_LLM_ERROR"] = engine_error
    done = subprocess.run([sys.executable, "-m", "evalkit", "limit=1", f"output_dir={tmp_path / 'out'}", "resume=false",
                           *args], capture_output=True, text=True, timeout=600, env=env)
    lines = record.read_text().splitlines() if record.exists() else []
    return done, [json.loads(line) for line in lines]


def runtime_calls(records: list[dict]) -> list[str]:
    return [f"{r['call']} from {' <- '.join(reversed(r['stack'][-4:]))}" for r in records if r["kind"] == "cuda_runtime"]


def engine_call(done, records: list[dict]) -> dict:
    calls = [r for r in records if r["kind"] == "vllm.LLM"]
    assert len(calls) == 1, f"vllm.LLM was not reached: {done.stderr[-3000:]}"
    return calls[0]


def test_no_cuda_call_before_the_engine_and_a_utilization_that_fits_a_busy_gpu(tmp_path):
    """GPU 0 has 30 GiB free (another process holds the rest): the default 0.5 does not fit, 0.36 does."""
    done, records = run_on_gpus(tmp_path, [h100(0, 30 * GIB), h100(1, 79 * GIB)])
    assert done.returncode == 1, done.stderr[-3000:]
    assert runtime_calls(records) == []
    call = engine_call(done, records)
    assert call["env"].get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"  # lm-eval's and transformers' checks: NVML
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in call["env"]  # nothing touched CUDA: vLLM may fork, as it does
    assert call["kwargs"]["gpu_memory_utilization"] == 0.36  # (30 - 1) / 80, rounded down
    assert "evalkit: chose gpu_memory_utilization=0.36" in done.stderr
    assert "enforce_eager" not in call["kwargs"] and "block_size" not in call["kwargs"]  # no CPU choices on GPUs


def test_the_memory_back_off_lowers_the_utilization_that_fitted_not_the_one_asked(tmp_path):
    """After an out-of-memory failure at the 0.56 chosen for a busy GPU, the next try asks 0.46, not 0.56 again
    (0.9 - 0.1 = 0.8 does not fit either, and would be fitted down to 0.56 once more)."""
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    done, records = run_on_gpus(tmp_path, [h100(0, 46 * GIB), h100(1, 79 * GIB)], "gpu_memory_utilization=0.9",
                                "oom_retry.max_attempts=2", "oom_retry.utilization_floor=0.3", engine_error=oom)
    assert done.returncode == 1, done.stderr[-3000:]
    tries = [r["kwargs"]["gpu_memory_utilization"] for r in records if r["kind"] == "vllm.LLM"]
    assert tries == [0.56, 0.46], done.stderr[-3000:]
    assert done.stderr.count("evalkit: chose gpu_memory_utilization=0.56") == 1


def test_vllm_spawns_where_cuda_was_initialised_anyway(tmp_path):
    done, records = run_on_gpus(tmp_path, [h100(0, 79 * GIB), h100(1, 79 * GIB)], initialised=True)
    call = engine_call(done, records)
    assert call["env"].get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn"
    assert "evalkit: chose env.VLLM_WORKER_MULTIPROC_METHOD=spawn" in done.stderr
    assert call["kwargs"]["gpu_memory_utilization"] == 0.5  # idle GPUs: the asked share, untouched


def test_a_split_the_heads_do_not_allow_fails_before_the_engine_in_one_line(tmp_path):
    """The embedded model has 9 attention heads and 3 key/value heads: two ranks cannot split them."""
    done, records = run_on_gpus(tmp_path, [h100(0, 79 * GIB), h100(1, 79 * GIB)], "tensor_parallel_size=2")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "evalkit: error: tensor_parallel_size=2 cannot split smollm2-135m-instruct's 9 attention heads "
        "(num_attention_heads) in config.json evenly between the ranks, which vLLM needs; pass tensor_parallel_size=3")
    assert records == []


def check_in_gpu_machine(tmp_path: Path, code: str, nvml_check: bool):
    """Python code in a process on the recreated machine (two idle H100s): (its output, the CUDA runtime calls)."""
    root = tmp_path / "machine"
    (root / "proc/driver/nvidia").mkdir(parents=True, exist_ok=True)
    record = tmp_path / "record.jsonl"
    record.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env.update(PYTHONPATH=str(MACHINE), EVALKIT_TEST_GPU_ROOT=str(root), EVALKIT_TEST_RECORD=str(record),
               FAKE_NVML=json.dumps([h100(0, 79 * GIB), h100(1, 79 * GIB)]))
    if nvml_check:
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    lines = record.read_text().splitlines() if record.exists() else []
    return done.stdout.strip(), [json.loads(line)["call"] for line in lines]


def test_torch_counts_gpus_through_nvml_only_with_the_variable_set(tmp_path):
    """The mechanism, on torch's own code: is_available() calls cudaGetDeviceCount (which initialises CUDA)
    unless PYTORCH_NVML_BASED_CUDA_CHECK=1 (torch/cuda/__init__.py, is_available and _nvml_based_avail)."""
    code = "import torch\ntry:\n    print(torch.cuda.is_available())\nexcept RuntimeError:\n    print('failed')"
    assert check_in_gpu_machine(tmp_path, code, nvml_check=False) == ("failed", ["torch._C._cuda_getDeviceCount"])
    assert check_in_gpu_machine(tmp_path, code, nvml_check=True) == ("True", [])


def test_the_recorded_hardware_names_the_gpus_through_nvml(tmp_path):
    code = "from evalkit.engine.machine.environment import hardware\nprint(hardware()['gpus'])"
    assert check_in_gpu_machine(tmp_path, code, nvml_check=False) == (str([H100, H100]), [])


def test_the_nvml_check_is_set_before_torch_unless_the_user_set_it(monkeypatch):
    from evalkit.engine.machine.environment import use_nvml_for_cuda_checks

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    use_nvml_for_cuda_checks()
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    use_nvml_for_cuda_checks()
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


MAPS_AFTER_CUDA = """\
55d0c6a00000-55d0c6a2e000 r--p 00000000 00:2a 1049 /usr/bin/python3.11
7f3a18000000-7f3a1a4b1000 r-xp 00000000 00:2a 2211 /opt/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12
7f3a1c000000-7f3a1d2a4000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f3a1e000000-7f3a1e100000 r-xp 00000000 08:01 1235 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15
"""


def test_the_cuda_driver_is_read_off_the_process_maps():
    from evalkit.engine.machine.environment import cuda_driver_mapped

    assert cuda_driver_mapped(MAPS_AFTER_CUDA)
    before = "".join(line + "\n" for line in MAPS_AFTER_CUDA.splitlines() if "libcuda.so" not in line)
    assert not cuda_driver_mapped(before)  # the runtime library and NVML loaded, the driver not: CUDA untouched
    assert not cuda_driver_mapped(open("/proc/self/maps").read())  # this process: torch imported, no CUDA


def test_cuda_counts_as_touched_where_torch_says_it_is_initialised(monkeypatch):
    import torch

    from evalkit.engine.machine.environment import cuda_touched

    assert not cuda_touched()
    monkeypatch.setattr(torch.cuda, "_initialized", True)  # as torch.cuda._lazy_init leaves it
    assert cuda_touched()
