"""``evalkit tasks [WORD] [--tasks-dir DIR ...]``: the task, group and tag names a run may pass in ``tasks=[...]``.

lm-eval's built-in names come from the map evalkit keeps of its index (evalkit/harness/task_index.py, built once
per lm-eval install), evalkit's own from ``tasks/`` and the folders given, as a run's ``tasks_dirs`` adds them.
Each line is a name and its kind (task, group, tag), sorted; WORD keeps the names that hold it.
"""

from __future__ import annotations

import argparse
import sys

from evalkit.config import ConfigError
from evalkit.harness.task_index import builtin_map, own_dirs

KINDS = {"TASK": "task", "PY_TASK": "task", "GROUP": "group", "TAG": "tag"}


def task_names(extra_dirs: list[str]) -> dict[str, str]:
    """Every name a run may use, with its kind: lm-eval's built-in ones and those of evalkit's folders (which win)."""
    from lm_eval.tasks import TaskManager

    names = {name: KINDS.get(record["kind"], record["kind"].lower()) for name, record in builtin_map().items()}
    own = TaskManager(include_path=own_dirs(extra_dirs), include_defaults=False)
    names.update({name: KINDS.get(entry.kind.name, entry.kind.name.lower()) for name, entry in own.task_index.items()})
    return names


def main(argv: list[str] | None = None, prog: str = "evalkit tasks") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="The task, group and tag names tasks=[...] takes.")
    parser.add_argument("word", nargs="?", default="", help="only names that hold WORD (any case)")
    parser.add_argument("--tasks-dir", action="append", default=[], metavar="DIR",
                        help="a folder of task YAMLs, as the run's tasks_dirs=[DIR] (may be given again)")
    args = parser.parse_args(argv)
    try:
        names = task_names(args.tasks_dir)
    except ConfigError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    shown = sorted(name for name in names if args.word.lower() in name.lower())
    width = max((len(name) for name in shown), default=0)
    print("\n".join(f"{name:<{width}}  {names[name]}" for name in shown))
    print(f"{len(shown)} of {len(names)} names; run them with tasks=[name,...]", file=sys.stderr)
    return 0
