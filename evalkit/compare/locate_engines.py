"""The engines of ``--locate`` (evalkit/compare/locate.py): each run's engine, set up again from the config its
results.json records, with ``--ref-engine``/``--cand-engine key=value ...`` laid over it, checked before any
engine starts, and started and asked for traces with every failure in one line that says what to pass.

Apart from locate.py because this is the part that knows configs, model folders and installed libraries; what
locate.py does with an engine once it runs (rebuilding prompts, tracing, explaining) needs none of it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from evalkit.compare.runs import CompareError, Run
from evalkit.config import ConfigError, EvalConfig, closest, schema_keys, validate
from evalkit.contracts import Engine, TokenTrace

FLAGS = {"reference": "--ref-engine", "candidate": "--cand-engine"}
LIBRARIES = {"vllm": "vllm", "hf": "transformers", "served": "httpx"}  # the module each engine needs


class LocateError(CompareError):
    """An engine for --locate cannot be set up or started; the message says what to pass."""


@dataclass(frozen=True)
class EngineChoice:
    """The engine of one side: the run's recorded config with any overrides, and its model folder."""

    side: str  # reference | candidate
    run: str
    cfg: EvalConfig
    model_dir: str

    @property
    def flag(self) -> str:
        return FLAGS[self.side]

    def describe(self) -> str:
        return f"{self.cfg.engine}, dtype={self.cfg.dtype}, {self.model_dir}"

    def settings(self) -> str:
        """What decides the engine's numbers: equal settings give the same traces, so one engine serves both."""
        cfg = self.cfg
        return repr((cfg.engine, self.model_dir, cfg.tokenizer, cfg.dtype, cfg.max_model_len, cfg.batch_size,
                     cfg.seed, cfg.trust_remote_code, cfg.add_bos_token, cfg.tensor_parallel_size,
                     cfg.pipeline_parallel_size, sorted(cfg.engine_kwargs.items()), cfg.tune))


def config_from(recorded: dict[str, Any], overrides: Sequence[str], flag: str) -> EvalConfig:
    """The recorded config with key=value overrides (Hydra's syntax, a leading + allowed), checked."""
    from omegaconf import OmegaConf

    keys = schema_keys()
    dotlist = [o.lstrip("+") for o in overrides]
    for item in dotlist:
        head = item.split("=", 1)[0].split(".", 1)[0]
        if "=" not in item:
            raise LocateError(f"{flag} {item!r}: expected key=value, e.g. {flag} vllm_path=/path/to/model")
        if head not in keys:
            raise LocateError(f"{flag}: unknown config key {head!r}{closest(head, keys)}; see evalkit/config.py")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(EvalConfig), {k: v for k, v in recorded.items() if k in keys},
                                 OmegaConf.from_dotlist(dotlist))
        cfg = OmegaConf.to_object(merged)
        validate(cfg)
    except ConfigError as error:
        raise LocateError(f"{flag}: {error}") from None
    except Exception as error:  # OmegaConf's type errors are several lines: keep the first
        raise LocateError(f"{flag}: {str(error).splitlines()[0]}") from None
    # one engine is enough for a few prefills; a trace keeps no answers (a served run needs no endpoint.deployment)
    return replace(cfg, data_parallel_size=1, resume=False)


def model_folder(cfg: EvalConfig, recorded: str | None, *, overridden: bool, side: str, run: str) -> str:
    """The folder to load: the recorded one while it exists, else vllm_path resolved again (an embedded
    model, or a path given with the flag); a one-line LocateError saying what to pass otherwise."""
    from evalkit.engine.machine import embedded, preflight

    flag = FLAGS[side]
    if not overridden and recorded and (Path(recorded).is_dir() or not Path(recorded).is_absolute()):
        return recorded  # a local folder, or a hub id vLLM fetches itself
    if overridden or embedded.is_embedded(cfg.vllm_path):
        try:
            return preflight.resolve_model_path(cfg.vllm_path)
        except ConfigError as error:
            raise LocateError(f"{side} engine: {error} (pass {flag} vllm_path=/path/to/model)") from None
    where = f"its model folder {recorded} does not exist" if recorded else "results.json records no model folder"
    raise LocateError(f"{side} run {run}: {where} (moved, or a run from another machine); "
                      f"pass {flag} vllm_path=/path/to/model")


def engine_choice(run: Run, overrides: Sequence[str], *, side: str) -> EngineChoice:
    """The checked engine of one side, nothing started: a bad setting fails here, in one line."""
    flag, section = FLAGS[side], run.results.get("evalkit") or {}
    if not section.get("config"):
        raise LocateError(f"{side} run {run.name}: results.json records no evalkit.config to start its engine from; "
                          "rerun it with this evalkit")
    cfg = config_from(section["config"], overrides, flag)
    overridden = any(o.lstrip("+").startswith("vllm_path=") for o in overrides)
    model_dir = model_folder(cfg, (section.get("engine") or {}).get("model_dir"), overridden=overridden,
                             side=side, run=run.name)
    library = LIBRARIES.get(cfg.engine, cfg.engine)
    if importlib.util.find_spec(library) is None:
        others = " or ".join(f"{flag} engine={e}" for e in LIBRARIES if e != cfg.engine)
        raise LocateError(f"{side} engine: engine={cfg.engine} needs {library}, which is not installed here; install "
                          f"it or pass {others}")
    return EngineChoice(side=side, run=run.name, cfg=cfg, model_dir=model_dir)


def start(choice: EngineChoice) -> Engine:
    from evalkit.engine.factory import start_engines

    try:
        engine = start_engines(choice.cfg, choice.model_dir)
    except Exception as error:
        raise LocateError(f"the {choice.side} engine ({choice.describe()}) did not start ({_first_line(error)}); "
                          f"pass {choice.flag} key=value settings it starts with, e.g. "
                          f"{choice.flag} gpu_memory_utilization=0.5") from error
    started = engine.describe().get("name")
    if started != choice.cfg.engine:  # start_engines does not know this engine: never trace with another one
        engine.close()
        raise LocateError(f"{choice.side} engine: engine={choice.cfg.engine} started {started} instead; pass "
                          f"{choice.flag} engine={started} or use an evalkit that starts {choice.cfg.engine}")
    return engine


def trace(choice: EngineChoice, engine: Engine, requests: list[Any], top_k: int) -> list[TokenTrace]:
    try:
        return engine.trace(requests, top_k)
    except Exception as error:
        raise LocateError(f"the {choice.side} engine ({choice.describe()}) could not teacher-force the outputs "
                          f"({_first_line(error)})") from error


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
