"""The engines of ``--locate`` (evalkit/compare/locate/passes.py): each run's engine, set up again from the settings its
results.json records that decide its numbers, with ``--ref-engine``/``--cand-engine key=value ...`` laid over
it, checked before any engine starts, and started and asked for traces with every failure in one line that says
what to pass.

A run folder may come from another machine or team: it is data, never instructions. What runs, what it loads
and where anything is sent comes from this machine and the user's flags: a recorded served endpoint, secret
name, ``trust_remote_code``, hub id, tokenizer or extra engine argument is never adopted, only printed as the
``key=value`` to pass where the user trusts it (docs/security.md).

Apart from locate.py because this is the part that knows configs, model folders and installed libraries; what
locate.py does with an engine once it runs (rebuilding prompts, tracing, explaining) needs none of it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from evalkit.compare.runs import CompareError, Run
from evalkit.contracts import Engine, TokenTrace
from evalkit.errors import ConfigError
from evalkit.untrusted import printable

if TYPE_CHECKING:  # the config schema and OmegaConf are imported where --locate starts engines, not by every compare
    from evalkit.config import EvalConfig

FLAGS = {"reference": "--ref-engine", "candidate": "--cand-engine"}
LIBRARIES = {"vllm": "vllm", "hf": "transformers", "served": "httpx"}  # the module each engine needs
# recorded settings that decide an engine's numbers and nothing else: taken from the run's config as they are
NUMERICS = ("model_name", "dtype", "max_model_len", "max_tokens", "batch_size", "seed", "add_bos_token",
            "tensor_parallel_size", "pipeline_parallel_size", "tune", "gpu_memory_utilization")
LOCAL_ENGINES = ("vllm", "hf")  # engines that run here from installed libraries and a local folder
# recorded settings that decide what runs, what is fetched or where requests go: suggested, never taken
SUGGESTED = ("engine", "endpoint", "trust_remote_code", "tokenizer", "engine_kwargs", "distributed_executor_backend",
             "cluster")


class LocateError(CompareError):
    """An engine for --locate cannot be set up or started; the message says what to pass."""


@dataclass(frozen=True)
class EngineChoice:
    """The engine of one side: the run's recorded config with any overrides, and its model folder."""

    side: str  # reference | candidate
    run: str
    cfg: EvalConfig
    model_dir: str
    not_adopted: tuple[str, ...] = field(default=())  # recorded key=value settings left for the user to pass

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


