"""``python -m evalkit [key=value ...]``: compose the Hydra config, run it, print the scores.

Examples: ``python -m evalkit`` (embedded model and tasks), ``python -m evalkit model=qwen2-7b
tensor_parallel_size=4 tasks=[gsm8k]``, a sweep: ``python -m evalkit -m max_model_len=2048,4096``.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from evalkit.config import CONF_DIR, ConfigError, check_overrides, register_configs


def fail(message: str, code: int = 2) -> None:
    print(f"evalkit: error: {message}", file=sys.stderr)
    sys.exit(code)


def run_one(cfg: DictConfig) -> None:
    from evalkit.run.supervise import RunFailed, RunStopped, supervise

    try:
        run_dir = supervise(OmegaConf.to_object(cfg))
    except ConfigError as error:
        fail(str(error))
    except RunStopped as error:
        fail(f"stopped: {error}", code=error.exit_code)
    except RunFailed as error:
        fail(str(error), code=1)
    print(f"\n{(run_dir / 'summary.md').read_text()}\nwritten to {run_dir}")


def main() -> None:
    try:
        check_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
    except ConfigError as error:
        fail(str(error))
    register_configs()
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(run_one)()


if __name__ == "__main__":
    main()
