"""The length budget (evalkit/harness/budget.py). Run: pytest tests/test_budget.py"""

import pytest

from evalkit.harness.budget import PromptTooLong, plan_generation, plan_score


def plan(prompt, requested, max_len=4096, min_gen=1, overflow="fail"):
    return plan_generation(prompt_tokens=prompt, requested=requested, max_model_len=max_len,
                           min_gen_tokens=min_gen, overflow=overflow)


def test_defaults_clamp_instead_of_emptying_the_prompt():
    # lm-eval's vLLM backend would keep max_model_len - max_gen_toks = 4096 - 16384 < 0 prompt tokens.
    p = plan(1000, 16384)
    assert (p.keep_from, p.max_tokens, p.clamped) == (0, 3096, True)


def test_request_that_fits_is_untouched():
    p = plan(1000, 256)
    assert (p.keep_from, p.max_tokens, p.clamped) == (0, 256, False)


def test_exact_fit_and_one_over():
    assert plan(4095, 10).max_tokens == 1
    with pytest.raises(PromptTooLong, match="overflow=truncate_left"):
        plan(4096, 10)


def test_min_gen_tokens_is_capped_by_the_request():
    assert plan(4090, 4, min_gen=100).max_tokens == 4  # asks for 4, 6 fit
    with pytest.raises(PromptTooLong):
        plan(4090, 256, min_gen=100)


def test_truncate_left_keeps_the_end_of_the_prompt():
    p = plan(5000, 16384, min_gen=96, overflow="truncate_left")
    assert p.keep_from == 5000 - (4096 - 96)
    assert p.max_tokens == 96 and p.truncated == p.keep_from and p.clamped


def test_score_fits_within_max_model_len_minus_one():
    assert plan_score(context_tokens=4000, continuation_tokens=95, max_model_len=4096, overflow="fail") == 0
    with pytest.raises(PromptTooLong):
        plan_score(context_tokens=4000, continuation_tokens=96, max_model_len=4096, overflow="fail")
    assert plan_score(context_tokens=4000, continuation_tokens=96, max_model_len=4096, overflow="truncate_left") == 1


def test_continuation_is_never_cut():
    with pytest.raises(PromptTooLong):
        plan_score(context_tokens=10, continuation_tokens=4095, max_model_len=4096, overflow="truncate_left")


@pytest.mark.parametrize("overflow", ["fail", "truncate_left"])
def test_the_needs_are_the_least_max_model_len_each_plan_takes(overflow):
    """budget.generation_needs and score_needs (what the check before the engine reports) against the plans."""
    from evalkit.harness.budget import generation_needs, score_needs

    for prompt, requested, min_gen in [(0, 5, 1), (7, 5, 3), (30, 2, 8), (100, 256, 16)]:
        needs = generation_needs(prompt_tokens=prompt, requested=requested, min_gen_tokens=min_gen, overflow=overflow)
        plan(prompt, requested, max_len=needs, min_gen=min_gen, overflow=overflow)
        if overflow == "fail":
            with pytest.raises(PromptTooLong):
                plan(prompt, requested, max_len=needs - 1, min_gen=min_gen, overflow=overflow)
    for context, continuation in [(0, 1), (1, 1), (40, 3), (500, 60)]:
        needs = score_needs(context_tokens=context, continuation_tokens=continuation, overflow=overflow)
        plan_score(context_tokens=context, continuation_tokens=continuation, max_model_len=needs, overflow=overflow)
        with pytest.raises(PromptTooLong):
            plan_score(context_tokens=context, continuation_tokens=continuation, max_model_len=needs - 1,
                       overflow=overflow)
