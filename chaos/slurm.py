"""A real one-node Slurm: Debian's slurmctld and slurmd (22.05), started in a temporary folder as root, with the
node's CPUs and no GPU; jobs run the repository's launchers through real sbatch, srun and scontrol. The soak
(chaos/soak.py) and the launchers' tests (tests/test_slurm_real.py) start one.

`.ci/run` installs the packages (apt-get install slurmctld slurmd slurm-client) and sets MHAR_REQUIRE_SLURM=1, so
that in CI a cluster that cannot start fails its tests; elsewhere (no root, no packages) they are skipped, saying
why. Settings follow the measured notes of a 2-core machine: no cgroups, no accounting, no munge (auth/none).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REQUIRE_ENV = "MHAR_REQUIRE_SLURM"
DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "srun")
KICK_AFTER_S = 5.0
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def unavailable() -> str | None:
    """Why a real Slurm cannot start here, or None."""
    if os.geteuid() != 0:
        return "a real Slurm needs root (its daemons run jobs as their users)"
    missing = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH (apt-get install slurmctld slurmd slurm-client)"
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        return f"the host name {host} does not resolve (slurmd names its node by it: add it to /etc/hosts)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """slurmctld and slurmd on this host as node `host`, one partition; clients find it through SLURM_CONF."""

    def __init__(self, root: Path, kill_wait_s: int = 30):
        self.root, self.host = root, socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.kill_wait_s = kill_wait_s
        self._waiting: dict[int, float] = {}  # requeued jobs waiting for their BeginTime, since when

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 8 // 10
        r = self.root
        self.conf.write_text(
            f"""ClusterName=mhartest{os.getpid()}
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobRequeue=1
ReturnToService=2
MinJobAge=3600
KillWait={self.kill_wait_s}
MailProg=/bin/true
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN
PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def start(self, timeout_s: float = 60) -> None:
        socket.gethostbyname(self.host)  # slurmd names itself by the host name: it must resolve
        self._write_conf()
        for daemon in DAEMONS:
            subprocess.run([daemon, "-f", str(self.conf)], env=self.env, check=True, capture_output=True, text=True)
        deadline = time.monotonic() + timeout_s
        while self.node_state() != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node is {self.node_state()!r} after {timeout_s:.0f} s: {self.logs()}")
            time.sleep(0.2)

    def node_state(self) -> str:
        done = self.run("sinfo", "-h", "-n", self.host, "-o", "%t", check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted((self.root / "log").glob("*.log")) if p.exists()
        )

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> int:
        """Submit; the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *args],
            cwd=cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """scontrol's fields of the job (JobState, ExitCode, Restarts, Reason, ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def kick(self, job_id: int) -> dict[str, str]:
        """The job's fields; a requeued job waiting for its BeginTime (about two minutes on) is started once it has
        waited KICK_AFTER_S (started at once, it can be killed as "non-startable: Job credential revoked", its last
        run not yet cleaned up)."""
        fields = self.job(job_id)
        if fields["JobState"] == "PENDING" and fields.get("Reason") == "BeginTime":
            since = self._waiting.setdefault(job_id, time.monotonic())
            if time.monotonic() - since >= KICK_AFTER_S:
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
                self._waiting.pop(job_id)
        else:
            self._waiting.pop(job_id, None)
        return fields

    def wait(self, job_id: int, states: tuple[str, ...] = ENDED, timeout_s: float = 600) -> dict[str, str]:
        """The job's fields once it reaches one of `states`; a pending job whose start was put off (a requeue's
        BeginTime, about two minutes) is started now."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.kick(job_id)
            if fields["JobState"] in states:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {fields['JobState']} ({fields.get('Reason')}) after {timeout_s} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """Every job cancelled and gone (its processes ended within KillWait), then the daemons."""
        self.run("scancel", "--full", "--user", "root", check=False)
        deadline = time.monotonic() + self.kill_wait_s + 15
        while time.monotonic() < deadline:
            left = self.run("squeue", "-h", "-o", "%i", check=False)
            if left.returncode != 0 or not left.stdout.strip():
                break
            time.sleep(0.5)
        for daemon in reversed(DAEMONS):
            pid_file = self.root / f"{daemon}.pid"
            try:
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGTERM)
            except (FileNotFoundError, ValueError, ProcessLookupError):
                continue
            deadline = time.monotonic() + 30
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, not a zombie (without an init that reaps them, a daemon's exit leaves one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
