"""vllm.LLM started for evalkit (evalkit/engine/vllm/launch.py): its arguments, the tokenizer lm-eval's vllm backend
would use, and what the session's engine recorded of its start.

The last test is marked `engine` and uses the session's engine (conftest.py).
Run: pytest tests/engine/vllm/test_launch.py (and -m engine for the last)
"""

import os

import pytest

from evalkit.engine.read_plan import PathRead
from evalkit.engine.vllm.launch import engine_args, lm_eval_tokenizer, scheduling, token_id_scores
from evalkit.engine.vllm.path_reads import path_params

SETTINGS = dict(model="/m", tokenizer=None, dtype="float32", max_model_len=64, gpu_memory_utilization=0.5,
                tensor_parallel_size=1, seed=3, trust_remote_code=False)


def test_the_arguments_are_evalkits_settings_with_engine_kwargs_over_them():
    args = engine_args(**SETTINGS, max_num_seqs=None, engine_kwargs={"dtype": "bfloat16", "enforce_eager": True})
    assert args["tokenizer"] == "/m" and "max_num_seqs" not in args  # vLLM's own default where none is given
    assert args["dtype"] == "bfloat16" and args["enforce_eager"] is True
    assert engine_args(**SETTINGS, max_num_seqs=4, engine_kwargs={})["max_num_seqs"] == 4


def test_add_bos_token_loads_a_tokenizer_of_its_own_and_times_it(embedded_model_dir):
    tokenizer, seconds = lm_eval_tokenizer(None, {"tokenizer": embedded_model_dir}, trust_remote_code=False,
                                           add_bos_token=True)
    assert seconds is not None and seconds >= 0
    assert tokenizer("a", add_special_tokens=True).input_ids[0] == tokenizer.bos_token_id


def test_a_v2_read_asks_for_what_the_installed_vllm_takes():
    """token_id_scores reads vLLM's own SamplingParams: the read the engine would send on V2 is one the installed
    vLLM builds (0.32: the prompt rows with the fixed-id scores of the continuation's tokens; 0.23, which has no
    such fields, the prompt rows alone). V1 never asks for them."""
    read = PathRead(prompt=(3, 17, 5, 22), start=2, asked=(9,))
    asked = token_id_scores("v2")
    params = path_params(read, token_id_scores=asked, read_cache=True)
    assert params.prompt_logprobs == 1 and params.logprob_token_ids == [9]
    if asked:
        assert params.prompt_logprob_start == 1 and params.prompt_logprob_token_ids == [[5], [22]]
    assert token_id_scores("v1") is False


@pytest.mark.engine
def test_the_session_engine_records_its_start_and_what_vllm_resolved(engine):
    assert set(engine.start_seconds) == {"import_vllm", "engine_init"}  # its own tokenizer: no step of its own
    assert (engine.runner, engine.logits_dtype) == ("v1", "float32")  # the CPU build, the default dtype
    assert engine.token_id_scores is False and engine.describe()["token_id_scores"] is False  # V1: the rows alone
    assert engine.block_size == engine.args["block_size"]  # as tuning chose it
    assert engine.environment["VLLM_CPU_OMP_THREADS_BIND"] == os.environ["VLLM_CPU_OMP_THREADS_BIND"]  # conftest's
    shapes = scheduling(engine.llm, engine.environment)
    assert shapes == engine.describe()["scheduling"] and shapes["batch_invariant"] is False
    assert scheduling(None, {}) is None
