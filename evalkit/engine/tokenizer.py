"""The tokenizer half of the Engine contract: loaded as lm-eval's vllm backend loads it, and its methods.

vLLM is imported lazily (its ``get_tokenizer``), so a data-parallel pool can keep a tokenizer beside its engines;
the served engine loads the same tokenizer with transformers alone (``hf_tokenizer``), so a client machine needs
no vLLM (tests/engine/served/test_served_client.py holds the ids of both loaders equal).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Sequence

# Files that make a checkpoint's AutoProcessor a processor (not its tokenizer); a local folder with none of
# them, whose model type transformers maps to no processor, has no processor template to find.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.json",
                   "video_preprocessor_config.json")


def load_tokenizer(path: str, *, trust_remote_code: bool, add_bos_token: bool | None, with_vllm: bool = True) -> Any:
    """The tokenizer as lm-eval's vllm backend loads it (vLLM's get_tokenizer; add_bos_token only when set).
    with_vllm=False (the served engine): with transformers alone, where the folder is no Mistral-format one."""
    if not with_vllm and not mistral_format(path):
        return hf_tokenizer(path, trust_remote_code=trust_remote_code, add_bos_token=add_bos_token)
    try:
        import vllm  # noqa: F401
    except ImportError:
        if with_vllm:
            raise
        raise ValueError(f"the tokenizer at {path} is in Mistral's format (tekken.json or tokenizer.model.v*), which "
                         "only vLLM's loader reads: install vLLM beside evalkit, or pass tokenizer= a folder in "
                         "Hugging Face's format") from None
    try:
        from vllm.tokenizers import get_tokenizer
    except ImportError:  # vLLM before the tokenizers package
        from vllm.transformers_utils.tokenizer import get_tokenizer

    extra = {"add_bos_token": add_bos_token} if add_bos_token is not None else {}
    return get_tokenizer(path, trust_remote_code=trust_remote_code, **extra)


def mistral_format(path: str) -> bool:
    """Whether a local folder holds a tokenizer vLLM would load in its mistral mode (tekken.json or
    tokenizer.model.v*, vllm/tokenizers/registry.py 0.32); a hub id is taken to be in Hugging Face's format."""
    folder = Path(path)
    return folder.is_dir() and ((folder / "tekken.json").is_file() or any(folder.glob("tokenizer.model.v*")))


def hf_tokenizer(path: str, *, trust_remote_code: bool, add_bos_token: bool | None) -> Any:
    """What vLLM 0.32's get_tokenizer returns for a Hugging Face tokenizer (tokenizer_mode auto, generate runner),
    with transformers only: AutoTokenizer with truncation on the left, and special tokens lower-cased where a
    sentence-transformers config says do_lower_case. vLLM's CachedTokenizer only caches properties: ids are the
    same."""
    from transformers import AutoTokenizer

    extra = {"add_bos_token": add_bos_token} if add_bos_token is not None else {}
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=None,
                                              truncation_side="left", **extra)
    try:
        lower = json.loads((Path(path) / "sentence_bert_config.json").read_text()).get("do_lower_case", False)
    except (OSError, ValueError, AttributeError):
        lower = False
    if lower:
        tokenizer.add_special_tokens({k: v.lower() for k, v in tokenizer.special_tokens_map.items()})
    return tokenizer


def model_type(path: str) -> str | None:
    """config.json's model_type in a local model folder (None for a hub id or a folder without one)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def processor_template(path: str, *, trust_remote_code: bool) -> str | None:
    """The chat template of the checkpoint's processor (a ProcessorMixin: a multimodal checkpoint's
    chat_template.json or chat_template.jinja), as vLLM's _try_get_processor_chat_template reads it."""
    from transformers import AutoProcessor, ProcessorMixin
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    local = Path(path).is_dir()
    if local and model_type(path) not in PROCESSOR_MAPPING_NAMES and not any(
            (Path(path) / name).is_file() for name in PROCESSOR_FILES):
        return None  # AutoProcessor would load the tokenizer again (about 0.5 s) to find no processor
    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception:  # as vLLM: a checkpoint whose processor does not load has no processor template
        return None
    return processor.chat_template if isinstance(processor, ProcessorMixin) else None


