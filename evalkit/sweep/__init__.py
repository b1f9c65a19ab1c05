"""Many runs over a grid of settings, and one report over them all.

A Hydra multirun (``python -m evalkit -m max_model_len=1024,2048``) runs each point as a full evalkit run; every
point leaves a record in its sweep folder (points: running, ok, failed, or skipped because an earlier run already
has its config), a failing point does not end the sweep, and when the sweep ends one report (report,
``python -m evalkit.report <sweep dir>``) puts every point, task and metric in one table with plots and each
point's verdict against a reference point (its HTML page: report_page); the Hydra callback (callback) prints
progress and writes it. The GPUs a launcher gives each point are checked against its needs (devices)."""
