"""The memory back-off's reading of CUDA vLLM's failures (evalkit/engine/backoff.py): an out-of-memory in vLLM's
profiling run, cuBLAS's allocation failure, vLLM's "Error in memory profiling" and its sampler warm-up, each
with the texts vLLM 0.32 and torch print, in the tracebacks vLLM's processes log; and the steps each gets.

    .venv/bin/python -m pytest tests/engine/test_backoff.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from evalkit.config import EvalConfig, OomRetry
from evalkit.engine.backoff import classify, next_settings, resolved_tokens, root_cause
from evalkit.run.supervise import Outcome, run_with_retries

# torch's text when cuBLAS cannot make its handle on a nearly full GPU (TORCH_CUDABLAS_CHECK, ATen/cuda/Exceptions.h)
CUBLAS = "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.12 GiB is free.")
# vllm/v1/worker/gpu_worker.py determine_available_memory, as vLLM formats it
UNSTEADY = ("AssertionError: Error in memory profiling. Initial free memory 70.21 GiB, current free memory 75.90 GiB. "
            "This happens when other processes sharing the same container release GPU memory while vLLM is profiling "
            "during initialization. To fix this, ensure consistent GPU memory allocation or isolate vLLM in its own "
            "container.")
# vllm/v1/worker/gpu_model_runner.py _dummy_sampler_run
SAMPLER = ("RuntimeError: CUDA out of memory occurred when warming up sampler with 1024 dummy requests. Please try "
           "lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine.")
# the EngineCore's path into the profiling run, Model Runner V2 (the default on CUDA), one rank
PROFILE = [("v1/engine/core.py", "__init__"), ("v1/engine/core.py", "_initialize_kv_caches"),
           ("v1/executor/abstract.py", "determine_available_memory"),
           ("v1/executor/uniproc_executor.py", "collective_rpc"),
           ("v1/worker/gpu_worker.py", "determine_available_memory"),
           ("v1/worker/gpu/model_runner.py", "profile_run"), ("v1/worker/gpu/model_runner.py", "_dummy_run")]
FORWARD = [("v1/engine/core.py", "step"), ("v1/worker/gpu/model_runner.py", "execute_model")]


def vllm_source(path: str) -> str:
    return (Path(importlib.util.find_spec("vllm").origin).parent / path).read_text()


def test_the_texts_here_are_vllms_and_torchs():
    """The fixed parts of each text are in the installed vLLM's source (a vLLM that rewords them fails here)."""
    worker, runner = vllm_source("v1/worker/gpu_worker.py"), vllm_source("v1/worker/gpu_model_runner.py")
    assert '"Error in memory profiling. "' in worker and "def determine_available_memory" in worker
    assert '"CUDA out of memory occurred when warming up sampler with "' in runner
    assert "def profile_run" in vllm_source("v1/worker/gpu/model_runner.py")
    assert '"Chunked prefill is enabled with max_num_batched_tokens=%d."' in vllm_source("config/scheduler.py")
    torch_h = Path(importlib.util.find_spec("torch").origin).parent / "include/ATen/cuda/Exceptions.h"
    if torch_h.is_file():
        assert '"CUDA error: ",' in torch_h.read_text() and '" when calling `" #EXPR "`"' in torch_h.read_text()


def traceback(process: str, frames: list[tuple[str, str]], error: str) -> list[str]:
    """A traceback as vLLM 0.32 logs it from one of its engine's processes: each line with the process's prefix."""
    lines = ["Traceback (most recent call last):"]
    for path, function in frames:
        lines += [f'  File "/venv/lib/python3.11/site-packages/vllm/{path}", line 1, in {function}', "    call()"]
    return [f"({process}) ERROR 12-05 07:46:22 [core.py:1510] {line}" for line in lines + [error]]


@pytest.mark.parametrize("error", [CUDA_OOM, CUBLAS])
def test_an_out_of_memory_in_the_profiling_run_is_told_from_one_in_a_forward_pass(error):
    """The same error is "profiling" in vLLM's profiling run (before gpu_memory_utilization applies) and
    "pressure" in a forward pass; cuBLAS's allocation failure is a memory failure as CUDA's is."""
    log = traceback("EngineCore_DP0 pid=7", PROFILE, error) + [
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]
    assert classify(root_cause("\n".join(log))) == "profiling"
    assert classify(root_cause("\n".join(traceback("EngineCore_DP0 pid=7", FORWARD, error)))) == "pressure"
    assert classify(error) == "pressure"


