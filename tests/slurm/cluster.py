"""A real one-node Slurm cluster in a temporary directory, for testing the sbatch scripts.

Debian's slurmctld and slurmd (no munge: auth/none), the node's real hostname and CPUs, private
ports, every spool/state/log/pid file under the directory. Started in about a second; stopped by the
pids it started. Commands get the cluster through `env()` (SLURM_CONF).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

DAEMONS = ("slurmctld", "slurmd")


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    for name in DAEMONS + ("sbatch", "scontrol", "scancel"):
        if shutil.which(name) is None:
            return f"{name} not found: `apt-get install slurmd slurmctld slurm-client` (as root) failed or was not run"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as the submitting user"
    return None


def require() -> None:
    """Skips the test, saying why, where this machine cannot run the cluster; under CI=true fails it
    instead: CI's Slurm tier must not pass having run nothing."""
    why = missing()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the Slurm tests cannot run: {why}", pytrace=False)
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """`with LocalSlurm(tmp) as slurm: slurm.run("sbatch", ...)`."""

    def __init__(self, root: Path, kill_wait_s: int = 60) -> None:
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.kill_wait_s = kill_wait_s
        self.procs: list[subprocess.Popen] = []

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        return os.environ | {"SLURM_CONF": str(self.conf)} | extra

    def write_config(self) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        r, cpus = self.root, os.cpu_count() or 1
        self.conf.write_text("\n".join([
            "ClusterName=fastgrpo-test",
            f"SlurmctldHost={self.node}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/none",
            "CredType=cred/none",
            "AuthInfo=cred_expire=5",  # a requeued job may start again after 6 s instead of 121
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"KillWait={self.kill_wait_s}",  # seconds between a cancel's SIGTERM and its SIGKILL
            "MinJobAge=3600",  # finished jobs stay visible to scontrol for the whole test
            f"NodeName={self.node} CPUs={cpus} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")

    def start(self, timeout_s: float = 30.0) -> None:
        self.write_config()
        for daemon in DAEMONS:  # -D: in the foreground, so the pid is ours to stop
            log = open(self.root / "log" / f"{daemon}.out", "w")
            self.procs.append(subprocess.Popen([daemon, "-D", "-f", str(self.conf)], env=self.env(),
                                               stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.run("sinfo", "--noheader", "--format=%t", check=False).stdout.strip()
            if state == "idle":
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        logs = "\n".join(f.read_text()[-2000:] for f in sorted((self.root / "log").iterdir()))
        self.stop()
        raise RuntimeError(f"the local Slurm cluster did not come up within {timeout_s:.0f} s:\n{logs}")

    def stop(self) -> None:
        """Cancels what still runs, stops the daemons, then ends any process left of this cluster's jobs
        (slurmstepd and job processes carry its SLURM_CONF): nothing is left behind."""
        if self.procs and all(p.poll() is None for p in self.procs):
            self.run("scancel", "--partition=test", check=False)
            deadline = time.monotonic() + self.kill_wait_s + 30
            while self.run("squeue", "--noheader", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(1.0)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("SLURM_CONF") == str(self.conf):
                    p.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, *argv: str, check: bool = True, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=env or self.env(), cwd=cwd, capture_output=True, text=True,
                              check=check, timeout=timeout)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout_s:.0f} s, "
                                   f"waiting for {states}")
            time.sleep(1.0)
