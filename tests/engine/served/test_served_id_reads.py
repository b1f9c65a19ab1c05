"""engine=served's ids reads (evalkit/engine/served/id_reads.py) on responses built as vLLM 0.32's server writes
them (tests/engine/served/test_served_units.py's vllm_response), without a server: each answer checked for
exactly its asked ids; on a server without logprob_token_ids (vLLM 0.23), each id read from a prompt row of
its own, against a local HTTP server that answers as such a server does. The real server, and a server read
through the OpenAI API alone: tests/engine/served/test_served.py.
Run: pytest tests/engine/served/test_served_id_reads.py
"""

import json
import math

import pytest

from evalkit.contracts import ScoreRequest
from evalkit.engine.served.body import ServedReadError, next_token_body
from evalkit.engine.served.id_reads import read_asked
from tests.engine.served.local_http import QuietHandler, answer_json, running
from tests.engine.served.test_served_units import vllm_response


def test_an_answer_gives_exactly_its_asked_ids_in_the_order_asked():
    """The greedy token and another bundle member's ids are left out; -9999 (the server's -inf) reads -inf."""
    top = {"token_id:5": -0.1, "token_id:9": -4.0, "token_id:11": -9999.0, "token_id:12": -6.0}
    assert read_asked((1, 2), [11, 9], vllm_response((1, 2), top=top)) == {11: -math.inf, 9: -4.0}
    assert list(read_asked((1, 2), [11, 9], vllm_response((1, 2), top=top))) == [11, 9]


@pytest.mark.parametrize("top, asked, message", [
    ({"token_id:5": -0.1}, [9], r"lack the asked ids \[9\]"),
    ({"token_id:5": -0.1, "token_id:9": 0.5}, [9], "not a finite value <= 0"),
    ({"token_id:5": -0.1, "token_id:9": float("nan")}, [9], "not a finite value <= 0"),
    ({" a": -0.1, "token_id:9": -1.0}, [9], "ignored return_tokens_as_token_ids"),
])
def test_an_answer_without_an_asked_id_or_with_a_value_no_row_holds_is_refused(top, asked, message):
    with pytest.raises(ServedReadError, match=message):
        read_asked((1, 2), asked, vllm_response((1, 2), top=top))


def test_an_answer_for_another_prompt_is_refused():
    with pytest.raises(ServedReadError, match="saw a 3-token prompt"):
        read_asked((1, 2), [5], vllm_response((1, 2, 3), top={"token_id:5": -0.1}))


def test_the_body_asks_the_ids_keyed_by_token_id_greedy_and_under_the_salt():
    sent = next_token_body((1, 2), [11, 9], "m", "salt")
    assert (sent["logprob_token_ids"], sent["return_tokens_as_token_ids"]) == ([11, 9], True)
    assert sent["cache_salt"] == "salt"
    assert (sent["max_tokens"], sent["temperature"], sent["prompt"]) == (1, 0.0, [1, 2])


# --- a server without logprob_token_ids (vLLM 0.23's completions API has no such field and ignores it) ---

def test_an_id_read_from_its_own_prompt_row_is_checked_against_that_prompt_and_id():
    """The asked id as the last token of context + (id,): its row's value (-9999, the server's -inf, reads -inf);
    a row for another token, or an answer to another prompt, is refused."""
    from evalkit.engine.served.id_reads import read_row

    assert read_row((1, 2), 11, vllm_response((1, 2, 11), rows=[{2: (-1.0, 1)}, {11: (-4.5, 7)}])) == {11: -4.5}
    assert read_row((1, 2), 11, vllm_response((1, 2, 11), rows=[{2: (-1.0, 1)}, {11: (-9999.0, 40)}])) == \
        {11: -math.inf}
    with pytest.raises(ServedReadError, match="lacks the request's token 11"):
        read_row((1, 2), 11, vllm_response((1, 2, 11), rows=[{2: (-1.0, 1)}, {12: (-4.5, 7)}]))
    with pytest.raises(ServedReadError, match="saw a 2-token prompt"):
        read_row((1, 2), 11, vllm_response((1, 2), rows=[{2: (-1.0, 1)}]))


