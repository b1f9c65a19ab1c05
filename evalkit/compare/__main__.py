"""``python -m evalkit.compare REF CAND [...]``: see evalkit/compare/cli.py."""

from evalkit.compare.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
