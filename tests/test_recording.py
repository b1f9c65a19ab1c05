"""A run's divergence record (evalkit/harness/divergence_traces.py, evalkit/run/recording.py, the request store's
traces) on the deterministic fake engine: which positions each kind records, the checks on an engine's traces, resume,
divergence_top_k=0 and bad values. The real engine's record: tests/test_recording_engine.py.
Run: pytest tests/test_recording.py"""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from evalkit.config import ConfigError, EvalConfig, compose_config, validate
from evalkit.contracts import Scored, ScoreRequest, TokenTrace
from evalkit.harness.lm import EvalkitLM
from evalkit.harness.divergence_traces import TraceError, check, score_gap
from evalkit.run import divergence_record
from evalkit.run.results import read_samples
from evalkit.store.requests import RequestStore, ResumableEngine
from tests.fake_engine import FakeEngine
from tests.test_compare import COMPARE_TASKS, fake_run

TASKS = ["evalkit_arith", "evalkit_facts", "evalkit_cmp_rolling"]  # generation, 4 choices, perplexity


def fake_value(token: int) -> float:
    """FakeEngine's log-probability of a token."""
    return -0.05 if chr(token) in "aeiou" else -0.1


class TracingEngine(FakeEngine):
    """The fake engine, with the trace calls it was sent written down."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.traced: list[list[ScoreRequest]] = []

    def trace(self, requests, top_k=5):
        self.traced.append(list(requests))
        return super().trace(requests, top_k)


def run(tmp_path, name, engine, **cfg):
    return fake_run(tmp_path, name, engine, tasks=TASKS, tasks_dirs=[str(COMPARE_TASKS)], limit=6,
                    **{"divergence_top_k": 20, **cfg})


def record(run_dir):
    data = json.loads((run_dir / "results.json").read_text())["evalkit"]
    return data, {task: divergence_record.read(run_dir / name) for task, name in data["files"]["divergence"].items()}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recorded")
    return run(tmp, "out", TracingEngine(), resume=False)


def test_each_kind_records_its_positions_with_the_engines_values(recorded):
    data, found = record(recorded)
    assert set(found) == set(TASKS) and data["divergence"]["top_k"] == 20
    kinds = {task: set(np.unique(p.kind).tolist()) for task, p in found.items()}
    assert kinds == {"evalkit_arith": {2}, "evalkit_facts": {0}, "evalkit_cmp_rolling": {1}}
    for task, p in found.items():
        assert p.k == 20 and len(p) == data["divergence"]["positions"][task] > 0
        assert np.allclose(p.text_logprob, [fake_value(t) for t in p.text_id])
        assert (p.top_ids[:, 0] == p.text_id).all() and (p.top_ids[:, 1] == p.text_id + 1).all()
        # the fake's 2 entries, then padding
        assert (p.top_ids[:, 2:] == divergence_record.PAD).all() and np.isnan(p.top_logprobs[:, 2:]).all()
        assert data["divergence"]["documents"][task] == 6


def test_the_counts_match_the_requests(recorded):
    data, found = record(recorded)
    for task, p in found.items():
        samples = read_samples(recorded, task)
        requests = [r for s in samples for r in s["requests"]]
        if task == "evalkit_facts":  # every choice's continuation
            expected = sum(r["extra"]["continuation_tokens"] for r in requests)
        elif task == "evalkit_arith":  # each greedy output
            expected = sum(r["output_tokens"] for r in requests)
            for s in samples:
                rows = p.doc_id == s["doc_id"]
                assert p.text_id[rows].tolist() == s["requests"][0]["output_ids"]
                assert (p.position[rows] == s["requests"][0]["prompt_tokens"] + np.arange(rows.sum())).all()
        else:  # every token of the text: the first window's context is the prefix token alone
            expected = sum(r["prompt_tokens"] for r in requests)
        assert len(p) == expected, task
    assert "trace_loglikelihood" in data["timings"]["engine_calls"]


def test_contexts_are_equal_where_choices_share_them(recorded):
    """Two choices of a question share a context exactly as far as their texts agree: at their first token
    (the question alone) and past a common start (here every choice starts with a space: one token)."""
    _, found = record(recorded)
    facts = found["evalkit_facts"]
    for doc in np.unique(facts.doc_id):
        rows = facts.doc_id == doc
        assert np.unique(facts.request[rows]).tolist() == [0, 1, 2, 3]  # lm-eval's index of each choice
        mine = [rows & (facts.request == r) for r in range(4)]
        choices = [(facts.text_id[m].tolist(), facts.context[m].tolist()) for m in mine]
        for a_text, a_keys in choices:
            for b_text, b_keys in choices:
                for j in range(min(len(a_text), len(b_text))):
                    assert (a_keys[j] == b_keys[j]) == (a_text[:j] == b_text[:j])
        assert len({keys[1] for _, keys in choices}) == 1 and len({keys[2] for _, keys in choices}) > 1


def test_the_samples_hold_no_traces(recorded):
    for task in TASKS:
        for sample in read_samples(recorded, task):
            assert all("traced" not in r for r in sample["requests"])


def test_top_k_zero_records_nothing_and_says_so(tmp_path):
    engine = TracingEngine()
    data, found = record(run(tmp_path, "off", engine, resume=False, divergence_top_k=0))
    assert found == {} and data["files"]["divergence"] == {} and not engine.traced
    assert data["divergence"] == {"top_k": 0, "recorded": "nothing: divergence_top_k=0"}
    assert not [k for k in data["timings"]["engine_calls"] if k.startswith("trace")]


def test_a_rerun_replays_the_traces_from_the_store_without_the_engine(tmp_path):
    first = run(tmp_path, "out", TracingEngine())
    engine = TracingEngine()
    engine.trace = None  # a call would fail: every trace must come from the store
    second = run(tmp_path, "out", engine)
    (data, found), (_, again) = record(first), record(second)
    assert data["resume"]["traces"]["computed"] > 0 and data["resume"]["traces"]["reused"] == 0
    resume = record(second)[0]["resume"]
    assert resume["traces"] == {"reused": data["resume"]["traces"]["computed"], "computed": 0}
    assert resume["computed"] == 0 and resume["reused"] == data["resume"]["computed"]  # traces apart
    for task in TASKS:
        for column in divergence_record.COLUMNS:
            np.testing.assert_array_equal(getattr(found[task], column), getattr(again[task], column))


def test_the_store_keys_a_trace_by_its_k_apart_from_its_score(tmp_path):
    path, request = tmp_path / "store.jsonl", [ScoreRequest(ids=(1, 98, 99), start=1)]
    engine = ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=8)
    engine.score(request)
    assert engine.trace(request, 1) == FakeEngine().trace(request, 1)
    assert engine.trace(request, 2) == FakeEngine().trace(request, 2)
    assert +engine.traces == {"computed": 2} and (engine.reused, engine.computed) == (0, 1)
    engine.close()
    again = ResumableEngine(FakeEngine(), RequestStore(path), chunk_size=8)
    assert again.trace(request, 2) == FakeEngine().trace(request, 2) and +again.traces == {"reused": 1}


def instance(doc_id, idx, *args, task="t"):
    return SimpleNamespace(task_name=task, doc_id=doc_id, idx=idx, args=args)


def test_identical_requests_are_traced_once_and_recorded_for_each_owner():
    engine = TracingEngine()
    lm = EvalkitLM(engine, model_name="m", max_tokens=8, divergence_top_k=3)
    lm.loglikelihood([instance(0, 0, "Q: sky?", " blue"), instance(0, 1, "Q: sky?", " red"),
                      instance(1, 0, "Q: sky?", " blue")])
    (call,) = engine.traced
    assert len(call) == 2  # " blue" after the same question, once
    assert [n for n, _, _ in lm.records[("t", 1)][0].traced] == [0]
    assert lm.records[("t", 0)][0].traced[0][2] == lm.records[("t", 1)][0].traced[0][2]
    assert lm.traces.summary()["max_score_gap"]["loglikelihood"] < 1e-12  # the fake's two sums


def test_sampled_generations_are_left_out_and_counted():
    engine = TracingEngine(reply=" 4")
    lm = EvalkitLM(engine, model_name="m", max_tokens=8, divergence_top_k=5)
    lm.generate_until([instance(0, 0, "What is 2 + 2?", {"until": ["\n"]}),
                       instance(1, 0, "What is 2 + 2?", {"until": ["\n"], "do_sample": True, "temperature": 0.7})])
    assert [len(r.traced) for r in (lm.records[("t", 0)][0], lm.records[("t", 1)][0])] == [1, 0]
    assert lm.traces.summary()["not_recorded"] == {"sampled generations": 1}


def test_an_output_that_fills_the_model_is_traced_up_to_one_free_position():
    engine = TracingEngine(max_model_len=16, reply=" 1234567890")
    lm = EvalkitLM(engine, model_name="m", max_tokens=100, divergence_top_k=5)
    lm.generate_until([instance(0, 0, "What is 1?", {"until": ["\n"]})])  # 10 prompt tokens, 6 generated
    (traced,) = engine.traced[0]
    assert len(traced.ids) == 15 and traced.start == 10
    assert lm.traces.summary()["not_recorded"] == {"output tokens past max_model_len - 1": 1}


REQUEST = ScoreRequest(ids=(1, 104, 105, 106), start=2)  # positions 2 and 3: "i", "j"


@pytest.mark.parametrize("trace, message", [
    (TokenTrace(logprobs=(-0.05,), top=(((105, -0.05),),)), "1 log-probabilities and 1 top lists for its 2"),
    (TokenTrace(logprobs=(-0.05, -0.1), top=(((105, -0.05),), ()),), "has 0 top entries"),
    (TokenTrace(logprobs=(-0.05, -0.1), top=(((105, -0.05),), ((106, -0.1), (7, -0.1), (8, -1.0), (9, -2.0)))),
     "has 4 top entries; divergence_top_k=3"),
    (TokenTrace(logprobs=(-0.05, -0.1), top=(((105, -0.05),), ((106, -0.1), (106, -0.2)))), "repeats a token"),
    (TokenTrace(logprobs=(-0.05, -0.1), top=(((105, -0.05),), ((7, -2.0), (106, -0.1)))), "out of order"),
    (TokenTrace(logprobs=(-0.05, -0.1), top=(((105, -0.05),), ((106, -0.3),))), "gives the text token -0.1 but -0.3"),
    (TokenTrace(logprobs=(-0.05, -0.1), top=(((105, -0.05),), ((7, -0.05), (8, -2.0)))), "yet leaves it out"),
    (TokenTrace(logprobs=(-0.05, float("nan")), top=(((105, -0.05),), ((106, -0.1),))), "NaN"),
])
def test_a_trace_that_does_not_answer_its_request_fails_in_one_line(trace, message):
    for dtype in ("float32", "bfloat16"):  # the same faults in every dtype: a row's own values agree exactly
        with pytest.raises(TraceError, match=message) as error:
            check(REQUEST, trace, 3, dtype=dtype)
        assert "\n" not in str(error.value)


def test_a_trace_read_one_position_off_is_caught():
    """An engine whose trace reads each row one position late: the text token it reports is not its row's."""
    engine = FakeEngine()
    (good,) = engine.trace([REQUEST], 3)
    check(REQUEST, good, 3, dtype="float32")
    late = TokenTrace(logprobs=good.logprobs, top=(good.top[1], ((0, -2.0),)))
    for dtype in ("float32", "bfloat16"):  # nats off: no dtype's rounding between two calls covers it
        with pytest.raises(TraceError, match="position 2 .* leaves it out"):
            check(REQUEST, late, 3, dtype=dtype)


