"""Is one run as accurate as another? Two runs compared document by document (paired, ``python -m evalkit.compare``),
the statistics (stats, tost, ratio, verdict), the report (report) and the engine's own noise (noise,
``python -m evalkit.compare.noise``)."""
