"""A real one-node Slurm on loopback, started and stopped by the project: what the Slurm tests run against.

It writes a minimal ``slurm.conf`` (this machine as its one node at 127.0.0.1, one partition, processes tracked
by ``proctrack/linuxproc``, ``task/none``, no cgroups) and ``slurmdbd.conf`` (accounting in a MariaDB of its own,
so that ``sacct`` answers as on a user's cluster: submitit reads a job's end from it) and a munge key into a
folder of its own; starts ``munged``, ``mariadbd``, ``slurmdbd``, ``slurmctld`` and ``slurmd`` in the foreground
as its children, each on a free loopback port; and waits until ``sinfo`` shows the node idle. Nothing outside
that folder is touched: Slurm's commands find the cluster through ``SLURM_CONF`` (:attr:`LocalSlurm.env`).
:meth:`LocalSlurm.stop` cancels every job, stops the daemons and any ``slurmstepd`` of its jobs, and checks that
none is left.

Credentials expire after 10 s (``cred_expire``; Slurm's default is 120 s), which is how long a requeued job waits
before it may start again. Install (Debian, Ubuntu): ``apt-get install slurm-wlm slurmdbd munge mariadb-server``. slurmd runs jobs as
their user, so this runs as root.

    .venv/bin/python -m tests.clusters.local_slurm -- sinfo     # start it, run a command against it, stop it
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.clusters import free_port, run_against

DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "sinfo", "squeue", "scontrol", "scancel", "sacct", "sacctmgr")
INSTALL = "apt-get install slurm-wlm slurmdbd munge mariadb-server"
START_WAIT = 60.0  # seconds for the node to show idle
KILL_WAIT = 30  # slurm.conf KillWait: seconds between a job's SIGTERM and its SIGKILL
# GPUs the node declares to Slurm, plain files standing for devices: enough for --gpus-per-node to be granted and
# shown by scontrol on a machine without one (a job gets SLURM_GPUS_ON_NODE for them, no CUDA_VISIBLE_DEVICES)
GPUS = 2

CONF = """\
ClusterName=evalkit-local
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge.socket,cred_expire=10
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/slurmd
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={dbd_port}
AccountingStoragePass={state}/munge.socket
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
KillWait={kill_wait}
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
InactiveLimit=0
MinJobAge=300
GresTypes=gpu
{node} Gres=gpu:{gpus} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes={name} Default=YES MaxTime=INFINITE State=UP
"""

DBD_CONF = """\
AuthType=auth/munge
AuthInfo=socket={state}/munge.socket
DbdHost={host}
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
PidFile={state}/slurmdbd.pid
LogFile={state}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=root
StorageLoc=slurm_acct_db
"""


def missing() -> str | None:
    """Why a local Slurm cannot start here (one line), or None."""
    absent = [name for name in (*DAEMONS, *COMMANDS) if not shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin")]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} not found): {INSTALL}"
    if os.geteuid() != 0:
        return "a local Slurm runs its jobs through slurmd as root; run as root"
    return None


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def which(name: str) -> str:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin") or name


def node_line() -> tuple[str, str]:
    """This machine's node name and its NodeName line as slurmd detects it (``slurmd -C``)."""
    first = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    return first.split()[0].split("=", 1)[1], first


