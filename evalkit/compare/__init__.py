"""Is one run as accurate as another? Two runs compared document by document (``python -m evalkit.compare``,
cli.py) over the runs on disk (runs.py), in rooms: the statistics of each row and the verdicts (statistics/),
``--locate`` (locate/), token-level divergence (divergence/), and the pages (pages/: the text report markdown.py, the
HTML page html_page.py with the documents that changed, documents.py, and the plots, plots.py, which the sweep
report renders too); the engine's own noise is ``python -m evalkit.compare.noise`` (noise.py)."""
