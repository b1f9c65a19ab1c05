"""``python -m evalkit.compare REF CAND [...]``: see evalkit/compare/paired.py."""

from evalkit.compare.paired import main

if __name__ == "__main__":
    raise SystemExit(main())
