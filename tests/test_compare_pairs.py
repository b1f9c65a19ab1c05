"""Pairing two runs' documents (evalkit/compare/statistics/paired.py): the checks of every per-document value, made
for all documents at once where each is a plain number, refuse and accept exactly what the checks one value at a
time do; the sample-level count of documents whose best choice moved, made per number of choices at once.
Run: pytest tests/test_compare_pairs.py
"""

import math

import pytest

from evalkit.compare.runs import CompareError
from evalkit.compare.statistics import paired

NUMBER, PAIR = ("mean", "a number"), ("weighted_perplexity", "a pair of numbers")


def pairs_of(ref, cand, metric="m"):
    return [({"doc_id": i, metric: r}, {"doc_id": i, metric: c}) for i, (r, c) in enumerate(zip(ref, cand))]


@pytest.mark.parametrize("ref, cand, expected", [
    ([0.0, 1.0, 1.0], [1.0, 1.0, 0.0], NUMBER), ([0, 1, 2], [2.5, -3, 1e300], NUMBER), ([True, 1.0], [1, 0], NUMBER),
    ([1.0, 2.0], [3.0, 4.0], None), ([[-10.5, 7], [-3.0, 2]], [[-11.0, 7], [-2.5, 2]], PAIR)])
def test_plain_numbers_are_kept_whole(ref, cand, expected):
    pairs = pairs_of(ref, cand)
    assert paired.scored_pairs("t", "none", pairs, "m", expected) == (pairs, "")


@pytest.mark.parametrize("bad, expected, words", [
    (math.nan, NUMBER, "null, NaN or infinite on documents 1"), (math.inf, None, "null, NaN or infinite"),
    (None, NUMBER, "null, NaN or infinite"), ("0.5", NUMBER, "not a number on documents 1 (first: '0.5')"),
    (10 ** 400, NUMBER, "too large to add up on documents 1"), (1e308, NUMBER, "too large to add up"),
    ([1.0, "7"], PAIR, "not a pair of numbers on documents 1"), ([1.0, 2.0, 3.0], PAIR, "not a pair of numbers"),
    ([1.0, math.nan], PAIR, "null, NaN or infinite"), (2.0, PAIR, "not a pair of numbers")])
def test_a_value_that_is_no_plain_number_is_refused_by_name(bad, expected, words):
    good = [1.0, 2.0] if expected == PAIR else 1.0
    pairs = pairs_of([good, good, good], [good, bad, good])
    with pytest.raises(CompareError, match="candidate") as error:
        paired.scored_pairs("t", "none", pairs, "m", expected)
    assert words in str(error.value)


def test_documents_one_run_left_unscored_are_still_named():
    pairs = pairs_of([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    del pairs[2][1]["m"]
    with pytest.raises(CompareError, match="only the reference scored documents 2"):
        paired.scored_pairs("t", "none", pairs, "m", NUMBER)


def logprob_sample(i, values):
    return {"doc_id": i, "resps": [[[str(v), "False"]] for v in values], "raw_output": None}


def test_moved_best_choices_are_counted_whatever_the_number_of_choices():
    """Four documents of 3, 3, 2 and 2 choices: the best choice moves in the first (2 -> 1) and the last (a NaN
    first, as numpy's argmax reads it), not where the values only shift or tie."""
    ref = [[1, 2, 3], [3, 2, 1], [0, 0], [5, math.nan]]
    cand = [[1, 3, 2], [3, 2, 1.5], [1, 0], [math.nan, 1]]
    pairs = [(logprob_sample(i, r), logprob_sample(i, c)) for i, (r, c) in enumerate(zip(ref, cand))]
    detail = paired.task_detail("t", "none", pairs, {})
    assert detail.logprob["argmax_changed"] == 2 and detail.logprob["choices"] == 10
    assert detail.logprob_diffs[:7] == [0.0, 1.0, -1.0, 0.0, 0.0, 0.5, 1.0]


def choices_of(values):
    return {"resps": [[[repr(v) if isinstance(v, float) else v, "False"]] for v in values]}


@pytest.mark.parametrize("shape", ["four choices each", "one document of three", "a choice not a number",
                                   "a document without choices"])
def test_the_one_pass_drift_is_the_drift_document_by_document(shape, monkeypatch):
    rng = __import__("numpy").random.default_rng(7)
    ref = rng.normal(-8, 2, (300, 4)).round(1).tolist()  # rounded: ties among choices, as numpy's argmax reads them
    cand = [[v + (0.5 if i % 7 == 0 and j == 1 else 0.0) for j, v in enumerate(row)] for i, row in enumerate(ref)]
    ref_samples, cand_samples = [choices_of(r) for r in ref], [choices_of(c) for c in cand]
    if shape == "one document of three":
        ref_samples[5], cand_samples[5] = choices_of(ref[5][:3]), choices_of(cand[5][:3])
    elif shape == "a choice not a number":
        cand_samples[9]["resps"][2][0][0] = "nan?"
    elif shape == "a document without choices":
        del ref_samples[11]["resps"]
    pairs = list(zip(ref_samples, cand_samples))
    assert (paired._same_choices_drift(paired.TaskDetail("t", "none"), pairs) is not None) == (
        shape == "four choices each")
    one_pass = paired.task_detail("t", "none", pairs, {})
    monkeypatch.setattr(paired, "_same_choices_drift", lambda detail, pairs: None)
    by_document = paired.task_detail("t", "none", pairs, {})
    assert repr(one_pass.logprob_diffs) == repr(by_document.logprob_diffs) and one_pass.logprob == by_document.logprob
    assert by_document.logprob["argmax_changed"] > 0
