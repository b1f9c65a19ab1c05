"""engine=served's bundles of next-token reads (evalkit/engine/served/batch.py): reads of several contexts in one
/v1/completions request asking their logprob_token_ids together, each member's answer read for its own ids alone,
and a member whose read fails sent again alone. No vLLM server: bodies go through vLLM's own request classes,
responses are built with its protocol classes, and the retry runs against an HTTP server in a thread. The real
server: tests/engine/served/test_served_client.py (chains bundled, scores equal to whole reads).
Run: pytest tests/engine/served/test_served_bundles.py
"""

import json
from collections import Counter

import pytest

from evalkit.contracts import ScoreRequest
from evalkit.engine.served import body
from evalkit.engine.served.batch import MAX_LOGPROB_TOKEN_IDS, Sender, bundles, joined, split
from evalkit.engine.served.http import Client
from tests.engine.served.local_http import QuietHandler, answer_json, running
from tests.engine.served.test_served_units import usage_info


def test_next_token_reads_of_several_contexts_go_in_one_request_asking_their_ids_together(embedded_model_dir):
    """Bodies equal but for prompt and logprob_token_ids are bundled (at most size, at most 128 ids among them);
    the bundle asks the sorted union, and vLLM 0.32's own CompletionRequest turns it into the SamplingParams every
    prompt of the request gets (serving.py builds each prompt's from the one request), valid for the model."""
    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    reads = [body.next_token_body((1, 2, k), ids, "m", "salt") for k, ids in
             enumerate([[9, 5], [5, 7], list(range(100, 170)), list(range(200, 270)), [3]])]
    whole = body.prompt_logprobs_body((1, 2, 3), "m", "other")
    assert bundles([*reads, whole], 16) == [[0, 1, 2], [3, 4], [5]]  # 73 ids, then 70 more would pass 128
    assert bundles(reads, 2) == [[0, 1], [2], [3, 4]]  # at most 2 a request; 2 and 3 ask 140 ids
    together = joined(reads, [0, 1, 2])
    assert together["prompt"] == [[1, 2, 0], [1, 2, 1], [1, 2, 2]] and together["cache_salt"] == "salt"
    assert together["logprob_token_ids"] == [5, 7, 9, *range(100, 170)]
    assert {k: v for k, v in together.items() if k not in ("prompt", "logprob_token_ids")} == \
        {k: v for k, v in reads[0].items() if k not in ("prompt", "logprob_token_ids")}
    params = CompletionRequest(**together).to_sampling_params(1)
    assert params.logprob_token_ids == together["logprob_token_ids"]
    params.verify(ModelConfig(model=embedded_model_dir, max_model_len=4096), None, None, None)
    assert len(joined(reads, [3, 4])["logprob_token_ids"]) == 71 <= MAX_LOGPROB_TOKEN_IDS


def bundle_response(prompts, tops):
    """A /v1/completions response to a request of several prompts as vLLM 0.32's server writes it (choices
    numbered by prompt), each choice's one step of log-probabilities keyed token_id:N, through JSON."""
    from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionResponse,
                                                             CompletionResponseChoice)

    UsageInfo = usage_info()  # noqa: N806 (vLLM's class)

    choices = [CompletionResponseChoice(index=n, text="", finish_reason="length", token_ids=[next(iter(top))],
                                        prompt_token_ids=list(prompt),
                                        logprobs=CompletionLogProbs(top_logprobs=[{f"token_id:{t}": v
                                                                                   for t, v in top.items()}],
                                                                    token_logprobs=[0.0], tokens=["t"]))
               for n, (prompt, top) in enumerate(zip(prompts, tops))]
    response = CompletionResponse(model="m", choices=choices, usage=UsageInfo(prompt_tokens=1))
    return json.loads(response.model_dump_json())


def test_each_member_of_a_bundle_reads_its_own_ids_and_the_greedy_token_alone():
    """The union's other ids in a member's choice are left out of its read; a member whose own id is missing
    fails its own read only; a member's choice must answer its own prompt."""
    union = {5: -0.2, 7: -3.0, 9: -1.5}  # 5 is sampled (greedy); 7 asked by the first member, 9 by the second
    response = bundle_response([(1, 2), (1, 3)], [union, {5: -0.1, 7: -2.0}])
    first, second = split(response, [0, 1])
    assert body.read_next_token((1, 2), (7,), first) == {5: -0.2, 7: -3.0}
    assert body.read_next_token((1, 2), (9, 5), first) == {5: -0.2, 9: -1.5}
    with pytest.raises(body.ServedReadError, match=r"lack the asked ids \[9\]"):
        body.read_next_token((1, 3), (9,), second)
    with pytest.raises(body.ServedReadError, match="saw a 2-token prompt"):
        body.read_next_token((1, 2, 4), (7,), second)


class Completions(QuietHandler):
    """/completions as vLLM answers next-token reads, every asked id at -2.0 and token 5 sampled at -0.1; a
    prompt ending in 66 gets its asked ids left out while it comes in a bundle."""

    bodies: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(sent)
        prompts = sent["prompt"] if isinstance(sent["prompt"][0], list) else [sent["prompt"]]
        tops = [{5: -0.1, **({} if len(prompts) > 1 and p[-1] == 66 else dict.fromkeys(sent["logprob_token_ids"],
                                                                                        -2.0))} for p in prompts]
        answer_json(self, 200, json.dumps({**bundle_response(prompts, tops), "system_fingerprint": "f"}).encode())



def test_a_member_whose_read_fails_is_sent_again_alone_and_the_others_are_kept():
    with running(Completions) as url:
        client = Client(url, api_key=None, max_concurrency=8, timeout=5, retries=0, backoff=0.01)
        counts: Counter = Counter()
        api = body.VLLMApi(Sender(client, fingerprint="f", counts=counts, bundle=16), model="m", cache_salt="s",
                           counts=counts, asks_ids=True)
        requests = [ScoreRequest(ids=(1, 2, last, token), start=3) for last, token in
                    ((33, 7), (33, 8), (44, 8), (44, 9), (66, 7))]
        scored = api.score(requests, None, fast=True)
    assert [(s.logprob, s.is_greedy) for s in scored] == [(-2.0, False)] * 5
    assert (counts["context_requests"], counts["http_requests"], counts["mismatched"]) == (3, 2, 1)
    first, again = Completions.bodies
    assert len(first["prompt"]) == 3 and first["logprob_token_ids"] == [7, 8, 9]
    assert again["prompt"] == [1, 2, 66] and again["logprob_token_ids"] == [7]  # its own ids alone


def test_a_request_never_carries_more_prompts_than_the_cap_as_it_is_when_sent():
    """The cap read at each send, not when the sender was built: lowering endpoint.max_concurrency on a started
    engine (benchmarks/served.py's table by max_concurrency) makes its requests smaller too."""
    with running(Completions) as url:
        client = Client(url, api_key=None, max_concurrency=256, timeout=5, retries=0, backoff=0.01)
        sender = Sender(client, fingerprint="f", counts=Counter(), bundle=16)
        api = body.VLLMApi(sender, model="m", cache_salt="s", counts=Counter(), asks_ids=True)
        requests = [ScoreRequest(ids=(1, 2, 10 + i, 7), start=3) for i in range(6)]
        Completions.bodies.clear()
        api.score(requests, None, fast=True)
        client.max_concurrency = 2
        api.score(requests, None, fast=True)
    assert [len(b["prompt"]) for b in Completions.bodies] == [6, 2, 2, 2]
