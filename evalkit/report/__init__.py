"""``python -m evalkit.report <sweep dir>``: the sweep report's command under its first name; the command itself
is ``evalkit report`` (evalkit/sweep/cli.py)."""
