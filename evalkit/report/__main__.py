"""``python -m evalkit.report SWEEP_DIR [...]``: see evalkit/sweep/cli.py."""

from evalkit.sweep.cli import main

if __name__ == "__main__":
    import sys

    if sys.stderr.isatty():  # said to a person; a script reading stderr sees what it always saw
        print("evalkit: note: `python -m evalkit.report` is `evalkit report` (the same arguments)", file=sys.stderr)
    raise SystemExit(main())
