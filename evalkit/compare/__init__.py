"""Stage 5, compare: two runs document by document (paired, ``python -m evalkit.compare``), the statistics
(stats), the report (report) and the engine's own noise (noise, ``python -m evalkit.compare.noise``)."""
