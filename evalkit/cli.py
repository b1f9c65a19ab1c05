"""``evalkit COMMAND ...``: the one command over every entry point (the ``evalkit`` console script).

``evalkit run key=value ...`` is ``python -m evalkit key=value ...`` (evalkit/__main__.py), ``evalkit validate``
its checks without the run, ``evalkit tasks`` evalkit/harness/task_list.py, ``evalkit compare``
is evalkit/compare/cli.py, ``evalkit noise`` evalkit/compare/noise.py and ``evalkit report`` evalkit/sweep/cli.py,
each with the same arguments. Hydra's shell completion of run's keys: ``eval "$(evalkit run -sc install=bash)"``.
"""

from __future__ import annotations

import os
import sys
from typing import Callable


def run(argv: list[str]) -> int:
    """python -m evalkit with argv: Hydra reads sys.argv itself."""
    from evalkit import __main__ as evaluation

    sys.argv = [sys.argv[0], *argv]
    evaluation.main()
    return 0


def validate(argv: list[str]) -> int:
    from evalkit.__main__ import validate_main

    return validate_main(argv)


def tasks(argv: list[str]) -> int:
    from evalkit.harness.task_list import main

    return main(argv, prog="evalkit tasks")


def compare(argv: list[str]) -> int:
    from evalkit.compare.cli import main

    return main(argv, prog="evalkit compare")


def noise(argv: list[str]) -> int:
    from evalkit.compare.noise import main

    return main(argv, prog="evalkit noise")


def report(argv: list[str]) -> int:
    from evalkit.sweep.cli import main

    return main(argv, prog="evalkit report")


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "run": (run, "evaluate a model on tasks: evalkit run [key=value ...]; a sweep: evalkit run -m key=a,b"),
    "validate": (validate, "every check a run makes before its engine starts, and no run: evalkit validate [-m] "
                           "[key=value ...]"),
    "tasks": (tasks, "the tasks a run may name: evalkit tasks [WORD] (those whose name holds WORD)"),
    "compare": (compare, "are runs' scores the same within a tolerance, and why not: evalkit compare REF CAND ..."),
    "noise": (noise, "the engine's own run-to-run variation, as a comparison: evalkit noise [key=value ...]"),
    "report": (report, "a sweep's report, written again: evalkit report SWEEP_DIR [--reference N]"),
}


def usage() -> str:
    lines = [f"  {name:<8} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join([
        "usage: evalkit COMMAND [ARGS ...]", "",
        "evalkit measures the accuracy of an LLM served by vLLM, scored by lm-eval.", "", "commands:", *lines, "",
        "evalkit COMMAND --help: the command's arguments (run's: its keys, with the values it would use).",
        "Shell completion of run's keys (bash, zsh, fish): eval \"$(evalkit run -sc install=bash)\"",
    ])


def without_command(line: str) -> str:
    """A shell's completion line "evalkit run key..." as Hydra reads one: the program, then its overrides."""
    words = line.split(" ", 2)
    return " ".join([words[0], *words[2:]]) if len(words) > 1 and words[1] == "run" else line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-sc"], ["--shell-completion"]):  # Hydra's completion script asks the program itself
        os.environ["COMP_LINE"] = without_command(os.environ.get("COMP_LINE", ""))
        return run(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if "=" in argv[0] or argv[0].startswith("-"):  # the console script's first form: overrides only
        print("evalkit: note: `evalkit key=value ...` is `evalkit run key=value ...`", file=sys.stderr)
        return run(argv)
    if argv[0] not in COMMANDS:
        from evalkit.config import closest

        print(f"evalkit: error: unknown command {argv[0]!r}{closest(argv[0], list(COMMANDS))}; commands: "
              f"{', '.join(COMMANDS)} (evalkit --help)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
