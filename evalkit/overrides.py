"""The command line's ``key=value`` overrides, checked against the schema before Hydra composes them.

Hydra refuses a mistyped key or a value of the wrong type too, but in six lines, with exit 1, and for a
mistyped nested key it suggests ``+key=``, which would not work either. Here each mistake is one
:class:`~evalkit.errors.ConfigError` naming the key and the closest valid key or value. Every value of a sweep
(``dtype=a,b``) is checked; ``+``/``~`` overrides, ``hydra*`` keys, interpolations (``${...}``) and what Hydra
cannot parse are left to Hydra.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

from evalkit.config import (DTYPES, ENGINES, OVERFLOW_POLICIES, ConfigError, EvalConfig, closest, model_presets,
                            not_one_of)

CHOICES = {"dtype": DTYPES, "engine": ENGINES, "overflow": OVERFLOW_POLICIES}  # for "did you mean" on a value
NUMBERS = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
           "nine": 9, "ten": 10, "sixteen": 16, "thirty-two": 32, "sixty-four": 64}
GROUPS = ["model"]  # config groups: top-level keys that are no field of the schema
# lm-eval's flags and model_args, as users type them here: the evalkit key, or what to do instead
LM_EVAL_FLAGS = {
    "pretrained": "the weights are vllm_path=/path/or/hub-id (with model=PRESET for a preset's settings)",
    "model_args": "each of lm-eval's model_args is its own key here: vllm_path=, dtype=, max_model_len=, "
                  "+engine_kwargs.NAME=VALUE",
    "include_path": "more task folders are tasks_dirs=[DIR]",
    "device": "vLLM runs on the devices this process may use: choose them with CUDA_VISIBLE_DEVICES, and how many "
              "with tensor_parallel_size=N",
    "max_gen_toks": "the ceiling on new tokens is max_tokens=N",
    "max_length": "the engine's context is max_model_len=N",
    "max_batch_size": "the most sequences at once is batch_size=N",
    "gen_kwargs": "sampling arguments are +sampling_kwargs.NAME=VALUE (temperature=X for the temperature)",
    "output_path": "runs are written under output_dir=DIR",
    "use_cache": "finished answers are reused by default (resume=true)",
    "cache_requests": "finished answers are reused by default (resume=true)",
    "check_integrity": "evalkit validate KEY=VALUE ... checks a command without starting an engine",
    "write_out": "every prompt is in the run's samples files (log_samples=true, the default)",
    "wandb_args": "evalkit logs to no tracker: results are files under output_dir (docs/results.md)",
    "hf_hub_log_args": "evalkit logs to no hub: results are files under output_dir (docs/results.md)",
    "bootstrap_iters": "evalkit's standard errors use lm-eval's bootstrap with 1000 resamples; it is no key",
    "verbosity": "evalkit's own lines go to the terminal and the engine's to the run's log (docs/results.md)",
}
LIST_WORDS = {"list", "list_groups", "list_subtasks", "list_tags"}  # lm-eval's --tasks list and its kin
# lm-eval's model types: `model=vllm` there names the backend, here a preset
LM_EVAL_MODELS = {"vllm": "engine=vllm (the default)", "hf": "engine=hf", "local-completions": "engine=served",
                  "local-chat-completions": "engine=served", "openai-completions": "engine=served"}


OVERRIDE = re.compile(r"^[+~]*[\w.\-/]+=")  # a word that starts an override of its own: key=...
# Hydra's options that take the next word as their value (hydra/_internal/utils.py, get_args_parser)
VALUED_OPTIONS = {"-c", "--cfg", "-p", "--package", "-i", "--info", "-cp", "--config-path", "-cn", "--config-name",
                  "-cd", "--config-dir", "-sc", "--shell-completion", "--experimental-rerun"}


def prepared(argv: list[str]) -> list[str]:
    """The command line as evalkit hands it to Hydra: an override the shell split at a space inside brackets
    (``tasks=[gsm8k, arc_easy]``) joined again, ``-m`` first (argparse takes the overrides in one run only), and
    ``~model`` (no preset) where vllm_path is given without model=, so those weights get their own name (the last
    part of the path) and the schema's settings, never the embedded preset's."""
    words: list[str] = [word for word in argv if word in ("-m", "--multirun")]
    for word in (word for word in argv if word not in ("-m", "--multirun")):
        if words and open_brackets(words[-1]) > 0 and not word.startswith("-") and not OVERRIDE.match(word):
            words[-1] = f"{words[-1]} {word}"
        else:
            words.append(word)
    overrides = arguments_to_check(words)
    keys = {word.split("=", 1)[0].lstrip("+~") for word in overrides}
    if "vllm_path" in keys and "model" not in keys:  # beside the other overrides: argparse takes them in one run
        words.insert(words.index(overrides[0]), "~model")
    return words


def open_brackets(word: str) -> int:
    """How many brackets a key=value word leaves open (0 for an option or a word that closes them all)."""
    if "=" not in word or word.startswith("-"):
        return 0
    value = word.split("=", 1)[1]
    if not value.startswith(("[", "{")):  # a text that holds a bracket (system_instruction=...) is no list
        return 0
    return value.count("[") + value.count("{") - value.count("]") - value.count("}")


def arguments_to_check(argv: list[str]) -> list[str]:
    """The overrides among a command line's arguments: ``key=value`` words, not options (``-m``, ``--cfg job``,
    ``--config-name=x``) nor the values options take (``-sc install=bash``)."""
    after_option = [False] + [a in VALUED_OPTIONS for a in argv[:-1]]
    return [a for a, value in zip(argv, after_option) if "=" in a and not a.startswith("-") and not value]


def check_overrides(overrides: list[str]) -> None:
    """Raise one ConfigError for the first override that names no key of the schema or gives a value its key
    cannot take (the module docstring)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in overrides:  # before parsing: lm-eval's values (model_args=a=b,c=d) are no override Hydra parses
        key = override.split("=", 1)[0].lstrip("+~")
        if key in LM_EVAL_FLAGS:
            field_type(key)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    except Exception:  # Hydra reports its own syntax errors
        return
    for override in parsed:
        key = override.key_or_group
        if override.is_add() or override.is_delete() or key.startswith("hydra"):
            continue
        values = sweep_values(override)
        if key == "model":
            check_presets([str(v) for v in values])
            continue
        kind = field_type(key)
        if kind is None:
            text = override.input_line or f"{key}=..."
            raise ConfigError(f"{text} adds a key to {key.split('.')[0]}, which has none until it is added: "
                              f"pass +{text}")
        if typing.get_origin(bare(kind)) is list and override.is_sweep_override() and values and \
                all(isinstance(v, str) for v in values):
            listed = ",".join(str(v) for v in values)
            raise ConfigError(f"{key}={listed} must be a list: pass {key}=[{listed}] (no spaces; a sweep over "
                              f"them, one at a time, is -m {key}=" + ",".join(f"[{v}]" for v in values) + ")")
        for value in values:
            if key == "tasks" and set(value if isinstance(value, list) else [value]) & LIST_WORDS:
                raise ConfigError(f"{override.input_line} would run a task named so; to list the tasks: evalkit tasks "
                                  "[WORD] (every task whose name holds WORD)")
            check_value(key, kind, value)


