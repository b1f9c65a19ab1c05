"""The harness's engine calls: each call's items sent in one batch, in an order shuffled by ``order_seed`` when
set (batches then hold other neighbours, which is how the run-to-run noise of the engine is measured:
evalkit.compare.noise), answered in request order, with one progress line and its wall time summed per label.
"""

from __future__ import annotations

import random
import time
from typing import Callable

from evalkit.contracts import RequestProgress

# opens the progress of one engine call: (request kind, requests)
OpenProgress = Callable[[str, int], RequestProgress]


class Calls:
    """A run's engine calls, in its order (order_seed) and timed (``seconds``: wall time per label)."""

    def __init__(self, *, order_seed: int | None = None, progress: OpenProgress | None = None) -> None:
        self.order_seed = order_seed
        self.progress = progress  # None: silent
        self.seconds: dict[str, float] = {}

    def order(self, n: int) -> list[int]:
        """The positions of n items in the order they are sent: as given, or shuffled by order_seed."""
        order = list(range(n))
        if self.order_seed is not None:
            random.Random(self.order_seed).shuffle(order)
        return order

    def submit(self, call: Callable[[list, RequestProgress | None], list], items: list, label: str) -> list:
        """call(items in the order sent, progress), its answers put back in the order of items."""
        progress = self.progress(label, len(items)) if self.progress else None
        order = self.order(len(items))
        started = time.perf_counter()
        answers = call([items[i] for i in order], progress)
        self.seconds[label] = round(self.seconds.get(label, 0.0) + time.perf_counter() - started, 3)
        if progress:
            progress.close()
        result: list = [None] * len(items)
        for position, answer in zip(order, answers):
            result[position] = answer
        return result
