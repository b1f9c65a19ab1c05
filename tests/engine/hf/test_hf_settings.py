"""The HF reference engine's pure parts (evalkit/engine/hf/settings.py, generation.py, forward.py), without a
model: vLLM sampling settings mapped onto HF generation or refused in one line, vLLM-only engine settings
refused before the model loads, stop strings and tokens, score batches.
Run: pytest tests/engine/hf/test_hf_settings.py
"""

import pytest

from evalkit.config import ConfigError, compose_config
from evalkit.contracts import GenRequest, ScoreRequest
from evalkit.engine.factory import start_engines
from evalkit.engine.hf.forward import score_batches
from evalkit.engine.hf.generation import Row
from evalkit.engine.hf.settings import check_settings, sampling_for_hf

OUTPUT = (("skip_special_tokens", False), ("spaces_between_special_tokens", False))  # as evalkit's harness sends
GREEDY = (*OUTPUT, ("temperature", 0.0))


def test_greedy_and_sampled_settings_map_onto_hf_generation():
    greedy = sampling_for_hf(dict(GREEDY))
    assert dict(greedy.options) == {"do_sample": False, "repetition_penalty": 1.0}
    assert not greedy.skip_special_tokens and not greedy.spaces_between_special_tokens and greedy.seed is None
    sampled = sampling_for_hf({"temperature": 0.8, "top_p": 0.95, "top_k": -1, "seed": 7})
    assert dict(sampled.options) == {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 0,
                                     "min_p": 0.0, "repetition_penalty": 1.0}
    assert sampled.seed == 7 and sampled.skip_special_tokens  # vLLM's default where the request says nothing
    assert dict(sampling_for_hf({}).options)["do_sample"]  # vLLM's default temperature is 1.0
    assert sampling_for_hf({"stop_token_ids": [5, 6], "n": 1, "presence_penalty": 0.0}).stop_token_ids == (5, 6)


@pytest.mark.parametrize("settings, named", [({"presence_penalty": 0.5}, "presence_penalty=0.5"),
                                             ({"ignore_eos": True}, "ignore_eos=True"),
                                             ({"best_of_everything": 3}, "best_of_everything=3"),
                                             ({"temperature": -1.0}, "temperature=-1.0")])
def test_what_hf_generation_cannot_honour_is_refused_in_one_line(settings, named):
    with pytest.raises(ConfigError) as error:
        sampling_for_hf(settings)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_vllm_only_engine_settings_are_refused_before_the_model_loads():
    check_settings(engine_kwargs={"device_map": "auto", "enforce_eager": True}, sampling_kwargs={},
                   tensor_parallel_size=1, pipeline_parallel_size=1)
    for kwargs, named in (({"engine_kwargs": {"max_num_batched_tokens": 8}}, "engine_kwargs.max_num_batched_tokens"),
                          ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
                          ({"sampling_kwargs": {"frequency_penalty": 1.0}}, "frequency_penalty=1.0")):
        given = {"engine_kwargs": {}, "sampling_kwargs": {}, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            check_settings(**{**given, **kwargs})
    cfg = compose_config(["engine=hf", "pipeline_parallel_size=2"])
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
        start_engines(cfg, "/nonexistent")  # refused before anything is loaded


def generated(stop, tokens, max_tokens=10, stop_ids=(0,)):
    """A Row fed one character per token (token id = code point; 0 is the stop token)."""
    row = Row(GenRequest(prompt_ids=(1,), max_tokens=max_tokens, stop=tuple(stop)), lambda t: chr(t), set(stop_ids),
              limit=max_tokens)
    for token in map(ord, tokens) if isinstance(tokens, str) else tokens:
        row.add(token)
    return row.generation()


def test_a_stop_string_cuts_the_text_and_keeps_the_ids_up_to_the_token_that_completed_it():
    g = generated(["\n\n"], " 42\n\nQuestion")
    assert (g.text, g.finish_reason, g.token_ids) == (" 42", "stop", tuple(map(ord, " 42\n\n")))
    g = generated(["cd", "bcde"], "abcdef")  # the stop that completes first, not the first listed
    assert (g.text, g.token_ids) == ("ab", tuple(map(ord, "abcd")))
    g = generated(["xy"], "abxy")
    assert g.text == "ab" and g.output_tokens == 4


def test_a_stop_token_ends_without_its_text_and_max_tokens_ends_with_length():
    g = generated([], [ord("a"), ord("b"), 0, ord("c")])
    assert (g.text, g.finish_reason, g.token_ids) == ("ab", "stop", (97, 98, 0))
    g = generated(["z"], "abcdefgh", max_tokens=3)
    assert (g.text, g.finish_reason, g.output_tokens) == ("abc", "length", 3)
    g = generated(["c"], "abc", max_tokens=3)  # a stop on the last allowed token is a stop
    assert (g.text, g.finish_reason) == ("ab", "stop")


def test_score_batches_hold_each_request_once_longest_first_within_the_limits():
    requests = [ScoreRequest(ids=tuple(range(n)), start=n - 2) for n in (3, 9, 5, 9, 7)]
    batches = score_batches(requests, batch_size=2, logit_rows=1000)
    assert sorted(i for b in batches for i in b) == list(range(5)) and all(len(b) <= 2 for b in batches)
    assert [len(requests[b[0]].ids) for b in batches] == [9, 7, 3]
    rolling = [ScoreRequest(ids=tuple(range(100)), start=0)] * 3  # 99 positions each
    assert score_batches(rolling, batch_size=16, logit_rows=200) == [[0, 1], [2]]
    assert score_batches(rolling, batch_size=16, logit_rows=10) == [[0], [1], [2]]  # never less than one


