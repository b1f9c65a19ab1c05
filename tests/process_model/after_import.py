"""A module patched as soon as it has run, before anything imports its names: the import hook the process models
share (tests/forked_engine/sitecustomize.py, tests/gpu_machine/sitecustomize.py). Each loads this file by its
path (load_after_import), since the processes they run in have only their own folder on PYTHONPATH.

Nothing here imports evalkit, vLLM or torch: it runs in every process before any of them.
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Callable


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds each module named in patches as the other finders would, and runs its patch right after the module's
    own code, before the import returns it to anyone."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patches[name](module)

        spec.loader.exec_module = exec_module
        return spec


def patch_after_import(patches: dict[str, Callable[[ModuleType], None]]) -> None:
    """From now on in this process, each module named in patches gets its patch as soon as it has run."""
    sys.meta_path.insert(0, AfterImport(patches))