def test_a_text_token_read_apart_may_round_above_its_top_list_by_its_dtype_s_logit_rounding():
    """A one-token request's text token outside its context's top-k is read in another engine call than the top
    list: in bfloat16 it may land above the last entry by the rounding of the logits between two calls (up to
    1 nat: 4 steps of bfloat16 below a logit of 64), and the position is returned as one whose calls disagree; a
    token that outranks the list by more is no engine's answer (its reader sends such a read again, in one call)."""
    top = ((7, -0.5), (8, -9.57))
    near = TokenTrace(logprobs=(-9.57 + 0.31,), top=(top,))
    one = ScoreRequest(ids=(1, 104, 9), start=2)
    assert check(one, near, 3, dtype="bfloat16") == [2]
    assert check(one, TokenTrace(logprobs=(-9.57 + 5e-5,), top=(top,)), 3, dtype="float32") == []
    with pytest.raises(TraceError, match="by more than 0.0001 nats, yet leaves it out"):
        check(one, near, 3, dtype="float32")
    with pytest.raises(TraceError, match="by more than 1 nats, yet leaves it out"):
        check(one, TokenTrace(logprobs=(-2.0,), top=(top,)), 3, dtype="bfloat16")


def test_a_gross_gap_between_trace_and_score_fails_and_noise_is_measured():
    (trace,) = FakeEngine().trace([REQUEST], 3)
    assert score_gap(REQUEST, trace, Scored(logprob=-0.15 + 1e-5, is_greedy=True), dtype="float32") == \
        pytest.approx(1e-5)
    with pytest.raises(TraceError, match=r"sums to -0.1500 but it scored -3.1500"):
        score_gap(REQUEST, trace, Scored(logprob=-3.15, is_greedy=False), dtype="float32")
    # in bfloat16 two calls may round each position's log-probability up to 1 nat apart: 0.5 + 2 allowed
    assert score_gap(REQUEST, trace, Scored(logprob=-2.15, is_greedy=False), dtype="bfloat16") == pytest.approx(2.0)
    with pytest.raises(TraceError, match=r"2.5 are allowed \(0.5 and 1 a position"):
        score_gap(REQUEST, trace, Scored(logprob=-3.15, is_greedy=False), dtype="bfloat16")


