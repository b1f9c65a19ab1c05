"""The length budget: how many tokens a request may generate, and what happens to a prompt that does not fit.

lm-eval's vLLM backend left-truncates every prompt to ``max_model_len - max_gen_toks``, which is negative
with evalkit's defaults (4096 and 16384) and silently empties the prompt. Here each request instead gets
``min(requested, max_model_len - prompt_tokens)`` new tokens, and a prompt that leaves no room is handled
by an explicit policy: ``fail`` (the default) or ``truncate_left``. Every clamp and truncation is reported.
Pure functions, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


class PromptTooLong(ValueError):
    """A prompt does not fit max_model_len and the overflow policy is "fail"."""


@dataclass(frozen=True)
class GenBudget:
    keep_from: int  # first prompt token kept (non-zero only when truncated)
    max_tokens: int  # new tokens the engine may produce
    clamped: bool  # max_tokens < requested because of max_model_len

    @property
    def truncated(self) -> int:
        return self.keep_from


def plan_generation(
    *, prompt_tokens: int, requested: int, max_model_len: int, min_gen_tokens: int, overflow: str
) -> GenBudget:
    """Budget for one generation request of prompt_tokens asking for up to requested new tokens."""
    need = min(min_gen_tokens, requested)
    room = max_model_len - prompt_tokens
    if room >= need:
        return GenBudget(keep_from=0, max_tokens=min(requested, room), clamped=room < requested)
    if overflow != "truncate_left":
        raise PromptTooLong(
            f"a prompt of {prompt_tokens} tokens leaves {room} of the {need} new tokens it needs within "
            f"max_model_len={max_model_len}; raise max_model_len, or set overflow=truncate_left"
        )
    keep = max_model_len - need
    return GenBudget(keep_from=prompt_tokens - keep, max_tokens=need, clamped=need < requested)


def plan_score(*, context_tokens: int, continuation_tokens: int, max_model_len: int, overflow: str) -> int:
    """Context tokens to drop from the left so that context + continuation fit; 0 when they fit.

    The continuation is never cut: its log-likelihood is what is being measured. vLLM needs one free
    position after the prompt, hence ``max_model_len - 1``.
    """
    limit = max_model_len - 1
    total = context_tokens + continuation_tokens
    if total <= limit:
        return 0
    if overflow != "truncate_left" or continuation_tokens >= limit:
        raise PromptTooLong(
            f"context ({context_tokens} tokens) + continuation ({continuation_tokens}) exceed "
            f"max_model_len-1={limit}; raise max_model_len"
            + ("" if overflow == "truncate_left" else ", or set overflow=truncate_left")
        )
    return total - limit


def generation_needs(*, prompt_tokens: int, requested: int, min_gen_tokens: int, overflow: str) -> int:
    """The least max_model_len at which plan_generation plans this request without PromptTooLong."""
    need = min(min_gen_tokens, requested)
    return need if overflow == "truncate_left" else prompt_tokens + need


def score_needs(*, context_tokens: int, continuation_tokens: int, overflow: str) -> int:
    """The least max_model_len at which plan_score plans this pair without PromptTooLong."""
    whole = context_tokens + continuation_tokens + 1
    return min(whole, continuation_tokens + 2) if overflow == "truncate_left" else whole
