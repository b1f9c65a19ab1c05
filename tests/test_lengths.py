"""Every prompt against max_model_len before the engine starts (evalkit/harness/lengths.py): the request it names
is the first the run's own planning (the length budget, after the engine started) would refuse, with the real
tokenizer of the embedded model; building the requests first leaves the run's prompts as they were. No engine.

Run: pytest tests/test_lengths.py
"""

import pytest

from evalkit.engine.machine.preflight import resolve_model_path
from evalkit.engine.tokenizer import TokenizerOnly, load_tokenizer
from evalkit.harness import lengths
from evalkit.harness.budget import PromptTooLong
from evalkit.harness.lm import EvalkitLM
from evalkit.harness.lm_eval_compat import encode_pairs
from evalkit.harness.loglikelihood import pair_requests
from evalkit.harness.tasks import load_tasks
from tests.conftest import PARITY_TASKS

TASKS = ["evalkit_arith", "evalkit_facts", "parity_fewshot"]  # generation, multiple choice, three shots


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("embedded://smollm2-135m-instruct"), trust_remote_code=False,
                          add_bos_token=None, with_vllm=False)


def harness(tokenizer, *, overflow="fail", max_tokens=256):
    """lm-eval's LM over the tokenizer alone, with nothing encoded yet."""
    return EvalkitLM(TokenizerOnly(tokenizer, max_model_len=4096, trust_remote_code=False, template_from="vllm"),
                     model_name="smollm2", max_tokens=max_tokens, overflow=overflow, min_gen_tokens=4)


def built(tokenizer, *, overflow="fail", num_fewshot=None, max_tokens=256):
    lm = harness(tokenizer, overflow=overflow, max_tokens=max_tokens)
    manager, tasks = load_tasks(TASKS, task_data={}, extra_dirs=[PARITY_TASKS])
    requests = lengths.build_requests(lm, manager.load(tasks)["tasks"], limit=None, samples=None,
                                      num_fewshot=num_fewshot, fewshot_seed=1234,
                                      system_instruction=None, apply_chat_template=False, fewshot_as_multiturn=False)
    return lm, requests


def refused(lm, requests, max_model_len) -> list[str]:
    """The tasks the run's own planning (EvalkitLM's loglikelihood and generate_until paths) refuses, each text
    encoded one at a time as the run encodes it (a fresh LM: nothing encoded ahead)."""
    lm = harness(lm.engine.tokenizer, overflow=lm.overflow, max_tokens=lm.generations.max_tokens)
    tasks = []
    for task, instances in requests.items():
        try:
            pair_requests(encode_pairs(lm, [i for i in instances if i.request_type == "loglikelihood"]),
                          max_model_len=max_model_len, overflow=lm.overflow)
            lm.generations.plan([i for i in instances if i.request_type == "generate_until"], encode=lm.tok_encode,
                                eos=lm.engine.decode([lm.eot_token_id]), max_model_len=max_model_len)
        except PromptTooLong:
            tasks.append(task)
    return tasks


@pytest.mark.parametrize("overflow", ["fail", "truncate_left"])
def test_the_longest_request_is_the_first_the_run_would_refuse(tokenizer, overflow):
    lm, requests = built(tokenizer, overflow=overflow)
    found = lengths.longest(lm, requests)
    assert set(requests) == set(TASKS)
    assert refused(lm, requests, found.needs) == [] and found.task in refused(lm, requests, found.needs - 1)
    if overflow == "fail":  # the longest prompt: a three-shot generation, + the 4 new tokens it must leave room for
        assert refused(lm, requests, found.needs - 1) == ["parity_fewshot"] == [found.task]
        assert found.needs == found.prompt_tokens + 4 and found.needs > 50
    else:  # prompts are cut: only a continuation too long for any context is refused, a short one here
        assert found.task == "evalkit_facts" and found.needs < 20
    lengths.check(found, max_model_len=found.needs, overflow=overflow)
    with pytest.raises(Exception, match=f"max_model_len={found.needs - 1} is too short for task {found.task}"):
        lengths.check(found, max_model_len=found.needs - 1, overflow=overflow)


