"""lm-eval's log-likelihood requests as score requests (evalkit/harness/loglikelihood.py): pairs under the length
budget, rolling windows. Run: pytest tests/test_loglikelihood.py"""

import pytest

from evalkit.contracts import Scored
from evalkit.harness.budget import PromptTooLong
from evalkit.harness.loglikelihood import pair_requests, rolling_windows


def test_a_pair_that_fits_is_sent_whole_with_its_record():
    (request,), (record,) = pair_requests([(("ab", "c"), [1, 2], [3, 4])], max_model_len=8, overflow="fail")
    assert request.ids == (1, 2, 3, 4) and request.start == 2
    assert (record.kind, record.prompt_tokens, record.truncated_tokens) == ("loglikelihood", 4, 0)
    assert record.extra == {"continuation_tokens": 2}


def test_a_long_context_loses_its_left_end_only_on_request():
    pair = (("", ""), list(range(10, 20)), [7, 8])
    with pytest.raises(PromptTooLong):
        pair_requests([pair], max_model_len=8, overflow="fail")
    (request,), (record,) = pair_requests([pair], max_model_len=8, overflow="truncate_left")
    assert request.ids == (15, 16, 17, 18, 19, 7, 8) and request.start == 5  # max_model_len - 1 tokens
    assert record.truncated_tokens == 5 and record.prompt_tokens == 7


def test_rolling_windows_cover_each_text_once_and_sum_per_text():
    texts = [list(range(100, 116)), [200, 201]]
    windows = rolling_windows(texts, prefix_token=1, max_model_len=8)
    assert all(len(r.ids) - r.start <= 6 for r in windows.requests)  # max_model_len - 2 tokens a window
    for n, text in enumerate(texts):
        mine = [r for r, owner in zip(windows.requests, windows.owners) if owner == n]
        assert [t for r in mine for t in r.ids[r.start:]] == text
        assert mine[0].ids[0] == 1 and windows.records[n].extra["windows"] == len(mine)
        assert windows.records[n].prompt_tokens == len(text)
    assert windows.numbers == [0, 1, 2, 0]
    answers = [Scored(logprob=-1.0 - n, is_greedy=False) for n in range(len(windows.requests))]
    assert windows.totals(answers) == [-1.0 - 2.0 - 3.0, -4.0]
    items = windows.items(answers)
    assert [(windows.records.index(record), number, request, scored) for record, number, request, scored in items] \
        == list(zip(windows.owners, windows.numbers, windows.requests, answers))
