"""What a run checks of its documents and requests before the engine starts: the documents samples= names, each
request against max_model_len (evalkit/harness/lengths.py), and the metadata every task gets; and lm-eval's LM over
an engine with the run's settings, for the check and for the run alike.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from evalkit.config import ConfigError, EvalConfig, closest
from evalkit.contracts import Engine
from evalkit.engine.machine import preflight
from evalkit.engine.tokenizer import TokenizerOnly, load_tokenizer
from evalkit.harness import lengths
from evalkit.harness.lm import EvalkitLM
from evalkit.run import gate

log = logging.getLogger("evalkit")


def lm_eval_limit(limit: float | None) -> int | float | None:
    """limit= as simple_evaluate takes it: a whole number of documents as an int, a fraction as it is."""
    return int(limit) if limit is not None and limit >= 1 else limit


def task_metadata(cfg: EvalConfig, model_dir: str) -> dict[str, Any]:
    """What every task's metadata gets (lm-eval's --metadata): the weights' folder as pretrained and the tokenizer
    where set, as lm-eval adds its model_args, then the run's own metadata over them."""
    return {"pretrained": model_dir, **({"tokenizer": cfg.tokenizer} if cfg.tokenizer else {}), **cfg.metadata}


def selected_documents(samples: dict[str, list[int]]) -> dict[str, gate.Indices] | None:
    """samples= as lm-eval's simple_evaluate takes it (None: none named), each task's indices in order and once:
    lm-eval evaluates the documents whose index is listed, in the task's order, and numbers their samples by the
    list's order."""
    return None if not samples else {task: gate.Indices(sorted(set(v))) for task, v in samples.items()}


def check_samples(samples: dict[str, list[int]], leaves: dict[str, Any]) -> None:
    """Each task samples= names is one the run evaluates, each index one of its documents (lm-eval asserts it when
    it builds the requests, after the engine started)."""
    for task, indices in samples.items():
        if task not in leaves:
            near = closest(task, list(leaves), n=1) or f" (its tasks: {', '.join(leaves)})"
            raise ConfigError(f"samples.{task}: the run evaluates no task {task!r}{near}")
        documents = len(leaves[task].eval_docs)
        if max(indices) >= documents:
            raise ConfigError(f"samples.{task}: document {max(indices)} is past the task's {documents} documents "
                              f"(0 to {documents - 1})")


def harness_lm(cfg: EvalConfig, engine: Engine, **extra: Any) -> EvalkitLM:
    """lm-eval's LM over engine with the run's settings (extra: what only the run's own needs)."""
    return EvalkitLM(engine, model_name=cfg.model_name, max_tokens=cfg.max_tokens, add_bos_token=cfg.add_bos_token,
                     temperature=cfg.temperature, sampling_kwargs=dict(cfg.sampling_kwargs),
                     min_gen_tokens=cfg.min_gen_tokens, overflow=cfg.overflow, strip_thinking=cfg.strip_thinking,
                     thinking_end=cfg.thinking_end, **extra)


def chat_template(cfg: EvalConfig, lm: EvalkitLM) -> str | None:
    """The chat template the run's prompts are made with (None without apply_chat_template); a ConfigError where
    apply_chat_template=true and the model has none (a base model), before transformers' ValueError."""
    template = lm.chat_template(cfg.apply_chat_template) if cfg.apply_chat_template else None
    if cfg.apply_chat_template and template is None:
        raise ConfigError(f"apply_chat_template=true, but {cfg.model_name} has no chat template (not in its processor, "
                          "its tokenizer or vLLM's fallbacks); leave apply_chat_template=false for a base model")
    return template


def lengths_checked(cfg: EvalConfig) -> bool:
    """Whether the run's prompts are checked against max_model_len before the engine (check_lengths). Not a served
    engine's, whose tokenizer is its server's, nor an Ascend machine's: transformers asks torch.npu whether an NPU
    is there when it loads a tokenizer, and nothing may call the NPU runtime before the engine starts (its workers
    would inherit it). Their prompts are checked where the run plans them."""
    from evalkit.config import installed_vllm_build

    return cfg.engine != "served" and installed_vllm_build() != "ascend"


def check_lengths(cfg: EvalConfig, model_dir: str, leaves: dict[str, Any]) -> None:
    """Every request of the run against max_model_len, in one line before the engine starts
    (evalkit/harness/lengths.py), with the model's tokenizer loaded without it, where lengths_checked; a folder
    whose tokenizer does not load here is the engine's to report, where the run plans its prompts."""
    if not lengths_checked(cfg):
        return
    try:
        tokenizer = load_tokenizer(cfg.tokenizer or model_dir, trust_remote_code=cfg.trust_remote_code,
                                   add_bos_token=cfg.add_bos_token, with_vllm=False)
    except (OSError, ValueError) as error:
        log.debug("prompts not checked before the engine: the tokenizer did not load (%s)", error)
        return
    side = TokenizerOnly(tokenizer, max_model_len=cfg.max_model_len, trust_remote_code=cfg.trust_remote_code,
                         template_from="tokenizer" if cfg.engine == "hf" else "vllm")
    lm = harness_lm(cfg, side)
    chat_template(cfg, lm)
    requests = lengths.build_requests(
        lm, leaves, limit=lm_eval_limit(cfg.limit), samples=selected_documents(cfg.samples),
        num_fewshot=cfg.num_fewshot, fewshot_seed=cfg.task_seeds.fewshot,
        system_instruction=cfg.system_instruction, apply_chat_template=cfg.apply_chat_template,
        fewshot_as_multiturn=cfg.fewshot_as_multiturn)
    stated = preflight.model_context_length(model_dir) if Path(model_dir).is_dir() else None
    lengths.check(lengths.longest(lm, requests, cfg.max_model_len), max_model_len=cfg.max_model_len,
                  overflow=cfg.overflow, supported=stated[0] if stated else None)