def test_the_probe_finds_whether_the_server_answers_given_ids():
    """Two distinct ids of the probe text asked after it: both back, honoured; the greedy token alone (what a
    server that ignores the field returns for logprobs: 1), not; a failed request refuses the server."""
    from evalkit.engine.served.http import Failure
    from evalkit.engine.served.probe import ServerRefused, asks_ids

    ids = (7, 3, 7, 9)
    both = {"token_id:5": -0.1, "token_id:3": -2.0, "token_id:7": -3.0}
    assert asks_ids(ids, vllm_response(ids, top=both)) is True
    assert asks_ids(ids, vllm_response(ids, top={"token_id:5": -0.1})) is False
    with pytest.raises(ServerRefused, match="failed evalkit's probe: boom"):
        asks_ids(ids, Failure("boom"))


class RowsOnly(QuietHandler):
    """/completions as vLLM 0.23 answers prompt log-probabilities: one row per prompt position after the first,
    token t at -t/100, ranked 1; logprob_token_ids ignored (its next-token step holds the greedy token 5 alone)."""

    bodies: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(sent)
        prompts = sent["prompt"] if isinstance(sent["prompt"][0], list) else [sent["prompt"]]
        choices = []
        for n, prompt in enumerate(prompts):
            rows = [{t: (-t / 100, 1)} for t in prompt[1:]] if sent.get("prompt_logprobs") is not None else None
            choice = vllm_response(prompt, rows=rows, top={"token_id:5": -0.1})["choices"][0]
            choices.append({**choice, "index": n})
        answer_json(self, 200, json.dumps({**vllm_response(prompts[0]), "choices": choices,
                                           "system_fingerprint": "f"}).encode())


def test_without_logprob_token_ids_ids_are_read_from_rows_and_scores_never_chain():
    """asks_ids=False: each distinct asked id a prompt of its own (prompt_logprobs, no logprob_token_ids), its
    value given in the order asked, repeats repeated; fast scoring reads each continuation's rows whole."""
    from collections import Counter

    from evalkit.contracts import IdsRead
    from evalkit.engine.served.batch import Sender
    from evalkit.engine.served.body import VLLMApi
    from evalkit.engine.served.http import Client
    from evalkit.engine.served.id_reads import read_ids

    with running(RowsOnly) as url:
        client = Client(url, api_key=None, max_concurrency=8, timeout=5, retries=0, backoff=0.01)
        counts: Counter = Counter()
        sender = Sender(client, fingerprint="f", counts=counts, bundle=16)
        reads = [IdsRead(context=(1, 2), ids=(30, 11, 30)), IdsRead(context=(4,), ids=()), IdsRead((4, 8), (250,))]
        RowsOnly.bodies.clear()
        values = read_ids(sender, reads, model="m", cache_salt="s", counts=counts, asks_ids=False)
        assert values == [(-0.3, -0.11, -0.3), (), (-2.5,)]
        assert counts["id_read_bodies"] == 3 and counts["mismatched"] == 0
        sent = [p for b in RowsOnly.bodies
                for p in (b["prompt"] if isinstance(b["prompt"][0], list) else [b["prompt"]])]
        assert sorted(sent) == [[1, 2, 11], [1, 2, 30], [4, 8, 250]]
        assert all(b["prompt_logprobs"] == 1 and "logprob_token_ids" not in b for b in RowsOnly.bodies)
        api = VLLMApi(sender, model="m", cache_salt="s", counts=counts, asks_ids=False)
        RowsOnly.bodies.clear()
        scored = api.score([ScoreRequest(ids=(1, 2, 3), start=2), ScoreRequest(ids=(1, 2, 40, 50), start=2)], None,
                           fast=True)
        assert [s.logprob for s in scored] == pytest.approx([-0.03, -0.9])
        assert all("logprob_token_ids" not in b for b in RowsOnly.bodies) and counts["prompt_logprobs"] == 2
