"""evalkit's Hydra launcher on Slurm: ``python -m evalkit -m hydra/launcher=evalkit_slurm ...`` is submitit's Slurm
launcher (``submitit_slurm``, every ``hydra.launcher.*`` setting the same) whose wait gives every point its record:
a job that ends without a result (cancelled for good, killed) is recorded failed with one line, and the sweep
ends with its report. Needs ``hydra-submitit-launcher`` (the ``slurm`` extra); submitit is imported at launch."""
