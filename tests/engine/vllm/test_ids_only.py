"""evalkit/engine/vllm/ids_only.py on vLLM's own LogprobsProcessor (no engine): a request marked in extra_args gets
no tokenizer for its log-probabilities, so no string is made of its ids; an unmarked one keeps it; installing
twice wraps once. Runs on vLLM 0.32 and on 0.23 (tests/vllm023.txt).
Run: pytest tests/engine/vllm/test_ids_only.py
"""

from types import SimpleNamespace

import numpy as np
from vllm import SamplingParams
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.outputs import LogprobsLists

from evalkit.engine.vllm import ids_only


class Untouchable:
    """A tokenizer that fails the test if anything of it is asked."""

    def __getattr__(self, name):
        raise AssertionError(f"the tokenizer was asked for {name}")


def request(extra=None):
    return SimpleNamespace(sampling_params=SamplingParams(logprobs=2, flat_logprobs=True, extra_args=extra))


def test_a_marked_request_makes_no_string_of_its_ids_and_an_unmarked_one_keeps_its_tokenizer():
    assert ids_only.install() and ids_only.install()
    wrapped = LogprobsProcessor.__dict__["from_new_request"]
    assert ids_only.install() and LogprobsProcessor.__dict__["from_new_request"] is wrapped  # wrapped once
    marked = LogprobsProcessor.from_new_request(Untouchable(), request({ids_only.IDS_ONLY: True}))
    marked._update_sample_logprobs(LogprobsLists([np.array([7, 7, 3])], [np.array([-0.1, -0.1, -2.5])],
                                                 [np.array(1)], None))
    assert marked.logprobs.token_ids == [7, 7, 3] and set(marked.logprobs.decoded_tokens) == {None}
    assert LogprobsProcessor.from_new_request("tokenizer", request()).tokenizer == "tokenizer"
    assert LogprobsProcessor.from_new_request("tokenizer", request({"other": 1})).tokenizer == "tokenizer"
