"""The lm-eval adapter (evalkit/harness/lm.py) on the deterministic fake engine. Run: pytest tests/test_harness.py"""

from types import SimpleNamespace

import pytest

from evalkit.contracts import GenRequest
from evalkit.harness.budget import PromptTooLong
from evalkit.harness.generate_until import strip_thinking
from evalkit.harness.lm import EvalkitLM
from tests.fake_engine import BOS, FakeEngine


def instance(task, doc_id, *args):
    return SimpleNamespace(task_name=task, doc_id=doc_id, args=args)


def test_generation_gets_min_of_max_tokens_and_room():
    engine = FakeEngine(max_model_len=64)
    lm = EvalkitLM(engine, model_name="m", max_tokens=16384)
    prompt = "Question: What is 2 + 2?\nAnswer:"  # 32 characters = 32 tokens
    (answer,) = lm.generate_until([instance("t", 0, prompt, {"until": ["\n"]})])
    assert answer == " 4"
    assert engine.generated[0].max_tokens == 64 - 32 and engine.generated[0].prompt_ids == tuple(map(ord, prompt))
    (record,) = lm.records[("t", 0)]
    assert record.clamped and record.requested_max_tokens == 16384 and record.max_tokens == 32
    assert (record.prompt_tokens, record.output_tokens, record.finish_reason) == (32, 2, "stop")


def test_task_max_gen_toks_lowers_the_ceiling_and_length_is_reported():
    engine = FakeEngine(reply=" 1234567890")
    lm = EvalkitLM(engine, model_name="m", max_tokens=100)
    (answer,) = lm.generate_until([instance("t", 3, "x", {"until": ["\n"], "max_gen_toks": 4})])
    assert answer == " 123"
    (record,) = lm.records[("t", 3)]
    assert record.finish_reason == "length" and not record.clamped and record.max_tokens == 4


def test_too_long_prompt_fails_by_default_and_truncates_left_on_request():
    prompt = "A" * 60 + "What is 1 + 1?"
    lm = EvalkitLM(FakeEngine(max_model_len=40), model_name="m", max_tokens=8)
    with pytest.raises(PromptTooLong):
        lm.generate_until([instance("t", 0, prompt, {"until": []})])
    engine = FakeEngine(max_model_len=40)
    lm = EvalkitLM(engine, model_name="m", max_tokens=8, min_gen_tokens=8, overflow="truncate_left")
    (answer,) = lm.generate_until([instance("t", 0, prompt, {"until": ["\n"]})])
    assert answer == " 2"
    assert engine.generated[0].prompt_ids == tuple(map(ord, prompt[-32:]))
    assert lm.records[("t", 0)][0].truncated_tokens == len(prompt) - 32


def test_strip_thinking_scores_the_answer_and_keeps_the_raw_text():
    lm = EvalkitLM(FakeEngine(reply="<think>7+5 is 12</think> 12"), model_name="m", max_tokens=64,
                   strip_thinking=True)
    (answer,) = lm.generate_until([instance("t", 0, "q", {"until": []})])
    assert answer == "12" and lm.records[("t", 0)][0].raw_output == "<think>7+5 is 12</think> 12"


@pytest.mark.parametrize("text, expected", [
    ("<think>a</think>b", "b"), ("x</think> y", "y"), ("<think>never closed", ""), ("plain 5", "plain 5"),
    ("<think>1</think>2<think>3</think> 4", "4"),
])
def test_strip_thinking_rules(text, expected):
    assert strip_thinking(text, "</think>") == expected


def test_loglikelihood_uses_lm_evals_pair_encoding():
    engine = FakeEngine()
    lm = EvalkitLM(engine, model_name="m", max_tokens=8)
    out = lm.loglikelihood([instance("t", 0, "Q: sky? A: ", "blue"), instance("t", 0, "", "ab")])
    # trailing space moves to the continuation (lm-eval's _encode_pair); empty context gets the prefix token
    assert engine.scored[0].ids[engine.scored[0].start:] == tuple(map(ord, " blue"))
    assert engine.scored[1].ids == (BOS, ord("a"), ord("b")) and engine.scored[1].start == 1
    assert out[0] == (pytest.approx(-0.1 * 3 - 0.05 * 2), False)
    assert [r.kind for r in lm.records[("t", 0)]] == ["loglikelihood", "loglikelihood"]