def sweep_values(override: Any) -> list[Any]:
    """The values an override gives (each one of a sweep), parsed as Hydra parses them."""
    if not override.is_sweep_override():
        return [override.value()]
    try:
        return list(override.sweep_iterator())
    except Exception:  # a glob or another sweep Hydra expands itself
        return []


def check_presets(values: list[str]) -> None:
    presets = model_presets()
    for value in map(str, values):
        if value in LM_EVAL_MODELS:
            raise ConfigError(f"model={value} is lm-eval's backend; here model= picks a preset, and vLLM is "
                              f"{LM_EVAL_MODELS[value]}: pass vllm_path=/path/or/hub-id, or model=PRESET "
                              f"({', '.join(presets)})")
        if value not in presets:
            raise ConfigError(f"unknown model preset {value!r}{closest_preset(value, presets)}; presets: "
                              f"{', '.join(presets)}; weights without a preset: vllm_path=/path/or/hub-id")


def closest_preset(value: str, presets: list[str]) -> str:
    """closest, where a chat release's other name (-chat for -instruct, and back) comes first."""
    other = value.replace("-chat", "-instruct") if value.endswith("-chat") else value.replace("-instruct", "-chat")
    near = [other] if other != value and other in presets else []
    near += [p for p in closest(value, presets).removeprefix(" (did you mean ").removesuffix("?)").split(", ")
             if p and p not in near]
    return f" (did you mean {', '.join(near[:3])}?)" if near else ""


