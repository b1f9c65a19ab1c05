"""engine=served's ids reads (evalkit/engine/served/id_reads.py) on responses built as vLLM 0.32's server writes
them (tests/engine/served/test_served_units.py's vllm_response), without a server: each answer checked for
exactly its asked ids. The real server, and a server read through the OpenAI API alone:
tests/engine/served/test_served.py.
Run: pytest tests/engine/served/test_served_id_reads.py
"""

import math

import pytest

from evalkit.engine.served.body import ServedReadError, next_token_body
from evalkit.engine.served.id_reads import read_asked
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