def test_loglikelihood_context_truncation_is_counted():
    engine = FakeEngine(max_model_len=10)
    lm = EvalkitLM(engine, model_name="m", max_tokens=8, overflow="truncate_left")
    lm.loglikelihood([instance("t", 1, "0123456789", "ab")])
    assert engine.scored[0].ids == tuple(map(ord, "3456789ab"))
    assert lm.records[("t", 1)][0].truncated_tokens == 3


def test_rolling_loglikelihood_covers_every_token_once_in_windows():
    engine = FakeEngine(max_model_len=8)
    lm = EvalkitLM(engine, model_name="m", max_tokens=8)
    text = "bcdfghjklmnpqrst"  # 16 consonants: -0.1 each
    (total,) = lm.loglikelihood_rolling([instance("t", 0, text)])
    assert total == pytest.approx(-1.6)
    assert sum(len(r.ids) - r.start for r in engine.scored) == 16
    assert all(len(r.ids) <= 7 for r in engine.scored)  # vLLM needs one free position
    assert lm.records[("t", 0)][0].extra["windows"] == len(engine.scored)


def test_shuffled_submission_returns_answers_in_request_order():
    engine = FakeEngine()
    lm = EvalkitLM(engine, model_name="m", max_tokens=8, order_seed=7)
    questions = [f"What is {i} + 1?" for i in range(20)]
    answers = lm.generate_until([instance("t", i, q, {"until": ["\n"]}) for i, q in enumerate(questions)])
    assert answers == [f" {i + 1}" for i in range(20)]
    submitted = [engine.decode(r.prompt_ids) for r in engine.generated]
    assert submitted != questions and sorted(submitted) == sorted(questions)


def test_a_thinking_models_stop_inside_its_reasoning_does_not_end_the_answer():
    reply = "<think>First 7 + 5.\n\nThat is 12.</think> 12\n\nQuestion: next"
    engine = FakeEngine(reply=reply)
    lm = EvalkitLM(engine, model_name="m", max_tokens=64, strip_thinking=True)
    (answer,) = lm.generate_until([instance("t", 0, "q", {"until": ["\n\n"]})])
    assert engine.generated[0].stop == ("\x02",)  # only the EOS text reaches the engine...
    assert answer == "12"  # ...and the task's stop cuts the answer once the reasoning is removed
    assert lm.records[("t", 0)][0].raw_output == reply
    plain = FakeEngine(reply=reply)
    (cut,) = EvalkitLM(plain, model_name="m", max_tokens=64).generate_until([instance("t", 0, "q", {"until": ["\n\n"]})])
    assert plain.generated[0].stop == ("\n\n", "\x02") and cut == "<think>First 7 + 5."


def test_a_tasks_own_sampling_settings_reach_the_engine_and_overrides_win():
    engine = FakeEngine(reply=" ok")
    kwargs = {"until": "\n", "do_sample": True, "temperature": 0.8, "top_p": 0.9, "max_new_tokens": 7}
    EvalkitLM(engine, model_name="m", max_tokens=100).generate_until([instance("t", 0, "q", dict(kwargs))])
    sent = engine.generated[0]
    settings = dict(sent.sampling)
    assert isinstance(settings.pop("seed"), int)  # a sampled request's own seed (below)
    assert settings == {"temperature": 0.8, "top_p": 0.9, "skip_special_tokens": False,
                        "spaces_between_special_tokens": False}
    assert sent.max_tokens == 7 and sent.stop == ("\n", "\x02") and not sent.greedy
    EvalkitLM(engine, model_name="m", max_tokens=5, temperature=0.0, sampling_kwargs={"top_p": 1.0}).generate_until(
        [instance("t", 0, "q", dict(kwargs))])
    assert dict(engine.generated[1].sampling)["temperature"] == 0.0 and engine.generated[1].greedy
    assert dict(engine.generated[1].sampling)["top_p"] == 1.0 and engine.generated[1].max_tokens == 5
    EvalkitLM(engine, model_name="m", max_tokens=100).generate_until(
        [instance("t", 0, "q", {"until": [], "temperature": 0.5, "do_sample": False})])
    assert dict(engine.generated[2].sampling)["temperature"] == 0.0  # do_sample false means greedy (lm-eval)