def test_a_worker_of_tensor_parallel_ranks_that_runs_out_in_profiling_is_read_as_profiling():
    """With several ranks the worker prints the traceback and the EngineCore repeats the error in its own,
    which runs through the executor's determine_available_memory."""
    worker = traceback("Worker_TP0 pid=11", [("v1/executor/multiproc_executor.py", "worker_busy_loop"),
                                             ("v1/worker/gpu_worker.py", "determine_available_memory"),
                                             ("v1/worker/gpu/model_runner.py", "profile_run")], CUBLAS)
    core = traceback("EngineCore_DP0 pid=7", PROFILE[:3] + [("v1/executor/multiproc_executor.py", "collective_rpc")],
                     f"RuntimeError: Worker failed with error '{CUBLAS.split(': ', 1)[1]}', please check the stack "
                     "trace above for the root cause")
    assert classify(root_cause("\n".join(worker + core))) == "profiling"


@pytest.mark.parametrize("text, kind", [(UNSTEADY, "unsteady"), (SAMPLER, "sampler"), (CUBLAS, "pressure")])
def test_vllms_own_memory_texts_are_memory_failures(text, kind):
    assert classify(text) == kind
    assert classify(f"{text} (engine log) <- RuntimeError: Engine core initialization failed.") == kind


def cfg(**kwargs):
    return EvalConfig(**{"model_name": "m", "vllm_path": "/x", **kwargs})


def tries(start: EvalConfig, *failures: Outcome) -> list[dict]:
    queue = list(failures)
    return run_with_retries(start, lambda settings, history: queue.pop(0) if queue else Outcome("ok", run_dir="/r"))[1]


def profiling(tokens: int | None = 16384) -> Outcome:
    return Outcome(status="memory", message=CUDA_OOM, memory_kind="profiling", batched_tokens=tokens)


def test_a_profiling_run_out_of_memory_lowers_max_num_batched_tokens_never_the_utilization():
    """From what vLLM resolved (16384 on an H100): 8192, 4096, 2048, then fewer sequences and eager mode;
    gpu_memory_utilization, which the profiling run does not obey, stays."""
    policy = OomRetry(max_num_seqs=[64], eager=True, max_attempts=20)
    attempts = tries(cfg(oom_retry=policy), *[profiling()] * 5)
    assert [a["settings"] for a in attempts] == [
        {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False},
        {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False, "max_num_batched_tokens": 8192},
        {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False, "max_num_batched_tokens": 4096},
        {"gpu_memory_utilization": 0.9, "batch_size": None, "enforce_eager": False, "max_num_batched_tokens": 2048},
        {"gpu_memory_utilization": 0.9, "batch_size": 64, "enforce_eager": False, "max_num_batched_tokens": 2048},
        {"gpu_memory_utilization": 0.9, "batch_size": 64, "enforce_eager": True, "max_num_batched_tokens": 2048},
    ]


def test_the_token_steps_start_below_what_vllm_resolved_or_was_given_and_stay_above_the_sequences():
    policy = OomRetry()
    below_default = next_settings(cfg(), "profiling", policy, batched_tokens=4096)  # a CPU's or a server's default
    assert below_default.engine_kwargs["max_num_batched_tokens"] == 2048
    given = cfg(engine_kwargs={"max_num_batched_tokens": 8192})
    tokens = lambda settings: settings.engine_kwargs["max_num_batched_tokens"]
    assert tokens(next_settings(given, "profiling", policy, batched_tokens=16384)) == 4096
    wide = cfg(batch_size=4096)  # vLLM refuses max_num_batched_tokens < max_num_seqs: the sequences step first
    assert tokens(next_settings(wide, "profiling", policy, batched_tokens=16384)) == 8192
    assert next_settings(wide, "profiling", policy, batched_tokens=4096).batch_size == 64
    assert resolved_tokens("(EngineCore pid=7) INFO 12-05 07:46:20 [scheduler.py:308] Chunked prefill is enabled "
                           "with max_num_batched_tokens=16384.\n") == 16384


def test_the_sampler_warm_up_steps_the_sequences_and_an_unsteady_profiling_run_is_tried_again_once():
    policy = OomRetry(max_num_seqs=[64, 16], eager=False)
    sampler = Outcome(status="memory", message=SAMPLER, memory_kind="sampler")
    assert [a["settings"]["batch_size"] for a in tries(cfg(oom_retry=policy), sampler)] == [None, 64]
    unsteady = Outcome(status="memory", message=UNSTEADY, memory_kind="unsteady")
    attempts = tries(cfg(oom_retry=policy), unsteady, unsteady, unsteady)
    assert len(attempts) == 2 and attempts[0]["settings"] == attempts[1]["settings"]  # the same again, once
    assert attempts[-1]["status"] == "memory"
    once = tries(cfg(oom_retry=policy), unsteady)
    assert [a["status"] for a in once] == ["memory", "ok"]
