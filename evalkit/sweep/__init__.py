"""Stage 6, sweeps: a Hydra multirun (``python -m evalkit -m max_model_len=1024,2048``) runs each point as a full
evalkit run; every point leaves a record in its sweep folder (points: running, ok, failed, or skipped because an
earlier run already has its config), a failing point does not end the sweep, and when the sweep ends one report
(report, ``python -m evalkit.report <sweep dir>``) puts every point, task and metric in one table with plots and
each point's verdict against a reference point; the Hydra callback (callback) prints progress and writes it."""
