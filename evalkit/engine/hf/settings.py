"""vLLM's settings on HF transformers (``engine=hf``): sampling mapped onto HF generation, and what HF cannot
honour refused before the model loads. Stop strings and stop tokens are cut in ``hf/generation.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evalkit.config import ConfigError

ENGINE_KWARGS = ("device_map", "attn_implementation")  # the engine_kwargs that reach from_pretrained
IGNORED_KWARGS = ("enforce_eager",)  # vLLM's, set by the OOM back-off (evalkit/run/supervise.py): nothing to do here
MAPPED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop_token_ids",
          "skip_special_tokens", "spaces_between_special_tokens")  # the vLLM sampling settings honoured here
# vLLM sampling settings HF generation has no equivalent for: accepted only at vLLM's neutral default (None: empty)
NEUTRAL = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "ignore_eos": False,
           "include_stop_str_in_output": False, "detokenize": True, **dict.fromkeys((
               "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words", "watermarking",
               "structured_outputs", "extra_args", "thinking_token_budget", "repetition_detection"))}
SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


@dataclass(frozen=True)
class Sampling:
    """One request's vLLM sampling settings as HF generation takes them."""

    options: tuple[tuple[str, Any], ...]  # GenerationConfig fields
    seed: int | None = None  # a request's own seed: its draws depend on nothing else
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def sampling_for_hf(settings: dict[str, Any]) -> Sampling:
    """vLLM SamplingParams settings (vLLM's defaults where absent) mapped onto HF generation; a ConfigError
    names the first setting HF cannot honour. Nothing comes from the model's generation_config.json (HFEngine
    sets it aside), as vLLM does not apply it to the explicit SamplingParams evalkit sends."""
    s = dict(settings)
    for name, value in s.items():
        neutral = name in NEUTRAL and (value == NEUTRAL[name] if NEUTRAL[name] is not None else not value)
        if name not in MAPPED and not neutral:
            raise ConfigError(f"the hf engine cannot honour the sampling setting {name}={value!r} (HF generation has "
                              "no equivalent): remove it from sampling_kwargs or the task's generation_kwargs, "
                              "or run engine=vllm")
    temperature = float(s.get("temperature", 1.0))
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} must be 0 or more")
    options: dict[str, Any] = {"do_sample": temperature >= SAMPLING_EPS,
                               "repetition_penalty": float(s.get("repetition_penalty", 1.0))}
    if options["do_sample"]:  # vLLM's top_k 0 or -1 is "all": HF's 0 (its own default would be 50)
        options.update(temperature=temperature, top_p=float(s.get("top_p", 1.0)),
                       top_k=max(int(s.get("top_k", 0) or 0), 0), min_p=float(s.get("min_p", 0.0)))
    seed = s.get("seed")
    return Sampling(options=tuple(sorted(options.items())), seed=None if seed is None else int(seed),
                    stop_token_ids=tuple(s.get("stop_token_ids") or ()),
                    skip_special_tokens=bool(s.get("skip_special_tokens", True)),
                    spaces_between_special_tokens=bool(s.get("spaces_between_special_tokens", True)))


def check_settings(*, engine_kwargs: dict[str, Any], sampling_kwargs: dict[str, Any], tensor_parallel_size: int,
                   pipeline_parallel_size: int) -> None:
    """What can be refused before the model loads, one ConfigError line each."""
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        if value != 1:
            raise ConfigError(f"{name}={value} is vLLM's; the hf engine spreads a model over GPUs with "
                              f"+engine_kwargs.device_map=auto: pass {name}=1")
    for name in engine_kwargs:
        if name not in ENGINE_KWARGS + IGNORED_KWARGS:
            raise ConfigError(f"engine_kwargs.{name} is not an argument of the hf engine (it takes "
                              f"{', '.join(ENGINE_KWARGS)}): remove it, or run engine=vllm")
    sampling_for_hf(sampling_kwargs)

