"""What the vLLM scoring paths do with a read that fails its check: it is sent once more without the prefix
cache (by the path that sent it), and a second failure stops the run with :class:`ScoringError`."""

from __future__ import annotations

from typing import Callable, TypeVar

from evalkit.engine.logprob_reads import BadRead

T = TypeVar("T")


class ScoringError(RuntimeError):
    """vLLM returned log-probabilities that do not answer the request, twice: nothing of it is scored."""


def second_read(read: Callable[[], T], prompt_tokens: int) -> T:
    """read() of an answer sent again without the cache; a second BadRead as a ScoringError (one line)."""
    try:
        return read()
    except BadRead as error:
        raise ScoringError(f"vLLM's log-probabilities for a {prompt_tokens}-token request failed their "
                           f"check twice, the second time without the prefix cache ({error}); nothing of it "
                           "was scored") from None
