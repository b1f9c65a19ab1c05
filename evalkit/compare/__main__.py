"""``python -m evalkit.compare REF CAND [...]``: see evalkit/compare/cli.py."""

from evalkit.compare.cli import main

if __name__ == "__main__":
    import sys

    if sys.stderr.isatty():  # said to a person; a script reading stderr sees what it always saw
        print("evalkit: note: `python -m evalkit.compare` is `evalkit compare` (the same arguments)", file=sys.stderr)
    raise SystemExit(main())