def test_the_engine_giving_too_few_traces_fails_the_run_in_one_line():
    engine = FakeEngine()
    engine.trace = lambda requests, top_k: []
    lm = EvalkitLM(engine, model_name="m", max_tokens=8, divergence_top_k=5)
    with pytest.raises(TraceError, match="^the engine answered 0 traces for 1 loglikelihood requests$"):
        lm.loglikelihood([instance(0, 0, "Q:", " a")])


@pytest.mark.parametrize("overrides, message", [
    (["divergence_top_k=-1"], "divergence_top_k=-1 must be 0 (record nothing) to 100"),
    (["divergence_top_k=101"], "divergence_top_k=101 must be 0 (record nothing) to 100"),
    (["divergence_top_k=50"], "divergence_top_k=50 is more than vLLM's max_logprobs=20: pass "
                              "+engine_kwargs.max_logprobs=50"),
])
def test_a_bad_top_k_fails_before_the_engine(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose_config(overrides))
    validate(compose_config(["divergence_top_k=50", "+engine_kwargs.max_logprobs=50"]))
    validate(compose_config(["divergence_top_k=50", "engine=hf"]))
    validate(EvalConfig(model_name="m", vllm_path="x", divergence_top_k=0))


def test_a_bad_top_k_on_the_command_line_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "evalkit", "divergence_top_k=-3", f"output_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and [line for line in lines if line.startswith("evalkit: error: ")] == [lines[-1]]
    assert lines[-1] == "evalkit: error: divergence_top_k=-3 must be 0 (record nothing) to 100"
    assert not (tmp_path / "smollm2-135m-instruct").exists()