class LocalSlurm:
    """A running one-node Slurm; env holds SLURM_CONF for Slurm's commands, partition its one partition."""

    partition = "local"

    def __init__(self, state: Path | None = None, *, kill_wait: int = KILL_WAIT) -> None:
        self.state = Path(state or tempfile.mkdtemp(prefix="evalkit-slurm-"))
        self.name, node = node_line()
        self.conf = self.state / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []
        for sub in ("ctld", "slurmd"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.state, 0o755)  # munged wants its socket reachable by all, its key writable by none but it
        host, self.db_port, self.dbd_port = socket.gethostname().split(".")[0], free_port(), free_port()
        for n in range(GPUS):
            (self.state / f"gpu{n}").touch()
        (self.state / "gres.conf").write_text(f"NodeName={self.name} Name=gpu File={self.state}/gpu[0-{GPUS - 1}]\n")
        self.conf.write_text(CONF.format(host=host, state=self.state, node=node, name=self.name, kill_wait=kill_wait, gpus=GPUS,
                                         ctld_port=free_port(), slurmd_port=free_port(), dbd_port=self.dbd_port))
        dbd = self.state / "slurmdbd.conf"  # read from SLURM_CONF's folder; slurmdbd wants it private
        dbd.write_text(DBD_CONF.format(host=host, state=self.state, dbd_port=self.dbd_port, db_port=self.db_port))
        os.chmod(dbd, 0o600)
        key = self.state / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)

    def start(self) -> "LocalSlurm":
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "LocalSlurm":
        s = self.state
        self.spawn("munged", "--foreground", f"--socket={s}/munge.socket", f"--key-file={s}/munge.key",
                   f"--pid-file={s}/munged.pid", f"--log-file={s}/munged.log", f"--seed-file={s}/munged.seed")
        self.wait_for(lambda: (s / "munge.socket").exists(), "munged's socket")
        subprocess.run([which("mariadb-install-db"), f"--datadir={s}/db", "--user=root", "--skip-test-db",
                        "--auth-root-authentication-method=normal"], capture_output=True, check=True)
        # grants off: a database on loopback that only this cluster's slurmdbd knows the port of
        self.spawn("mariadbd", "--no-defaults", f"--datadir={s}/db", f"--socket={s}/mysql.sock", "--user=root",
                   f"--port={self.db_port}", "--bind-address=127.0.0.1", "--skip-grant-tables",
                   f"--pid-file={s}/mariadbd.pid", "--innodb-buffer-pool-size=32M")
        self.wait_for(lambda: listening(self.db_port), "MariaDB")
        self.spawn("slurmdbd", "-D")
        self.wait_for(lambda: listening(self.dbd_port), "slurmdbd")
        self.run("sacctmgr", "-i", "add", "cluster", "evalkit-local")
        self.spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        self.spawn("slurmd", "-D", "-f", str(self.conf), "-N", self.name)
        self.wait_for(lambda: self.node_state() == "idle", f"sinfo to show node {self.name} idle")
        return self

    def spawn(self, name: str, *args: str) -> None:
        log = open(self.state / f"{name}.out", "ab")
        self.daemons.append(subprocess.Popen([which(name), *args], stdout=log, stderr=subprocess.STDOUT,
                                             env=self.env, start_new_session=True))
        log.close()

    def wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_WAIT
        while not ready():
            dead = [p for p in self.daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{Path(dead[0].args[0]).name} exited ({dead[0].returncode})" if dead else "timed out"
                raise RuntimeError(f"local Slurm: waiting for {what}: {why}; logs in {self.state}")
            time.sleep(0.5)

    def run(self, *args: str, check: bool = True) -> str:
        """A Slurm command against this cluster (``self.run("scontrol", "show", "job", "5")``): its stdout."""
        done = subprocess.run([which(args[0]), *args[1:]], capture_output=True, text=True, env=self.env, timeout=60)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def node_state(self) -> str:
        done = subprocess.run([which("sinfo"), "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env)
        return done.stdout.strip() if done.returncode == 0 else ""

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as key -> value (JobState, Partition, NumCPUs, MinMemoryNode, TimeLimit...)."""
        fields = {}
        for word in self.run("scontrol", "show", "job", "-o", str(job_id)).split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def accounting(self) -> list[dict[str, str]]:
        """Every job (not its steps) as ``sacct`` shows it: JobID, JobName, State, ExitCode, Partition, NodeList."""
        names = ("JobID", "JobName", "State", "ExitCode", "Partition", "NodeList")
        out = self.run("sacct", "-a", "-X", "-P", "-n", "-S", "now-1days", "-o", ",".join(names))
        return [dict(zip(names, line.split("|"))) for line in out.splitlines() if line]

    def stop(self) -> None:
        """Cancel every job, wait for them to end, stop the daemons, and leave no slurmstepd of this cluster."""
        if any(Path(p.args[0]).name == "slurmctld" and p.poll() is None for p in self.daemons):
            queue = subprocess.run([which("squeue"), "-h", "-o", "%i"], capture_output=True, text=True, env=self.env)
            subprocess.run([which("scancel"), "--full", *queue.stdout.split()], capture_output=True, env=self.env)
            deadline = time.monotonic() + KILL_WAIT + 15
            while self.steps() and time.monotonic() < deadline:
                time.sleep(0.5)
        for process in reversed(self.daemons):  # slurmd, slurmctld, slurmdbd, mariadbd, then munged
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for pid in self.steps():  # a step daemon whose job outlived the cancel
            os.kill(pid, signal.SIGKILL)
        left = self.steps()
        if left:
            raise RuntimeError(f"local Slurm: slurmstepd {left} still running after stop")

    def steps(self) -> list[int]:
        """The pids of this cluster's slurmstepd processes, whatever their job: those whose environment holds this
        cluster's SLURM_CONF, which slurmd passes on (a command line names the raw job id, ``slurmstepd: [3.0]``,
        which an array task's id, 1_2, does not show)."""
        ours = f"SLURM_CONF={self.conf}".encode() + b"\0"
        found = []
        for entry in Path("/proc").iterdir():
            try:
                step = (entry / "cmdline").read_bytes().startswith(b"slurmstepd:")
                if step and ours in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except (OSError, ValueError):
                continue
        return found


def main(argv: list[str]) -> int:
    """Start a local Slurm, run the command after ``--`` with SLURM_CONF set, stop it; the command's exit code."""
    why = missing()
    if why:
        print(f"local Slurm: {why}", file=sys.stderr)
        return 2
    return run_against(lambda: LocalSlurm().start(), argv, ["sinfo"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
