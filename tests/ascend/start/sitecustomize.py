"""The start of a run on an Ascend machine, recreated on this CPU one, in every Python process started with this
folder on PYTHONPATH (tests/test_ascend.py runs ``python -m evalkit`` so: the supervisor and its try both get it).

Only where EVALKIT_TEST_ASCEND_RECORD is set: ``vllm.LLM`` is replaced by a recorder of its arguments and of the
environment it was called in, which then fails, so that the run ends there (exit 1) with the engine's start as
evalkit made it. The image's packages (vllm-ascend's platform plugin, torch-npu and its autoload, recording any
call that would start the NPU runtime) and npu-smi come from the test, as on the machine.
"""

from __future__ import annotations

import json
import os
import sys


def record(**fields) -> None:
    with open(os.environ["EVALKIT_TEST_ASCEND_RECORD"], "a", encoding="utf-8") as out:
        out.write(json.dumps({"pid": os.getpid(), **fields}, default=repr) + "\n")


class Recorder:
    """vllm.LLM: records how it was called, then fails."""

    def __init__(self, *args, **kwargs):
        record(kind="vllm.LLM", kwargs=kwargs, env={k: v for k, v in os.environ.items()
                                                     if k.startswith(("VLLM_", "PYTORCH_", "ASCEND_", "TORCH_"))})
        raise RuntimeError("vllm.LLM was reached (recorded by tests/ascend/start)")


def patch_vllm(vllm) -> None:
    vllm.LLM = Recorder


if os.environ.get("EVALKIT_TEST_ASCEND_RECORD"):
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "process_model"))
    from after_import import patch_after_import

    patch_after_import({"vllm": patch_vllm})
