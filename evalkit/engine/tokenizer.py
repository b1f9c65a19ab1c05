"""The tokenizer half of the Engine contract: loaded as lm-eval's vllm backend loads it, and its methods.

vLLM is imported lazily (its ``get_tokenizer``), so a data-parallel pool can keep a tokenizer beside its engines.
"""

from __future__ import annotations

from typing import Any, Sequence


def load_tokenizer(path: str, *, trust_remote_code: bool, add_bos_token: bool | None) -> Any:
    """The tokenizer as lm-eval's vllm backend loads it (vLLM's get_tokenizer; add_bos_token only when set)."""
    try:
        from vllm.tokenizers import get_tokenizer
    except ImportError:  # vLLM before the tokenizers package
        from vllm.transformers_utils.tokenizer import get_tokenizer

    extra = {"add_bos_token": add_bos_token} if add_bos_token is not None else {}
    return get_tokenizer(path, trust_remote_code=trust_remote_code, **extra)


class TokenizerSide:
    """The tokenizer half of the Engine contract, on ``self.tokenizer`` (one vLLM engine's, or the one a
    data-parallel pool keeps beside its engines)."""

    tokenizer: Any

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """As lm-eval's vllm backend: the last message is continued when no generation prompt is added (a
        task's ``gen_prefix``), and a template that rejects the system role is retried without it."""
        import jinja2

        options = {"tokenize": False, "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": not add_generation_prompt, "enable_thinking": None}
        try:
            return self.tokenizer.apply_chat_template(messages, **options)
        except jinja2.exceptions.TemplateError:
            return self.tokenizer.apply_chat_template([m for m in messages if m["role"] != "system"], **options)
