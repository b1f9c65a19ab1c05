"""engine=hf: the model and its tokenizer, loaded as lm-eval's hf backend loads them, with the stop and pad ids
vLLM would use; and token ids padded into one batch for it. Scoring (``hf/forward.py``) and generation
(``hf/generation.py``) both run on what :func:`load` returns. torch and transformers are imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class Loaded:
    """A model ready for evalkit's requests: its generation_config holds only the bos, eos and pad ids, so
    sampling comes from each request's settings alone, never from the model's generation_config.json."""

    tokenizer: Any
    model: Any
    eos_ids: list[int]  # the tokenizer's and the model's eos ids: vLLM stops on both
    pad_id: int
    device_map: str

    def padded(self, seqs: list[Sequence[int]], *, left: bool) -> tuple[Any, Any]:
        """(input ids, attention mask) of seqs padded to the longest, on the model's device."""
        import torch

        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for n, seq in enumerate(seqs):
            where = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[n, where], mask[n, where] = torch.tensor(seq, dtype=torch.long), 1
        return ids.to(self.model.device), mask.to(self.model.device)


def load(*, model: str, tokenizer: str | None, dtype: str, trust_remote_code: bool, add_bos_token: bool | None,
         engine_kwargs: dict[str, Any]) -> Loaded:
    """The weights at model in dtype (auto: float32 on CPU, the checkpoint's on GPU), on engine_kwargs'
    device_map (the GPU where there is one, else the CPU), and the tokenizer at tokenizer (else model's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    on_gpu = torch.cuda.is_available()
    device_map = engine_kwargs.get("device_map", "cuda" if on_gpu else "cpu")
    wanted = DTYPES.get(dtype, "float32" if not on_gpu else "auto")
    extra = {"add_bos_token": add_bos_token} if add_bos_token is not None else {}
    # as lm-eval's hf backend loads it (HFLM._create_tokenizer)
    loaded_tokenizer = AutoTokenizer.from_pretrained(tokenizer or model, trust_remote_code=trust_remote_code,
                                                     use_fast=True, **extra)
    kwargs = {k: v for k, v in engine_kwargs.items() if k == "attn_implementation"}
    if device_map != "cpu":
        kwargs["device_map"] = device_map
    weights = AutoModelForCausalLM.from_pretrained(
        model, dtype=wanted if wanted == "auto" else getattr(torch, wanted), trust_remote_code=trust_remote_code,
        **kwargs).eval()
    own = weights.generation_config
    eos = [own.eos_token_id] if isinstance(own.eos_token_id, int) else list(own.eos_token_id or [])
    eos_ids = sorted({t for t in (loaded_tokenizer.eos_token_id, *eos) if t is not None})
    pad = loaded_tokenizer.pad_token_id if loaded_tokenizer.pad_token_id is not None else eos_ids[0]
    weights.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=eos_ids,
                                                 pad_token_id=pad)
    return Loaded(tokenizer=loaded_tokenizer, model=weights, eos_ids=eos_ids, pad_id=pad, device_map=device_map)
