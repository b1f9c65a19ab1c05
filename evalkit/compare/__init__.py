"""Is one run as accurate as another? Two runs compared document by document (paired, ``python -m evalkit.compare``),
the statistics of each row (stats, over proportions, bootstrap, ratio and tost), the verdicts (verdict), the report
(report) and the engine's own noise (noise, ``python -m evalkit.compare.noise``)."""
