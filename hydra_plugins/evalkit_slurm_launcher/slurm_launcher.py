"""submitit's Slurm launcher with a wait that outlives a job without a result.

submitit's own wait (``job.results()`` for each job in turn) raises for the first job that ended without a
result: a job cancelled for good (``scancel``), killed, or a point that stopped and was not requeued. The sweep
command then stops with submitit's error and no report, while later jobs may still run. Here every job is waited
for; one without a result gets a failed record (unless its point recorded its own failure, as a stopped point
does) and one line saying which point it was and how to run it again, and the sweep goes on to its report and
exit status (evalkit/sweep/callback.py). A requeued job is still waited for: Slurm runs it again."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import open_dict

JOB_FOLDER = re.compile(r"^(\d+)(?:_(\d+))?$")  # submitit's folder of a job: <job id> or <array id>_<index>


class EvalkitSlurmLauncher(SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from submitit.core.utils import UncompletedJobError

        try:
            return super().launch(job_overrides, initial_job_idx)
        except UncompletedJobError as error:  # a job without a result: wait for every job, record the ones without
            if not submitted(Path(str(self.params["submitit_folder"])).parent):  # sbatch took no job: nothing ran
                said = [line for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
                worst = next((line for line in said if "fatal" in line), said[-1])
                print(f"evalkit: error: sbatch took none of the sweep's jobs ({worst.strip()}); run the sweep where "
                      "sbatch works (a login node of the cluster), or without hydra/launcher=evalkit_slurm",
                      file=sys.stderr)
                raise SystemExit(2) from None
            return self.gather(job_overrides, initial_job_idx)

    def gather(self, job_overrides: Sequence[Sequence[str]], first: int) -> list[JobReturn]:
        import submitit
        from submitit.core.utils import UncompletedJobError

        folder = str(self.params["submitit_folder"])
        common = set.intersection(*(set(o) for o in job_overrides)) if len(job_overrides) > 1 else set()
        returns = []
        for num, (job_id, overrides) in enumerate(zip(launched(Path(folder).parent, len(job_overrides)),
                                                      job_overrides), start=first):
            job = submitit.SlurmJob(folder=folder, job_id=job_id)
            try:
                returns.append(job.results()[0])
            except UncompletedJobError:
                state = (job.state or "UNKNOWN").split()[0]  # CANCELLED, not "CANCELLED by 0"
                self.record(num, list(overrides), f"Slurm job {job_id} ended {state} without a result")
                apart = " ".join(o for o in overrides if o not in common)
                print(f"evalkit: point {num} ({apart}) was not finished: its Slurm job {job_id} ended {state}; the "
                      "same command again runs only the points without results", file=sys.stderr, flush=True)
                returns.append(JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED))  # recorded
        return returns

    def record(self, num: int, overrides: list[str], error: str) -> None:
        """Point num recorded failed with error in its folder (a failure it recorded itself is kept)."""
        from evalkit.sweep.points import record_failure

        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg):
            cfg.hydra.job.num = num
        record_failure(Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir), num=num, overrides=overrides,
                       error=error)


def submitted(root: Path) -> bool:
    """Whether submitit's folder root holds a job's folder: sbatch took at least one job."""
    return root.is_dir() and any(JOB_FOLDER.match(p.name) for p in root.iterdir())


def launched(root: Path, count: int) -> list[str]:
    """The job ids of the newest submission in submitit's folder root (``<job id>`` for one point, else an array's
    ``<array id>_<index>``), by point."""
    found = [(int(m[1]), -1 if m[2] is None else int(m[2]), p.name)
             for p in root.iterdir() if (m := JOB_FOLDER.match(p.name))]
    newest = max(job for job, _, _ in found)
    ids = [name for job, index, name in sorted(found) if job == newest and index >= 0]  # an array's tasks
    ids = ids or [str(newest)]  # one job (one point): no array; an array's own folder holds its script
    if len(ids) != count:
        raise RuntimeError(f"{root}: {len(ids)} job folders of Slurm job {newest} for {count} points")
    return ids
