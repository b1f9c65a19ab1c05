"""engine=served through the OpenAI API alone (evalkit/engine/served/openai.py, served/probe.py), without a
server: echo and generation reads on responses built with vLLM's own protocol classes, the fields sent, the
server defaults recorded, and log-likelihood tasks refused where the server cannot score. The real server,
made to ignore vLLM's fields by a proxy: tests/engine/served/test_served.py.
Run: pytest tests/engine/served/test_served_openai.py
"""

import json

import pytest

from evalkit.config import ConfigError
from evalkit.contracts import GenRequest, ScoreRequest
from evalkit.engine.served import openai
from evalkit.engine.served.body import ServedReadError
from evalkit.engine.served.probe import server_defaults
from tests.engine.served.test_served_units import usage_info

TEXTS = {1: "<s>", 7: " Paris", 8: ".", 9: " Rome", 5: "!"}


def texts(token):
    return (TEXTS[token],)


def echo_response(ids, values, tops, *, as_ids=True, generated=(5, -0.2), prompt_tokens=None, completion=1):
    """An echo answer as vLLM 0.32's server writes it (serving.py: prompt entries, then the generated one;
    the first prompt entry None), through its protocol classes and JSON."""
    from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionResponse,
                                                             CompletionResponseChoice)

    UsageInfo = usage_info()  # noqa: N806 (vLLM's class)

    def name(token):
        return f"token_id:{token}" if as_ids else TEXTS[token]

    all_ids = [*ids, generated[0]] if generated else list(ids)
    first = [None] if ids else []
    logprobs = CompletionLogProbs(
        tokens=[name(t) for t in all_ids],
        token_logprobs=[*first, *values, *([generated[1]] if generated else [])],
        top_logprobs=[*first, *({name(t): v for t, v in top.items()} for top in tops),
                      *([{name(generated[0]): generated[1]}] if generated else [])])
    choice = CompletionResponseChoice(index=0, text="x", finish_reason="length", logprobs=logprobs)
    usage = UsageInfo(prompt_tokens=len(ids) if prompt_tokens is None else prompt_tokens,
                      completion_tokens=completion)
    return json.loads(CompletionResponse(model="m", choices=[choice], usage=usage).model_dump_json())


def test_echo_reads_each_prompt_token_by_id_or_by_the_local_tokenizers_text():
    request = ScoreRequest(ids=(1, 7, 8), start=1)
    tops = [{7: -0.5}, {9: -2.0, 8: -2.0}]  # a tie with the best: greedy, as offline
    for as_ids in (True, False):
        scored = openai.read_echo(request, echo_response(request.ids, [-0.5, -2.0], tops, as_ids=as_ids), texts)
        assert scored.logprob == pytest.approx(-2.5) and scored.is_greedy
    lower = openai.read_echo(request, echo_response(request.ids, [-0.5, -3.0], [{7: -0.5}, {9: -1.0, 8: -3.0}]), texts)
    assert not lower.is_greedy
    assert openai.read_echo(ScoreRequest(ids=(1, 7, 8), start=2),
                            echo_response(request.ids, [-0.5, -2.0], tops), texts).logprob == pytest.approx(-2.0)
    trace = openai.read_echo_trace(request, echo_response(request.ids, [-0.5, -3.0], [{7: -0.5}, {9: -1.0, 8: -3.0}]),
                                   texts, 2)
    assert trace.logprobs == (-0.5, -3.0) and trace.top[1] == ((9, -1.0), (8, -3.0))
    with pytest.raises(ServedReadError, match="not keyed by token id"):
        openai.read_echo_trace(request, echo_response(request.ids, [-0.5, -2.0], tops, as_ids=False), texts, 2)


def test_an_echo_that_does_not_cover_the_prompt_or_names_other_tokens_fails():
    request = ScoreRequest(ids=(1, 7, 8), start=1)
    covers_generated_only = echo_response((), [], [], generated=(5, -0.2))  # llama.cpp's echo (#27174)
    with pytest.raises(ServedReadError, match="1 tokens and 1 log-probabilities for a 3-token prompt"):
        openai.read_echo(request, covers_generated_only, texts)
    with pytest.raises(ServedReadError, match="at position 2, where token 8 was sent"):
        openai.read_echo(request, echo_response((1, 7, 9), [-0.5, -2.0], [{7: -0.5}, {9: -2.0}]), texts)
    with pytest.raises(ServedReadError, match="at position 1, where token 7 was sent"):
        openai.read_echo(request, echo_response((1, 9, 8), [-0.5, -2.0], [{9: -0.5}, {8: -2.0}], as_ids=False), texts)
    with pytest.raises(ServedReadError, match="not a finite value"):
        openai.read_echo(request, echo_response(request.ids, [-0.5, 0.5], [{7: -0.5}, {8: 0.5}]), texts)


