"""engine=served on the choices the offline engine answers without a read or in split reads, against the
session's real vLLM server (tests/conftest.py ``served``; this file sorts before tests/engine/served/test_served_deployments.py,
whose last test closes it).
Run: pytest -m engine tests/engine/served/test_served_choices.py
"""

import pytest

from evalkit.contracts import ScoreRequest
from evalkit.harness.lm import EvalkitLM

pytestmark = pytest.mark.engine


def test_an_empty_continuation_is_answered_without_asking_the_server(served):
    """start == len(ids): (0.0, True), lm-eval's sum over no tokens, fast scoring on or off, never sent; the
    requests beside it are scored as usual and keep their places."""
    from types import SimpleNamespace

    context = "Question: What is the capital of France?\nAnswer:"
    before = served.scoring_counts().get("unscored", 0)
    lm = EvalkitLM(served, model_name="m", max_tokens=6)
    for fast in (True, False):
        lm.fast_scoring = fast
        assert lm.loglikelihood([SimpleNamespace(task_name="t", doc_id=0, args=(context, ""))]) == [(0.0, True)]
    ids = tuple(served.encode(context, True))
    first, second, third = served.score([ScoreRequest(ids=ids, start=len(ids) - 2), ScoreRequest(ids=ids, start=len(ids)),
                                         ScoreRequest(ids=ids, start=len(ids) - 1)])
    assert (second.logprob, second.is_greedy) == (0.0, True) and first.logprob < third.logprob < 0
    assert served.scoring_counts()["unscored"] - before == 3


def test_more_than_128_two_token_choices_score_as_the_plain_path(served):
    """200 two-token choices behind one question: their last tokens are asked in two requests (vLLM takes 128
    logprob_token_ids a request) and score as prompt log-probabilities of each choice do."""
    context = tuple(served.encode("Question: pick a word.\nAnswer:", True))
    (is_,) = served.encode(" is", False)
    requests = [ScoreRequest(ids=context + (is_, token), start=len(context)) for token in range(1000, 1200)]
    before = served.scoring_counts().get("context_requests", 0)
    fast = served.score(requests, fast=True)
    assert served.scoring_counts()["context_requests"] - before == 3  # the question once, its " is" twice
    plain = served.score(requests, fast=False)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(fast, plain)) <= 1e-4
    assert [s.is_greedy for s in fast] == [s.is_greedy for s in plain]