@pytest.mark.parametrize("gen_kwargs, temperature", [
    ({"until": []}, 0.0),  # neither do_sample nor temperature: greedy, as normalize_gen_kwargs documents
    ({"until": [], "do_sample": False}, 0.0),
    ({"until": [], "do_sample": True}, 1.0),  # sampling at vLLM's default, said explicitly
    ({"until": [], "temperature": 0.7}, 0.7),
])
def test_every_generation_names_its_temperature(gen_kwargs, temperature):
    engine = FakeEngine()
    lm = EvalkitLM(engine, model_name="m", max_tokens=8)
    lm.generate_until([instance("t", 0, "q", gen_kwargs)])
    (sent,) = engine.generated
    assert dict(sent.sampling)["temperature"] == temperature and sent.greedy == (temperature == 0.0)
    assert ("seed" in dict(sent.sampling)) == (temperature > 0)
    (task,) = lm.effective_sampling()["t"]
    assert task["settings"]["temperature"] == temperature and task["requests"] == 1 and "seed" not in task["settings"]


def test_a_request_without_temperature_is_read_as_sampled_as_vllm_samples_it():
    assert not GenRequest(prompt_ids=(1,), max_tokens=1).greedy
    assert GenRequest(prompt_ids=(1,), max_tokens=1, sampling=(("temperature", 0.0),)).greedy


def test_sampled_draws_get_seeds_from_the_run_seed_the_request_and_its_draw_number():
    def seeds(seed, prompts, repeats=4):
        engine = FakeEngine()
        lm = EvalkitLM(engine, model_name="m", max_tokens=8, seed=seed)
        lm.generate_until([instance("t", i, p, {"until": [], "do_sample": True, "temperature": 0.8})
                           for i, p in enumerate(prompts) for _ in range(repeats)])
        return [dict(r.sampling)["seed"] for r in engine.generated]

    first = seeds(1, ["a", "b"])
    assert len(set(first)) == 8  # repeats draw distinct samples
    assert seeds(1, ["a", "b"]) == first and seeds(7, ["a", "b"]) != first
    assert seeds(1, ["b", "a"]) == first[4:] + first[:4]  # a draw's seed does not depend on the order
    own = EvalkitLM(FakeEngine(), model_name="m", max_tokens=8)
    own.generate_until([instance("t", 0, "q", {"until": [], "do_sample": True, "seed": 5})])
    assert dict(own.engine.generated[0].sampling)["seed"] == 5  # a task's own seed is kept


def test_prompts_get_the_tokenizers_default_bos_unless_they_start_with_it():
    engine = FakeEngine(adds_bos=True)
    lm = EvalkitLM(engine, model_name="m", max_tokens=8)
    lm.generate_until([instance("t", 0, "Hi", {"until": []}), instance("t", 1, "\x01Hi", {"until": []})])
    assert [r.prompt_ids for r in engine.generated] == [(BOS, ord("H"), ord("i")), (BOS, ord("H"), ord("i"))]
    lm.loglikelihood([instance("t", 2, "Q:", " A")])
    assert engine.scored[0].ids == (BOS, ord("Q"), ord(":"), ord(" "), ord("A")) and engine.scored[0].start == 3
    forced_off = EvalkitLM(FakeEngine(adds_bos=True), model_name="m", max_tokens=8, add_bos_token=False)
    assert forced_off.tok_encode("Hi") == [ord("H"), ord("i")]
    assert EvalkitLM(FakeEngine(), model_name="m", max_tokens=8).tok_encode("Hi") == [ord("H"), ord("i")]
