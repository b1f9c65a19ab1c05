"""Which of the vLLM engine's scoring paths takes a request, and what a read that fails twice raises
(evalkit/engine/vllm/next_token.py, chained.py, second_read.py); no engine is started.
Run: pytest tests/engine/vllm/test_scoring_paths.py
"""

import pytest

from evalkit.contracts import ScoreRequest
from evalkit.engine.logprob_reads import BadRead
from evalkit.engine.vllm import chained, next_token
from evalkit.engine.vllm.second_read import ScoringError, second_read


def request(context: int, continuation: int) -> ScoreRequest:
    return ScoreRequest(ids=tuple(range(1, context + continuation + 1)), start=context)


@pytest.mark.parametrize("context, continuation, path", [
    (5, 1, "next_token"), (5, 2, "chained"), (5, chained.CHAIN_TOKENS, "chained"),
    (5, chained.CHAIN_TOKENS + 1, "prompt rows"), (0, 1, "prompt rows"), (0, 3, "prompt rows"),
    (5, 0, "prompt rows")])
def test_each_continuation_goes_to_one_path_by_its_length(context, continuation, path):
    """One token after a context: its next token; 2 to CHAIN_TOKENS: chained; longer ones, and those with no
    context (nothing to read a next token after), from their prompt rows; never two paths at once."""
    r = request(context, continuation)
    taken = [name for name, takes in (("next_token", next_token.takes), ("chained", chained.takes)) if takes(r)]
    assert taken == ([] if path == "prompt rows" else [path])


def test_a_read_that_fails_its_second_check_stops_with_one_line():
    assert second_read(lambda: {7: -0.5}, 12) == {7: -0.5}

    def bad():
        raise BadRead("3 prompt rows, 5 asked for")

    with pytest.raises(ScoringError) as error:
        second_read(bad, 12)
    message = str(error.value)
    assert "\n" not in message and error.value.__cause__ is None and error.value.__suppress_context__
    assert message.startswith("vLLM's log-probabilities for a 12-token request failed their check twice")
    assert "(3 prompt rows, 5 asked for)" in message
