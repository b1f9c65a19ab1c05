"""Is one run as accurate as another? Two runs compared document by document (``python -m evalkit.compare``,
cli.py) over the runs on disk (runs.py), in rooms: the statistics of each row and the verdicts (statistics/),
``--locate`` (locate/), token-level divergence (divergence/), and the report (report.py, its page report_page.py
with documents.py and plots.py); the engine's own noise is ``python -m evalkit.compare.noise`` (noise.py)."""