def test_generation_reads_count_the_prompt_and_take_output_ids_where_the_server_names_them():
    request = GenRequest(prompt_ids=(1, 7, 8), max_tokens=1, sampling=(("temperature", 0.0),))
    answer = echo_response((), [], [], generated=(5, -0.2), prompt_tokens=3)  # echo=false: generated entries only
    assert openai.read_generation(request, answer).token_ids == (5,)
    as_text = echo_response((), [], [], generated=(5, -0.2), prompt_tokens=3, as_ids=False)
    assert openai.read_generation(request, as_text).token_ids == () and openai.read_generation(request, as_text).output_tokens == 1
    with pytest.raises(ServedReadError, match="counted a 4-token prompt, not the 3 token ids sent"):
        openai.read_generation(request, echo_response((), [], [], prompt_tokens=4))
    with pytest.raises(ServedReadError, match="1 output token ids for 2 output tokens counted"):
        openai.read_generation(GenRequest(prompt_ids=(1, 7, 8), max_tokens=2),
                               echo_response((), [], [], prompt_tokens=3, completion=2))


def test_only_openais_sampling_fields_are_sent_and_a_setting_it_has_no_field_for_is_refused():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = GenRequest(prompt_ids=(1, 2), max_tokens=5, stop=("\n",), sampling=(("temperature", 0.6), ("top_p", 0.9)))
    sent = openai.generate_body(request, "m")
    assert set(sent) == {"model", "prompt", "max_tokens", "echo", "stream", "logprobs", "return_tokens_as_token_ids",
                         "stop", *openai.OPENAI_SAMPLING}
    served = CompletionRequest(**sent).to_sampling_params(5, {"temperature": 0.1, "top_p": 0.2})
    assert (served.temperature, served.top_p, served.stop) == (0.6, 0.9, ["\n"])  # no server default leaked in
    echo = CompletionRequest(**openai.echo_body((1, 2), "m")).to_sampling_params(1, {"temperature": 0.7})
    assert echo.prompt_logprobs == 1 and echo.temperature == 0.0
    for setting in (("top_k", 40), ("repetition_penalty", 1.1), ("min_p", 0.05)):
        with pytest.raises(ServedReadError, match=f"sampling {setting[0]}={setting[1]} has no OpenAI field"):
            openai.generate_body(GenRequest(prompt_ids=(1,), max_tokens=1, sampling=(setting,)), "m")
    for fine in (("top_k", 0), ("skip_special_tokens", False)):  # neutral, or how the server writes its text
        assert fine[0] not in openai.generate_body(GenRequest(prompt_ids=(1,), max_tokens=1, sampling=(fine,)), "m")


def test_the_defaults_a_vllm_server_would_fill_in_are_recorded(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "bos_token_id": 1}))
    through_vllm = server_defaults(str(tmp_path), "vllm")
    assert through_vllm["fields"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert through_vllm["applied"].startswith("none")
    assert server_defaults(str(tmp_path), "openai")["applied"].startswith("repetition_penalty, top_k if the server")
    assert server_defaults(str(tmp_path / "none"), "vllm") == {"source": None, "fields": {},
                                                               "applied": "none: every sampling field is sent explicitly"}


def test_log_likelihood_tasks_are_refused_where_the_server_cannot_score():
    from evalkit.harness.tasks import load_tasks, scoring_tasks
    from evalkit.run.evaluate import refuse_unanswerable

    _, tasks = load_tasks(["evalkit_arith", "evalkit_facts"], task_data={}, extra_dirs=[])
    assert scoring_tasks(tasks) == ["evalkit_facts"]
    cannot = {"cannot_score": "the server's echo failed evalkit's probe (...)"}
    with pytest.raises(ConfigError, match=r"^evalkit_facts need log-likelihoods, and the server's echo failed"):
        refuse_unanswerable(cannot, tasks)
    refuse_unanswerable(cannot, [t for t in tasks if t.config.task == "evalkit_arith"])  # generation only
    refuse_unanswerable({"cannot_score": None}, tasks)
