"""Each prompt's length against max_model_len, before any engine starts.

A prompt that does not fit the engine's context fails the run (``overflow=fail``) where the harness plans it
(``budget.py``), which is after the engine started: minutes lost, on a GPU cluster often more. Here lm-eval builds
every request of the run's tasks as ``simple_evaluate`` will build them (the run's ``num_fewshot``, few-shot seed,
``limit``, system instruction and chat template), the model's own tokenizer (loaded without the engine) encodes
each as :class:`~evalkit.harness.lm.EvalkitLM` encodes it, and the budget's own rule (``generation_needs``,
``score_needs``) gives the least ``max_model_len`` each request needs. With ``overflow=truncate_left`` a prompt is
cut from the left as the run would cut it, so only a continuation (or ``min_gen_tokens``) that cannot fit fails. A
rolling (perplexity) text never fails: it is cut into windows.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, Callable

from evalkit.config import ConfigError
from evalkit.harness.budget import generation_needs, score_needs
from evalkit.harness.generate_until import generation_settings
from evalkit.harness.lm import EvalkitLM
from evalkit.harness.lm_eval_compat import encode_pairs


@dataclass(frozen=True)
class Longest:
    """The request of a run that needs the longest context."""

    task: str
    prompt_tokens: int  # its prompt: the context of a generation, context + continuation of a scored pair
    needs: int  # the least max_model_len at which the budget plans it


def build_requests(lm: EvalkitLM, leaves: dict[str, Any], *, limit: int | float | None,
                   samples: dict[str, list[int]] | None, num_fewshot: int | None, fewshot_seed: int,
                   system_instruction: str | None, apply_chat_template: bool,
                   fewshot_as_multiturn: bool) -> dict[str, list[Any]]:
    """Each leaf task's lm-eval instances (leaves: the TaskManager's load of the run's tasks, groups expanded), built
    as simple_evaluate and lm-eval's evaluate build them (lm-eval 0.4.13, evaluator.py: the num_fewshot override,
    except where a task's config says 0; the few-shot seed; get_sample_size for limit; samples). Its progress
    bars are not shown: the run shows them when it builds the same requests."""
    from lm_eval.evaluator_utils import get_sample_size

    built = {}
    for name, task in leaves.items():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif num_fewshot is None and task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=fewshot_seed)
        with contextlib.redirect_stderr(io.StringIO()):  # lm-eval's tqdm bar, one per task
            task.build_all_requests(
                limit=get_sample_size(task, limit), samples=(samples or {}).get(name), rank=0, world_size=1,
                cache_requests=False, rewrite_requests_cache=False, system_instruction=system_instruction,
                apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn,
                chat_template=lm.apply_chat_template if apply_chat_template else None,
                tokenizer_name=lm.tokenizer_name if apply_chat_template else "")
        built[name] = list(task.instances)
    return built


def token_bound(lm: EvalkitLM) -> Callable[[str], int] | None:
    """A bound on the tokens a text encodes to, without encoding it: the UTF-8 bytes of the text as the tokenizer's
    normalizer leaves it (NFKC can lengthen a text), plus the special tokens an encoding adds, plus 2 (a prefix
    space or ▁ a pre-tokenizer adds, an empty context's prefix token). Every model of a fast (Rust) tokenizer
    (byte-level or byte-fallback BPE, Unigram, WordPiece, WordLevel) gives each token at least one byte of the
    normalized text, or stands for one added token whose text has at least one. None for a tokenizer without a
    Rust backend: each of its texts is encoded."""
    backend = getattr(getattr(lm.engine, "tokenizer", None), "backend_tokenizer", None)
    if backend is None:
        return None
    normalizer = backend.normalizer
    extra = len(lm.engine.encode("", True)) + 2
    if normalizer is None:
        return lambda text: len(text.encode("utf-8")) + extra
    return lambda text: len(normalizer.normalize_str(text).encode("utf-8")) + extra


def longest(lm: EvalkitLM, requests: dict[str, list[Any]], max_model_len: int | None = None) -> Longest | None:
    """The request that needs the longest context, encoded and budgeted as lm's own calls would (None: no
    request that can fail). max_model_len: a request that :func:`token_bound` shows fits it is not encoded (on a
    task of MMLU's size most are not): the one returned is the longest of those that might not fit."""
    plan = lm.generations
    eos = lm.engine.decode([lm.eot_token_id])
    bound = token_bound(lm) if max_model_len is not None else None
    found: Longest | None = None
    for task, instances in requests.items():
        if bound is not None:  # needs <= bound + 1 for a pair, either overflow (budget.score_needs)
            instances = [i for i in instances
                         if i.request_type != "loglikelihood" or bound("".join(i.args)) + 1 > max_model_len]
        pairs = encode_pairs(lm, [i for i in instances if i.request_type == "loglikelihood"])
        for _, context, continuation in pairs:
            needs = score_needs(context_tokens=len(context), continuation_tokens=len(continuation),
                                overflow=lm.overflow)
            if found is None or needs > found.needs:
                found = Longest(task, len(context) + len(continuation), needs)
        for instance in (i for i in instances if i.request_type == "generate_until"):
            context, gen_kwargs = instance.args
            _, _, requested = generation_settings(gen_kwargs, eos=eos, max_tokens=plan.max_tokens,
                                                  temperature=plan.temperature, sampling_kwargs=plan.sampling_kwargs)
            if bound is not None and generation_needs(prompt_tokens=bound(context), requested=requested,
                                                      min_gen_tokens=plan.min_gen_tokens,
                                                      overflow=lm.overflow) <= max_model_len:
                continue  # fits, whatever its exact count
            prompt = len(lm.tok_encode(context))
            needs = generation_needs(prompt_tokens=prompt, requested=requested, min_gen_tokens=plan.min_gen_tokens,
                                     overflow=lm.overflow)
            if found is None or needs > found.needs:
                found = Longest(task, prompt, needs)
    return found


def check(found: Longest | None, *, max_model_len: int, overflow: str, supported: int | None = None) -> None:
    """One ConfigError where a request does not fit max_model_len, with the setting that makes it fit (supported:
    the longest context the model states, past which no max_model_len is the fix)."""
    if found is None or found.needs <= max_model_len:
        return
    if supported is not None and found.needs > supported and overflow != "truncate_left":
        raise ConfigError(f"max_model_len={max_model_len} is too short for task {found.task}: its longest prompt is "
                          f"{found.prompt_tokens} tokens and needs max_model_len={found.needs}, more than the model's "
                          f"{supported}; pass overflow=truncate_left to cut prompts from the left")
    if overflow == "truncate_left":
        raise ConfigError(f"max_model_len={max_model_len} is too short for task {found.task} even with prompts cut "
                          f"from the left: a request needs max_model_len={found.needs}; pass "
                          f"max_model_len={found.needs} or more")
    raise ConfigError(f"max_model_len={max_model_len} is too short for task {found.task}: its longest prompt is "
                      f"{found.prompt_tokens} tokens and needs max_model_len={found.needs}; pass "
                      f"max_model_len={found.needs} or more, or overflow=truncate_left to cut prompts from the left")
