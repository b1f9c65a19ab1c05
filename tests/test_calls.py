"""The harness's engine calls (evalkit/harness/calls.py): the run's order, answers put back, progress and
wall time per label. Run: pytest tests/test_calls.py"""

import random

from evalkit.harness.calls import Calls


class Lines:
    """The progress lines a run opens: (label, requests) each, and whether it was closed."""

    def __init__(self):
        self.opened, self.closed = [], 0

    def __call__(self, label, total):
        self.opened.append((label, total))
        return self

    def advance(self, requests, tokens=0):
        pass

    def close(self):
        self.closed += 1


def test_without_an_order_seed_items_go_as_given_and_come_back_in_place():
    sent = []
    answers = Calls().submit(lambda items, progress: sent.extend(items) or [i * 10 for i in items], [3, 1, 2], "x")
    assert sent == [3, 1, 2] and answers == [30, 10, 20]


def test_an_order_seed_shuffles_what_is_sent_and_the_answers_stay_in_request_order():
    calls, sent = Calls(order_seed=7), []
    items = list(range(20))
    answers = calls.submit(lambda batch, progress: sent.extend(batch) or [f"a{i}" for i in batch], items, "x")
    order = list(range(20))
    random.Random(7).shuffle(order)
    assert sent == order != items and answers == [f"a{i}" for i in items]
    assert calls.order(20) == order  # the same seed, the same order: each call of a run is shuffled alike


def test_each_call_opens_and_closes_one_progress_line_and_its_time_adds_up_per_label():
    lines = Lines()
    calls = Calls(progress=lines)
    for label in ("generate_until", "loglikelihood", "generate_until"):
        calls.submit(lambda batch, progress: [progress is lines] * len(batch), [1, 2], label)
    assert lines.opened == [("generate_until", 2), ("loglikelihood", 2), ("generate_until", 2)] and lines.closed == 3
    assert set(calls.seconds) == {"generate_until", "loglikelihood"} and all(s >= 0 for s in calls.seconds.values())