def local_folder(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and Path(value).is_dir()


def as_overrides(key: str, value: Any) -> list[str]:
    """key=value as a flag takes it, nested keys flattened (engine_kwargs.x=...; + where the schema has no key)."""
    if isinstance(value, dict):
        plus = "+" if key == "engine_kwargs" else ""
        return [f"{plus}{o}" for k, v in value.items() for o in as_overrides(f"{key}.{k}", v)]
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return [f"{key}={text}"]


def adoptable(recorded: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The recorded settings --locate takes (those that decide the engine's numbers, a local engine, a folder
    that exists here) and, as key=value, those it leaves to the user: where they differ from the defaults."""
    from evalkit.config import EvalConfig

    defaults = EvalConfig.__dataclass_fields__
    adopted = {k: recorded[k] for k in NUMERICS if k in recorded}
    if recorded.get("engine") in LOCAL_ENGINES:
        adopted["engine"] = recorded["engine"]
    for key in ("vllm_path", "tokenizer"):  # read here only where a folder of this machine; never a hub id
        if local_folder(recorded.get(key)):
            adopted[key] = recorded[key]
    suggested: list[str] = []
    for key in SUGGESTED:
        if key in recorded and key not in adopted:
            default = defaults[key].default_factory() if callable(defaults[key].default_factory) else \
                defaults[key].default
            default = vars(default) if hasattr(default, "__dataclass_fields__") else default
            value = recorded[key]
            if isinstance(value, dict) and isinstance(default, dict):
                value = {k: v for k, v in value.items() if default.get(k, object()) != v}
            if value != default and value not in (None, {}):
                suggested += as_overrides(key, value)
    return adopted, tuple(suggested)


def config_from(recorded: dict[str, Any], overrides: Sequence[str], flag: str) -> EvalConfig:
    """The user's defaults, the recorded settings --locate adopts (adoptable) and key=value overrides (Hydra's
    syntax, a leading + allowed) over them, checked."""
    from omegaconf import OmegaConf

    from evalkit.config import EvalConfig, closest, schema_keys, validate

    keys = schema_keys()
    dotlist = [o.lstrip("+") for o in overrides]
    for item in dotlist:
        head = item.split("=", 1)[0].split(".", 1)[0]
        if "=" not in item:
            raise LocateError(f"{flag} {item!r}: expected key=value, e.g. {flag} vllm_path=/path/to/model")
        if head not in keys:
            raise LocateError(f"{flag}: unknown config key {head!r}{closest(head, keys)}; see evalkit/config.py")
    # vllm_path is checked here only: model_folder decides which folder loads
    stand_in = {"vllm_path": recorded["vllm_path"]} if isinstance(recorded.get("vllm_path"), str) else {}
    given = {item.split("=", 1)[0] for item in dotlist}
    taken = {k: v for k, v in {**stand_in, **adoptable(recorded)[0]}.items() if k not in given}
    for key, value in taken.items():  # OmegaConf would resolve ${oc.env:HF_TOKEN} into the config, and the errors
        if "${" in str(value):
            raise LocateError(f"{flag}: the run records {key}={printable(value)}, an interpolation; --locate "
                              "resolves nothing a run folder records: pass the value itself, "
                              f"{flag} {key}=VALUE")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(EvalConfig), taken, OmegaConf.from_dotlist(dotlist))
        cfg = OmegaConf.to_object(merged)
        validate(cfg)
    except ConfigError as error:
        raise LocateError(f"{flag}: {error}") from None
    except Exception as error:  # OmegaConf's type errors are several lines: keep the first
        raise LocateError(f"{flag}: {str(error).splitlines()[0]}") from None
    # one engine is enough for a few prefills; a trace keeps no answers (a served run needs no endpoint.deployment)
    return replace(cfg, data_parallel_size=1, resume=False)


def model_folder(cfg: EvalConfig, recorded: str | None, *, overridden: bool, side: str, run: str) -> str:
    """The folder to load: the recorded one while it is a folder of this machine, else vllm_path resolved again
    (an embedded model, or a path given with the flag); a one-line LocateError saying what to pass otherwise.
    A hub id the run names is never fetched on its word: the user passes it."""
    from evalkit.engine.machine import model_download, preflight

    flag = FLAGS[side]
    if not overridden and local_folder(recorded):
        return recorded
    if overridden or model_download.is_embedded(cfg.vllm_path):
        try:
            return preflight.resolve_model_path(cfg.vllm_path)
        except ConfigError as error:
            raise LocateError(f"{side} engine: {error} (pass {flag} vllm_path=/path/to/model)") from None
    if not isinstance(recorded, str) or not recorded:
        where = "results.json records no model folder"
    elif Path(recorded).is_absolute():
        where = f"its model folder {printable(recorded)} does not exist"
    else:
        where = (f"it names {printable(recorded)}, no folder here, which --locate does not fetch on a run folder's "
                 f"word (pass {flag} vllm_path={printable(recorded)} to fetch it)")
    raise LocateError(f"{side} run {printable(run)}: {where} (moved, or a run from another machine); "
                      f"pass {flag} vllm_path=/path/to/model")


def engine_choice(run: Run, overrides: Sequence[str], *, side: str) -> EngineChoice:
    """The checked engine of one side, nothing started: a bad setting fails here, in one line."""
    flag, section = FLAGS[side], run.results.get("evalkit") or {}
    if not section.get("config"):
        raise LocateError(f"{side} run {printable(run.name)}: results.json records no evalkit.config to start its "
                          "engine from; "
                          "rerun it with this evalkit")
    recorded = section["config"] if isinstance(section["config"], dict) else {}
    cfg = config_from(recorded, overrides, flag)
    overridden = any(o.lstrip("+").startswith("vllm_path=") for o in overrides)
    model_dir = model_folder(cfg, (section.get("engine") or {}).get("model_dir"), overridden=overridden,
                             side=side, run=run.name)
    library = LIBRARIES.get(cfg.engine, cfg.engine)
    if importlib.util.find_spec(library) is None:
        others = " or ".join(f"{flag} engine={e}" for e in LIBRARIES if e != cfg.engine)
        raise LocateError(f"{side} engine: engine={cfg.engine} needs {library}, which is not installed here; install "
                          f"it or pass {others}")
    given = {o.lstrip("+").split("=", 1)[0] for o in overrides}
    left = tuple(o for o in adoptable(recorded)[1] if o.lstrip("+").split("=", 1)[0] not in given)
    return EngineChoice(side=side, run=run.name, cfg=cfg, model_dir=model_dir, not_adopted=left)


def advice(choice: EngineChoice) -> str | None:
    """One line (after the command's name) naming the recorded settings --locate left out, as the flag that would
    pass them, each quoted for the shell (a recorded $(...) pasted runs nothing); None if none."""
    import shlex

    if not choice.not_adopted:
        return None
    return (f"the {choice.side} run {printable(choice.run)} recorded settings --locate does not take "
            f"from a run folder; if you trust them, pass {choice.flag} "
            f"{' '.join(printable(shlex.quote(o)) for o in choice.not_adopted)}")


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