def field_type(key: str) -> Any:
    """The type the schema gives a dotted key; None where the key is inside a free mapping (engine_kwargs.x).
    A key the schema lacks is a ConfigError naming the closest key at its level."""
    node: Any = EvalConfig
    for depth, part in enumerate(key.split(".")):
        if not dataclasses.is_dataclass(node):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints and depth == 0 and part in LM_EVAL_FLAGS:
            raise ConfigError(f"{key} is lm-eval's; {LM_EVAL_FLAGS[part]} (every key: docs/configuration.md)")
        if part not in hints:
            prefix = ".".join(key.split(".")[:depth])
            known = [f"{prefix}.{name}" if prefix else name for name in hints] + (GROUPS if not prefix else [])
            raise ConfigError(f"unknown config key {key!r}{closest(key, known, n=1 if prefix else 3)}; every key: "
                              "docs/configuration.md")
        node = hints[part]
    return node


def check_value(key: str, kind: Any, value: Any) -> None:
    if isinstance(value, str) and "${" in value:
        return  # an interpolation: Hydra resolves it
    if key in CHOICES and isinstance(value, str) and value not in CHOICES[key]:
        raise ConfigError(not_one_of(key, value, CHOICES[key]))
    if not fits(kind, value):
        raise ConfigError(wrong_type(key, kind, value))


def fits(kind: Any, value: Any) -> bool:
    """Whether Hydra would take value for a key of type kind (the schema's annotation)."""
    from omegaconf import MISSING, OmegaConf
    from omegaconf.errors import ValidationError

    probe = dataclasses.make_dataclass("Probe", [("slot", kind, dataclasses.field(default=MISSING))])
    try:
        OmegaConf.merge(OmegaConf.structured(probe), {"slot": value})
    except ValidationError:
        return False
    return True


def wrong_type(key: str, kind: Any, value: Any) -> str:
    """The line for a value its key cannot take: what the key takes, and the value it most likely meant."""
    shown = "null" if value is None else value if isinstance(value, str) else str(value)
    base = bare(kind)
    origin = typing.get_origin(base)
    if origin is list:
        return f"{key}={shown} must be a list: pass {key}=[{shown}]"
    if origin is dict or dataclasses.is_dataclass(base):
        return f"{key} is a group of keys, not a value: pass {key}.NAME={shown} (every key: docs/configuration.md)"
    if base is bool:
        near = {"yes": "true", "no": "false", "on": "true", "off": "false", "1": "true", "0": "false"}.get(
            shown.lower(), "true or false")
        return f"{key}={shown} must be true or false (did you mean {key}={near}?)"
    if base is int:
        near = NUMBERS.get(shown.lower().strip())
        hint = f"did you mean {key}={near}?" if near is not None else f"e.g. {key}=1"
        return f"{key}={shown} must be a whole number ({hint})"
    if base is float:
        return f"{key}={shown} must be a number (e.g. {key}=0.5)"
    return f"{key}={shown} is not a value {key} takes ({getattr(base, '__name__', base)})"


def bare(kind: Any) -> Any:
    """Optional[X] as X."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    return args[0] if union and len(args) == 1 else kind