def test_an_engine_that_traces_in_its_answers_is_not_asked_again(tmp_path, recorded):
    """An engine whose scores and greedy generations carry their traces (one pass, as vLLM's do): no trace call
    is made, nothing is traced apart, and the record holds the same positions and values as the second-pass
    record of the same run."""
    engine = TracingEngine(traces_in_pass=True)
    one_pass = run(tmp_path, "one", engine, resume=False)
    data, found = record(one_pass)
    before, found_before = record(recorded)
    assert engine.traced == []
    assert set(data["divergence"]["traced_apart"].values()) == {0}, data["divergence"]
    assert set(before["divergence"]["traced_apart"].values()) != {0}
    for task, p in found.items():
        q = found_before[task]
        assert len(p) == len(q) and (p.text_id == q.text_id).all() and np.allclose(p.text_logprob, q.text_logprob)
        assert (p.top_ids == q.top_ids).all()


def test_a_trace_in_an_answer_that_does_not_answer_it_fails_in_one_line(tmp_path):
    """A one-pass trace is checked as a second-pass one: a trace one position short stops the run."""

    class Short(TracingEngine):
        def score(self, requests, progress=None, *, fast=True, top_k=0):
            answers = super().score(requests, progress, fast=fast, top_k=top_k)
            return [a if a.trace is None else Scored(a.logprob, a.is_greedy, TokenTrace(
                logprobs=a.trace.logprobs[1:], top=a.trace.top[1:])) for a in answers]

    with pytest.raises(TraceError, match="log-probabilities and"):
        run(tmp_path, "short", Short(traces_in_pass=True), resume=False)
