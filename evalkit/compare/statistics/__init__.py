"""The statistics of a comparison, pure functions over two runs' per-document values, no I/O and no HTML:
paired (every row of two runs, or of a family of candidates), metric_rows (one row: aggregation, direction,
groups), stats (one row's method and p-values) over interval, proportions, bootstrap, means, ratio (perplexity
rows as ratios of per-document sums), corpus (corpus-level metrics resampled from summed counts) and tost (the one-sided tests), and verdict
(verdicts, Holm, the exit code). What they read is compare's runs.py; compare's report shows them."""
