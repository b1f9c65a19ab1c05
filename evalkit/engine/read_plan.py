"""What one planned path read of vLLM asks for (:class:`PathRead`), the record that the vLLM engine's scoring
paths plan and send (``vllm/chained.py`` plans them for chained continuations, ``vllm/path_reads.py`` cuts them
against vLLM's prefix cache and sends them) and that ``logprob_reads.read_path`` checks an answer against.
Pure, no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from evalkit.contracts import ScoreRequest

MAX_LOGPROB_TOKEN_IDS = 128  # vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS in 0.32: ids one request may ask for


@dataclass(frozen=True)
class PathRead:
    """One request that reads several chain steps: the rows of prompt[start:] (None: no rows) and the next-token
    log-probabilities of the ids in asked after the whole prompt."""

    prompt: tuple[int, ...]
    start: int | None
    asked: tuple[int, ...]

    def steps(self) -> list[ScoreRequest]:
        """The steps this read answers, in the order read_path returns them."""
        rows = range(self.start, len(self.prompt)) if self.start is not None else range(0)
        return ([ScoreRequest(ids=self.prompt[:p + 1], start=p) for p in rows] +
                [ScoreRequest(ids=self.prompt + (t,), start=len(self.prompt)) for t in self.asked])
