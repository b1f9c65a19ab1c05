"""An engine as an earlier run of the same config described it, without starting one: for a sweep point that was
done (evalkit/sweep/points.py) and for a rerun whose answers are all in the request store (evalkit/run/evaluate.py
then starts the engine only when an answer is missing: evalkit.engine.wrapper.Deferred).

An equal config decides the engine's arguments, model runner and tuning choices on equal versions, hardware and
environment; so an earlier run's description, with this machine's versions and hardware and this process's
vLLM environment put in, is what an engine started now would describe, and its fingerprint names the request
store a run now would read. Where anything that decides an answer changed (the model's files, a library, the
processor, evalkit's answer code), the fingerprint differs and the earlier run is not taken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from evalkit.engine.machine.environment import engine_environment
from evalkit.untrusted import scrubbed

READ_MACHINE = ("import json; from evalkit.engine.machine.environment import hardware, library_versions; "
                "print(json.dumps({'versions': library_versions(), 'hardware': hardware()}))")


def plain(config: dict[str, Any]) -> dict[str, Any]:
    """The config as results.json holds it (a JSON round trip), so the two compare equal."""
    return json.loads(json.dumps(config, default=str))


def machine_here() -> dict[str, Any]:
    """The versions and hardware an engine here describes, read by describe()'s own functions in a short-lived
    process: naming the GPUs starts CUDA, which the sweep's process must not hold while its points run."""
    done = subprocess.run([sys.executable, "-c", READ_MACHINE], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def described_here(recorded: dict[str, Any], machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """What this config's engine would describe (Engine.describe()), without starting it: a completed run's
    description (its engine arguments, model runner and tuning choices, which an equal config decides on equal
    versions, hardware and environment) with the versions and hardware of this machine (:func:`machine_here`)
    and the vLLM environment of this process; a served run's weights, where evalkit started its server, as they
    are now."""
    here = {**recorded, **(machine or machine_here())}
    deployment = recorded.get("deployment")
    if isinstance(deployment, dict) and "weights" in deployment and recorded.get("model_dir"):
        from evalkit.engine.served.probe import weights_identity  # a served run on a server evalkit started

        here["deployment"] = {**deployment, **weights_identity(started_from=recorded["model_dir"], deployment_id=None,
                                                                keeps_answers=False, url="")}  # the weights now
    if "environment" in recorded:  # vLLM's: the VLLM_* variables it starts under, with those tuning set
        tuned = {c["setting"].split(".", 1)[1]: str(c["value"]) for c in recorded.get("choices") or []
                 if str(c.get("setting", "")).startswith("env.")}
        here["environment"] = {**engine_environment(dict(os.environ)), **tuned}
    return here


def runs_with_config(output_dir: str, model_name: str, config: dict[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
    """Each run folder in ``<output_dir>/<model_name>/``, newest first, whose results.json records this very config
    (``evalkit.config``) and a request store fingerprint, with its ``evalkit`` section. Run folders appear
    complete or not at all (evalkit/run/results.py), so each belongs to a finished run."""
    wanted, found = scrubbed(plain(config)), []
    for results_file in sorted((Path(output_dir) / model_name).glob("*/results.json"), reverse=True):
        if results_file.parent.name.startswith("."):
            continue
        try:
            section = json.loads(results_file.read_text()).get("evalkit", {})
            if section.get("config") == wanted and section.get("provenance", {}).get("model_fingerprint"):
                found.append((results_file.parent, section))
        except (OSError, ValueError, AttributeError):
            continue
    return found


def stored_engine(output_dir: str, model_name: str, config: dict[str, Any], model_dir: str
                  ) -> tuple[dict[str, Any], str] | None:
    """(the description an engine here would give, its fingerprint) from the newest earlier run of this config
    whose fingerprint this machine gives again and whose request store is there; None where there is none (the
    engine must start to describe itself). Its start figures are the earlier engine's, so they are left out."""
    from evalkit.store.fingerprint import fingerprint

    machine = None
    for _, section in runs_with_config(output_dir, model_name, config):
        recorded = section.get("engine") or {}
        if "logits_dtype" not in recorded:  # a run of an evalkit that did not record it: the engine must say it
            continue
        machine = machine or machine_here()
        description = described_here({k: v for k, v in recorded.items() if k != "start_seconds"}, machine)
        key = fingerprint(model_dir, description)
        store = Path(output_dir) / model_name / ".requests" / f"{key}.jsonl"
        if key == section["provenance"]["model_fingerprint"] and store.is_file():
            return description, key
    return None
