"""``python -m evalkit.attempt SPEC OUTCOME``: one try of a run, started by evalkit/supervise.py.

Reads the config and the earlier tries from SPEC (JSON), runs it, and writes an Outcome to OUTCOME
(JSON, atomically). It leads its own process group, which holds the vLLM engine processes too: on
SIGTERM, or when the supervisor dies, the whole group is killed at once (finished answers are safe in
the request store).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback
from pathlib import Path

from omegaconf import OmegaConf

from evalkit.config import ConfigError, EvalConfig

PR_SET_PDEATHSIG = 1


def die_with_group(signum, frame) -> None:
    os.killpg(0, signal.SIGKILL)


def die_with_parent() -> None:
    """Ask the kernel to send SIGTERM when the supervisor goes away (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the supervisor was already gone
        die_with_group(None, None)


def write_outcome(path: Path, **outcome) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(outcome))
    os.replace(tmp, path)


def main(spec_file: str, outcome_file: str) -> int:
    signal.signal(signal.SIGTERM, die_with_group)
    signal.signal(signal.SIGINT, die_with_group)
    die_with_parent()
    from evalkit.budget import PromptTooLong
    from evalkit.run import evaluate

    spec = json.loads(Path(spec_file).read_text())
    cfg: EvalConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalConfig), spec["config"]))
    outcome = Path(outcome_file)
    try:
        run_dir = evaluate(cfg, attempts=spec["attempts"])
    except (ConfigError, PromptTooLong) as error:
        write_outcome(outcome, status="config", message=str(error))
        return 2
    except Exception as error:  # any other failure: the supervisor decides whether memory was the cause
        traceback.print_exc()
        causes = []
        while error is not None and len(causes) < 5:
            causes.append(f"{type(error).__name__}: {error}")
            error = error.__cause__ or error.__context__
        write_outcome(outcome, status="error", message=" <- ".join(causes))
        return 1
    write_outcome(outcome, status="ok", run_dir=str(run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