def resolve_chat_template(tokenizer: Any, *, trust_remote_code: bool) -> str | None:
    """The template lm-eval's vllm backend builds chat prompts with: the one vLLM's resolve_chat_template
    (vllm/renderers/hf.py, 0.23 and 0.32) resolves with no template given: the processor's, else the tokenizer's,
    else vLLM's predefined fallback for the model type (read only where vLLM is installed). None: no template.
    tests/engine/test_tokenizer.py holds it equal to vLLM's own on a checkpoint whose processor has its own template."""
    path = tokenizer.name_or_path
    found = processor_template(path, trust_remote_code=trust_remote_code)
    if found is not None:
        return found
    try:
        return tokenizer.get_chat_template(None)
    except ValueError:  # transformers: "Cannot use chat template functions because ... is not set"
        pass
    try:
        from vllm.transformers_utils.chat_templates import get_chat_template_fallback_path
    except ImportError:  # no vLLM (a client machine): no predefined fallback
        return None
    fallback = get_chat_template_fallback_path(model_type=model_type(path) or "", tokenizer_name_or_path=path)
    return vllm_load_chat_template()(fallback) if fallback is not None else None


def vllm_load_chat_template() -> Any:
    """vLLM's ``load_chat_template``, where the installed vLLM keeps it: ``vllm.renderers.chat_utils`` (0.32),
    ``vllm.entrypoints.chat_utils`` before (0.23). A vLLM with neither raises ImportError, never a silent None."""
    try:
        from vllm.renderers.chat_utils import load_chat_template
    except ImportError:
        from vllm.entrypoints.chat_utils import load_chat_template
    return load_chat_template


class TokenizerSide:
    """The tokenizer half of the Engine contract, on ``self.tokenizer`` (one vLLM engine's, or the one a
    data-parallel pool keeps beside its engines)."""

    tokenizer: Any
    trust_remote_code: bool = False  # each engine sets its own: a processor's template may need the model's code
    template_from = "vllm"  # "vllm": as lm-eval's vllm backend resolves it; "tokenizer": its own (lm-eval's hf)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @functools.cached_property
    def _template(self) -> str | None:
        if self.template_from == "tokenizer":
            return getattr(self.tokenizer, "chat_template", None)
        return resolve_chat_template(self.tokenizer, trust_remote_code=self.trust_remote_code)

    def chat_template(self) -> str | None:
        """The template chat prompts are built with (resolved once, on first use), None where there is none."""
        return self._template

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """As lm-eval's vllm backend: the last message is continued when no generation prompt is added (a
        task's ``gen_prefix``), and a template that rejects the system role is retried without it."""
        import jinja2

        options = {"tokenize": False, "add_generation_prompt": add_generation_prompt, "chat_template": self._template,
                   "continue_final_message": not add_generation_prompt, "enable_thinking": None}
        try:
            return self.tokenizer.apply_chat_template(messages, **options)
        except jinja2.exceptions.TemplateError:
            return self.tokenizer.apply_chat_template([m for m in messages if m["role"] != "system"], **options)


class TokenizerOnly(TokenizerSide):
    """The tokenizer half alone, loaded as the engine of cfg.engine would load it but with transformers only (no
    vLLM import): what the harness plans before any engine starts, such as each prompt's length
    (evalkit/harness/lengths.py). It answers no request: it has no generate or score. Each text is encoded once: a
    multiple-choice document's context is encoded for each of its choices."""

    logits_dtype = ""

    def __init__(self, tokenizer: Any, *, max_model_len: int, trust_remote_code: bool, template_from: str) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.trust_remote_code, self.template_from = trust_remote_code, template_from
        self.encoded: dict[tuple[str, bool], list[int]] = {}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        key = (text, add_special_tokens)
        if key not in self.encoded:
            self.encoded[key] = super().encode(text, add_special_tokens)
        return self.encoded[key]
