"""OOM back-off policy, failure classification and the run lock (evalkit/supervise.py), with fault injection.

Run: pytest tests/test_supervise.py
"""

import dataclasses

import pytest

from evalkit.config import ConfigError, EvalConfig, OomRetry
from evalkit.supervise import Outcome, classify, next_settings, root_cause, run_with_retries

VLLM_ERRORS = {
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": "pressure",
    "ValueError: Free memory on device (10.1/79.3 GiB) on startup is less than desired GPU memory utilization "
    "(0.9, 71.4 GiB).": "pressure",
    "ValueError: Available memory on node 0 (7.5/9.59 GiB) on startup is less than desired CPU memory "
    "utilization (0.9, 8.63 GiB).": "pressure",
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`": "kv_cache",
    "ValueError: To serve at least one request with the model's max seq len (32768), (4.0 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (1.2 GiB).": "kv_cache",
    "OSError: [Errno 12] Cannot allocate memory": "pressure",
    "ValueError: Unsupported architecture FooForCausalLM": None,
    "RuntimeError: Engine core initialization failed. See root cause above.": None,
}


@pytest.mark.parametrize("text, kind", VLLM_ERRORS.items())
def test_classify_memory_failures(text, kind):
    assert classify(text) == kind


def cfg(**kwargs):
    return EvalConfig(**{"model_name": "m", "vllm_path": "/x", **kwargs})


class Faults:
    """An attempt function that fails with the given outcomes in turn, then succeeds."""

    def __init__(self, *failures: Outcome):
        self.failures = list(failures)
        self.seen = []

    def __call__(self, settings, history):
        self.seen.append((settings, len(history)))
        return self.failures.pop(0) if self.failures else Outcome(status="ok", run_dir="/r")


OOM = Outcome(status="memory", message="CUDA out of memory", memory_kind="pressure")
KV = Outcome(status="memory", message="No available memory for the cache blocks", memory_kind="kv_cache")


def test_pressure_lowers_utilization_step_by_step_to_the_floor_then_sequences_then_eager():
    policy = OomRetry(utilization_step=0.1, utilization_floor=0.7, max_num_seqs=[64, 16], eager=True, max_attempts=20)
    faults = Faults(*[OOM] * 5)
    outcome, attempts = run_with_retries(cfg(gpu_memory_utilization=0.9, oom_retry=policy), faults)
    assert outcome.status == "ok"
    assert [a["settings"] for a in attempts] == [
        {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.8, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.7, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.7, "batch_size": 64, "enforce_eager": False},
        {"gpu_memory_utilization": 0.7, "batch_size": 16, "enforce_eager": False},
        {"gpu_memory_utilization": 0.7, "batch_size": 16, "enforce_eager": True},
    ]
    assert [a["status"] for a in attempts] == ["memory"] * 5 + ["ok"]
    assert attempts[0]["error"] == "CUDA out of memory"
    assert [n for _, n in faults.seen] == list(range(6))  # each try is told the earlier ones


def test_back_off_runs_out_and_stops_with_every_try_recorded():
    policy = OomRetry(utilization_step=0.2, utilization_floor=0.5, max_num_seqs=[8], eager=False)
    outcome, attempts = run_with_retries(cfg(gpu_memory_utilization=0.9, oom_retry=policy), Faults(*[OOM] * 10))
    assert outcome.status == "memory" and len(attempts) == 4  # nothing left to lower after these
    assert [a["settings"]["gpu_memory_utilization"] for a in attempts] == [0.9, 0.7, 0.5, 0.5]
    assert attempts[-1]["settings"]["batch_size"] == 8


def test_kv_cache_shortage_skips_lowering_utilization():
    policy = OomRetry(max_num_seqs=[32], eager=True)
    _, attempts = run_with_retries(cfg(gpu_memory_utilization=0.9, oom_retry=policy), Faults(KV, KV))
    assert [a["settings"] for a in attempts] == [
        {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.9, "batch_size": 32, "enforce_eager": False},
        {"gpu_memory_utilization": 0.9, "batch_size": 32, "enforce_eager": True},
    ]


def test_sequence_steps_only_go_down():
    policy = OomRetry(max_num_seqs=[64, 16, 4], eager=False)
    start = cfg(gpu_memory_utilization=0.5, batch_size=16, oom_retry=policy)
    assert next_settings(start, "pressure", policy).batch_size == 4
    assert next_settings(dataclasses.replace(start, batch_size=4), "pressure", policy) is None


@pytest.mark.parametrize("failure", [Outcome(status="error", message="Unsupported architecture"),
                                     Outcome(status="config", message="unknown task 'x'")])
def test_other_failures_are_not_retried(failure):
    faults = Faults(failure, OOM)
    outcome, attempts = run_with_retries(cfg(), faults)
    assert outcome is failure and len(attempts) == 1 and len(faults.seen) == 1


def test_disabled_back_off_tries_once():
    outcome, attempts = run_with_retries(cfg(oom_retry=OomRetry(enabled=False)), Faults(OOM))
    assert outcome.status == "memory" and len(attempts) == 1


def test_max_attempts_caps_the_tries():
    outcome, attempts = run_with_retries(cfg(oom_retry=OomRetry(max_attempts=3)), Faults(*[OOM] * 10))
    assert len(attempts) == 3


def test_root_cause_is_read_off_the_engine_log():
    log = "\n".join([
        "(EngineCore pid=1) INFO starting",
        "(VllmWorker-0 pid=2) ERROR [multiproc_executor.py:953] ValueError: Available memory on node 0 (7.5/9.59 GiB)"
        " on startup is less than desired CPU memory utilization (0.9, 8.63 GiB).",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ])
    assert root_cause(log).startswith("ValueError: Available memory on node 0")
    assert root_cause("x\nKeyError: 'foo'\nRuntimeError: Engine core initialization failed.") == \
        "RuntimeError: Engine core initialization failed."
    assert root_cause("all fine") is None
