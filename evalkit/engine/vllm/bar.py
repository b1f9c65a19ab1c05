"""vLLM's progress bar, replaced: what ``LLM.generate(use_tqdm=...)`` draws becomes calls to a Progress."""

from __future__ import annotations

import re
from typing import Any

from evalkit.contracts import Progress

SPEEDS = re.compile(r"input: ([\d.]+) toks/s, output: ([\d.]+) toks/s")


class EngineBar:
    """The part of a tqdm bar vLLM 0.32's ``_run_engine`` uses: ``format_dict["elapsed"]``, ``postfix``,
    ``update(n)``, ``n``, ``refresh()``, ``close()``. It prints nothing.

    vLLM reports tokens only as speeds in the postfix ("est. speed input: X toks/s, output: Y toks/s", its
    running totals divided by the elapsed time it read from ``format_dict``). The elapsed time handed out
    is held until the next ``update``, so (X + Y) times it gives the running total back (to vLLM's two
    decimals); each update passes on the growth of that total. Without a postfix, requests count alone.
    """

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.started = progress.clock()
        self.n = 0
        self.postfix: Any = ""
        self.elapsed: float | None = None  # as last read by vLLM, until the next update
        self.tokens = 0

    @property
    def format_dict(self) -> dict[str, Any]:
        if self.elapsed is None:
            self.elapsed = max(self.progress.clock() - self.started, 1e-6)  # vLLM divides by it
        return {"elapsed": self.elapsed, "n": self.n}

    def update(self, n: int = 1) -> None:
        speeds = SPEEDS.search(str(self.postfix or ""))
        total = self.tokens
        if speeds and self.elapsed is not None:
            total = max(total, round((float(speeds[1]) + float(speeds[2])) * self.elapsed))
        self.n += n
        self.progress.advance(n, total - self.tokens)
        self.tokens, self.elapsed = total, None

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass
