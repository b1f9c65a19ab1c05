"""Generation requests and their answers (evalkit/harness/generate_until.py), without an engine: tokens are
characters. Run: pytest tests/test_generate_until.py"""

from types import SimpleNamespace

import pytest

from evalkit.contracts import Generation
from evalkit.harness.budget import PromptTooLong
from evalkit.harness.generate_until import Generations

EOS = "\x02"


def encode(text):
    return [ord(c) for c in text]


def ask(doc_id, context, **gen_kwargs):
    return SimpleNamespace(task_name="t", doc_id=doc_id, args=(context, {"until": ["\n"], **gen_kwargs}))


def test_each_instance_becomes_one_request_with_its_budget_stops_and_record():
    planned = Generations(max_tokens=100).plan([ask(0, "abcd"), ask(1, "xy", max_gen_toks=3)], encode=encode,
                                               eos=EOS, max_model_len=10)
    first, second = planned.requests
    assert first.prompt_ids == tuple(encode("abcd")) and first.max_tokens == 6 and first.stop == ("\n", EOS)
    assert second.max_tokens == 3 and first.greedy and second.greedy
    assert [(r.requested_max_tokens, r.max_tokens, r.clamped) for r in planned.records] == [(100, 6, True),
                                                                                           (3, 3, False)]
    assert planned.stops == [["\n", EOS], ["\n", EOS]]
    with pytest.raises(PromptTooLong):
        Generations(max_tokens=100).plan([ask(0, "a" * 10)], encode=encode, eos=EOS, max_model_len=10)


def test_sampled_requests_get_seeds_of_their_own_and_the_tally_leaves_them_out():
    run = Generations(max_tokens=8, seed=3)
    planned = run.plan([ask(0, "q", do_sample=True, temperature=0.5)] * 2 + [ask(1, "q")], encode=encode, eos=EOS,
                       max_model_len=64)
    seeds = [dict(r.sampling).get("seed") for r in planned.requests]
    assert seeds[0] != seeds[1] and None not in seeds[:2] and seeds[2] is None  # two draws; greedy unseeded
    again = Generations(max_tokens=8, seed=3).plan([ask(0, "q", do_sample=True, temperature=0.5)], encode=encode,
                                                   eos=EOS, max_model_len=64)
    assert dict(again.requests[0].sampling)["seed"] == seeds[0]  # the run's seed, the request, its draw number
    tally = {entry["settings"]["temperature"]: entry["requests"] for entry in run.effective_sampling()["t"]}
    assert tally == {0.0: 1, 0.5: 2}


def test_an_answer_is_cut_at_the_tasks_stops_past_the_reasoning_and_its_record_keeps_the_raw_output():
    thinking = Generations(max_tokens=64, strip_thinking=True)
    planned = thinking.plan([ask(0, "q", until=["\n\n"])], encode=encode, eos=EOS, max_model_len=64)
    assert planned.requests[0].stop == (EOS,)  # the task's stops wait for the answer
    raw = "<think>a\n\nb</think> 12\n\nnext"
    generation = Generation(text=raw, finish_reason="stop", output_tokens=len(raw), token_ids=tuple(encode(raw)))
    record = planned.records[0]
    assert thinking.answer(record, planned.stops[0], generation) == "12"
    assert (record.raw_output, record.finish_reason, record.output_ids) == (raw, "stop", encode(raw))