def test_the_line_names_the_prompt_and_the_setting(tokenizer):
    lm, requests = built(tokenizer, num_fewshot=0)  # parity_fewshot without its shots: evalkit_facts is longest
    found = lengths.longest(lm, requests)
    with pytest.raises(Exception) as error:
        lengths.check(found, max_model_len=20, overflow="fail")
    assert str(error.value) == (
        f"max_model_len=20 is too short for task {found.task}: its longest prompt is {found.prompt_tokens} tokens and "
        f"needs max_model_len={found.needs}; pass max_model_len={found.needs} or more, or overflow=truncate_left to "
        "cut prompts from the left")


def test_building_the_requests_first_leaves_the_runs_prompts_as_they_were(tokenizer):
    """simple_evaluate builds them again on the same task objects (its few-shot seed set again): the same prompts."""
    lm, first = built(tokenizer, num_fewshot=2)
    _, second = built(tokenizer, num_fewshot=2)
    assert {t: [i.args for i in v] for t, v in first.items()} == {t: [i.args for i in v] for t, v in second.items()}
    assert first["parity_fewshot"][0].args[0].count("Question:") == 3  # two shots and the question


def test_past_what_the_model_supports_the_fix_is_to_cut_prompts(tokenizer):
    lm, requests = built(tokenizer)
    found = lengths.longest(lm, requests)
    with pytest.raises(Exception) as error:
        lengths.check(found, max_model_len=20, overflow="fail", supported=found.needs - 1)
    assert str(error.value).endswith(f"needs max_model_len={found.needs}, more than the model's {found.needs - 1}; "
                                     "pass overflow=truncate_left to cut prompts from the left")
    lengths.check(found, max_model_len=found.needs, overflow="fail", supported=found.needs - 1)  # it fits: fine



TEXTS = ["", "a", " Question: 12 + 7 =", "ﷺ ﬁ ㎏ ½", "🙂🙂🙂 naïve café", "\n\n\t  spaced   out  ", "x" * 3000,
         "数学の問題です。答えは？", "<|im_start|>user\nHi<|im_end|>", "0123456789" * 40]


def test_the_byte_bound_is_at_least_every_texts_token_count(tokenizer):
    """lengths.token_bound never under-counts: a text it lets pass unencoded fits at least as well as its tokens
    (NFKC-expanding characters, emoji, CJK, the chat markers, long runs of digits and spaces)."""
    lm = harness(tokenizer)
    bound = lengths.token_bound(lm)
    for text in TEXTS:
        for specials in (True, False):
            assert len(lm.engine.encode(text, specials)) <= bound(text), text


@pytest.mark.parametrize("overflow", ["fail", "truncate_left"])
def test_the_check_that_skips_what_surely_fits_refuses_exactly_what_the_full_one_refuses(tokenizer, overflow):
    """With max_model_len given, requests the byte bound shows to fit are not encoded; the check then refuses the
    same settings, naming the same longest request, as encoding every text does."""
    lm, requests = built(tokenizer, overflow=overflow)
    full = lengths.longest(lm, requests)
    for max_model_len in (full.needs - 40, full.needs - 1, full.needs, full.needs + 1, 4096):
        if max_model_len < 1:
            continue
        fresh = harness(tokenizer, overflow=overflow)  # nothing encoded ahead
        found = lengths.longest(fresh, requests, max_model_len)
        assert (found is not None and found.needs > max_model_len) == (full.needs > max_model_len)
        if full.needs > max_model_len:
            assert found == full
    fresh = harness(tokenizer, overflow=overflow)
    lengths.longest(fresh, requests, 4096)
    assert len(fresh.engine.encoded) < 5  # nothing of the tasks' texts needed encoding at 4096
