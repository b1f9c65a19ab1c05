"""engine=served, the divergence record's traces read in the same requests as the answers
(evalkit/engine/served/traced_requests.py), without a server: each generated step's top list written by vLLM 0.32's own
code (its output processor's ``append_logprobs_for_next_position`` and its completion server's
``_create_completion_logprobs``), read back and checked token by token; a score and its trace from one response.
The real server: tests/engine/served/test_served.py. Run: pytest tests/engine/served/test_served_traced_requests.py
"""

import json

import pytest

from evalkit.contracts import GenRequest, ScoreRequest, TokenTrace
from evalkit.engine.served import traced_requests
from evalkit.engine.served.body import ServedReadError, read_prompt_logprobs
from tests.engine.served.test_served_units import vllm_response

GREEDY = GenRequest(prompt_ids=(1, 2), max_tokens=3, sampling=(("temperature", 0.0),))
K = 3
# three generated steps: (output token, its rank, the top-3 best first): the token first in its row, second in
# it (a greedy request with a penalty), and outside the top-3 (k + 1 entries)
STEPS = [(5, 1, [(5, -0.1), (6, -2.5), (7, -3.0)]),
         (9, 2, [(8, -0.4), (9, -1.2), (4, -2.0)]),
         (3, 7, [(8, -0.3), (6, -1.5), (4, -2.2)])]
OWN = {5: -0.1, 9: -1.2, 3: -4.5}


def generated(steps=STEPS, own=OWN, token_ids=None, top_k=K):
    """A /v1/completions response to GREEDY asked with logprobs=top_k and return_tokens_as_token_ids, as vLLM
    0.32 writes it, through JSON."""
    from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs

    rows = create_sample_logprobs(flat_logprobs=False)  # what the engine hands the server: a dict per step
    for token, rank, top in steps:
        append_logprobs_for_next_position(rows, [token, *(t for t, _ in top)], [own[token], *(v for _, v in top)],
                                          [None] * (len(top) + 1), rank, len(top))
    ids = [token for token, _, _ in steps] if token_ids is None else token_ids
    server = object.__new__(OpenAIServingCompletion)  # its writer reads no state when asked for token ids
    written = server._create_completion_logprobs(token_ids=ids, top_logprobs=rows, num_output_top_logprobs=top_k,
                                                 tokenizer=None, return_as_token_id=True)
    finish = "length" if len(ids) == GREEDY.max_tokens else "stop"
    response = vllm_response(GREEDY.prompt_ids, token_ids=ids, finish=finish)
    response["choices"][0]["logprobs"] = json.loads(CompletionLogProbs.model_validate(written).model_dump_json())
    return response


def test_a_greedy_generation_reads_the_top_list_of_each_of_its_output_tokens():
    generation = traced_requests.read_traced_generation(GREEDY, generated(), K)
    assert generation.token_ids == (5, 9, 3) and generation.output_tokens == 3
    assert generation.trace == TokenTrace(logprobs=(-0.1, -1.2, -4.5), top=tuple(tuple(top) for _, _, top in STEPS))
    assert traced_requests.read_traced_generation(GREEDY, generated(), 0).trace is None  # not asked: not read
    sampled = GenRequest(prompt_ids=(1, 2), max_tokens=3, sampling=(("temperature", 0.8),))
    assert traced_requests.read_traced_generation(sampled, generated(), K).trace is None


def test_only_a_greedy_request_asks_for_its_steps_and_vllm_accepts_the_body():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    body = traced_requests.traced_generate_body(GREEDY, "m", K)
    assert (body["logprobs"], body["return_tokens_as_token_ids"]) == (K, True)
    assert CompletionRequest(**body).to_sampling_params(3, {}).logprobs == K
    sampled = GenRequest(prompt_ids=(1, 2), max_tokens=3, sampling=(("temperature", 0.8),))
    assert "logprobs" not in traced_requests.traced_generate_body(sampled, "m", K)
    assert "logprobs" not in traced_requests.traced_generate_body(GREEDY, "m", 0)


def spoiled(edit):
    response = generated()
    edit(response["choices"][0]["logprobs"])
    return response


@pytest.mark.parametrize("response, message", [
    (spoiled(lambda lp: lp["top_logprobs"].pop()), "2 generated steps of log-probabilities"),
    (spoiled(lambda lp: [lp[k].pop() for k in ("tokens", "token_logprobs", "top_logprobs")]),
     r"2 generated steps of log-probabilities \(2 tokens, 2 values\) for 3 output tokens"),
    (spoiled(lambda lp: lp["tokens"].__setitem__(1, "token_id:8")), "step 1 names 'token_id:8', the output has "
                                                                    "token 9"),
    (spoiled(lambda lp: lp.__setitem__("top_logprobs", [{" a": -0.1}] * 3)), "keyed ' a', not token_id:N"),
    (spoiled(lambda lp: lp["token_logprobs"].__setitem__(0, -0.7)), "output token 5 \\(-0.7\\) is listed as -0.1"),
    (spoiled(lambda lp: lp["top_logprobs"][1].pop("token_id:9")), "output token 9 \\(-1.2\\) is listed as None"),
    (spoiled(lambda lp: lp["top_logprobs"][0].update({"token_id:40": -5.0, "token_id:41": -6.0})),
     "step 0: 5 top entries"),
    (generated(steps=[(5, 1, [(5, -0.1), (7, -3.0), (6, -2.5)])], own=OWN, token_ids=[5]), "not best first"),
    (generated(steps=[(3, 7, [(8, -0.3), (6, -1.5), (4, -2.2)])], own={3: -1.0}, token_ids=[3]),
     "above its last top entry"),
    (spoiled(lambda lp: lp["token_logprobs"].__setitem__(2, float("nan"))), "not a finite value"),
])
def test_a_step_that_does_not_answer_its_output_token_fails_the_read(response, message):
    with pytest.raises(ServedReadError, match=message) as error:
        traced_requests.read_traced_generation(GREEDY, response, K)
    assert "\n" not in str(error.value)


def test_a_score_and_its_trace_come_from_one_response():
    request = ScoreRequest(ids=(1, 7, 8), start=1)
    rows = [{7: (-0.5, 1), 6: (-1.5, 2)}, {8: (-2.0, 2), 9: (-1.0, 1), 4: (-3.0, 3)}]
    scored = traced_requests.read_traced_score(request, vllm_response(request.ids, rows), 2)
    assert (scored.logprob, scored.is_greedy) == (-2.5, False)
    assert scored.trace == TokenTrace(logprobs=(-0.5, -2.0), top=(((7, -0.5), (6, -1.5)), ((9, -1.0), (8, -2.0))))
    assert sum(scored.trace.logprobs) == scored.logprob == read_prompt_logprobs(request, vllm_response(request.ids,
                                                                                                      rows)).logprob
