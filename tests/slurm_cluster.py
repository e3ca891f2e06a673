"""A real single-node SLURM cluster (slurmctld + slurmd + munge) that tests start in a temporary folder and stop.

The daemons run as root with every state, spool, pid and log path under the folder, so nothing of the machine's own
SLURM setup (if any) is touched. ``ensure_installed()`` installs Debian's ``slurm-wlm`` and ``munge`` with apt when
``sbatch`` is missing (idempotent: nothing happens when they are there) and returns a reason string when that is not
possible, so that tests can skip saying why.

    cluster = SlurmCluster(tmp_dir)
    cluster.start()                          # sinfo shows the node idle
    job = cluster.submit(script_path)        # job id
    cluster.wait_state(job, {"COMPLETED"})
    cluster.stop()
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import signal as _signal
import subprocess
import time
from pathlib import Path

import lightning as L

from tests._multiproc import free_port

SLURM_COMMANDS = ("sbatch", "slurmctld", "slurmd", "scontrol", "squeue", "scancel", "sinfo", "munged")
RELEASE_AFTER_S = 2.0  # a requeued job is released this long after it shows PENDING (see SlurmCluster.wait_state)
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _missing_commands() -> list[str]:
    return [c for c in SLURM_COMMANDS if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]


def ensure_installed(timeout: float = 300.0) -> str | None:
    """Install slurm-wlm and munge with apt when a SLURM command is missing.

    Returns:
        None when SLURM is usable, else the reason it is not (for ``pytest.skip``).
    """
    if not _missing_commands():
        return None
    if os.name != "posix" or os.geteuid() != 0:
        return f"SLURM commands {_missing_commands()} are missing and installing them needs root"
    if shutil.which("apt-get") is None:
        return f"SLURM commands {_missing_commands()} are missing and there is no apt-get to install them"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd)}` did not finish in {timeout:.0f} s"
        if proc.returncode != 0:
            return f"`{' '.join(cmd)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-500:]}"
    if _missing_commands():
        return f"slurm-wlm and munge installed, but {_missing_commands()} are still missing"
    return None


def _which(name: str) -> str:
    found = shutil.which(name) or str(Path("/usr/sbin", name))
    return found


def _detected_cpus() -> int:
    """CPUs as slurmd counts them (``slurmd -C``), else the CPUs this process may use."""
    try:
        out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout
        match = re.search(r"\bCPUs=(\d+)", out)
        if match:
            return int(match.group(1))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return len(os.sched_getaffinity(0))


class SlurmCluster:
    """slurmctld, slurmd and munged for one node named localhost, all state under ``root``."""

    def __init__(self, root: Path, real_memory_mb: int = 1024) -> None:
        """Lay out the folders (nothing starts yet).

        Args:
            root: folder for the config, state, spool, pid and log files.
            real_memory_mb: memory the node declares (not enforced: CR_CPU schedules CPUs only).
        """
        self.root = Path(root)
        self.real_memory_mb = real_memory_mb
        self.conf = self.root / "slurm.conf"
        self.cpus = 0
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []

    # ------------------------------------------------------------------------------------------------ lifecycle

    def _write_config(self) -> None:
        for sub in ("state", "spool", "run", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.cpus = _detected_cpus()
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=draftsmith-test",
                    "SlurmctldHost=localhost",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/backfill",
                    "JobRequeue=1",
                    "ReturnToService=2",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "MailProg=/bin/true",
                    "KillWait=5",
                    "MinJobAge=600",
                    f"SlurmctldPort={free_port()}",  # free ports: another cluster may run on this machine
                    f"SlurmdPort={free_port()}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.real_memory_mb} "
                    "State=UNKNOWN",
                    "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _start_munge(self) -> None:
        """munged as the munge user, unless one already answers. It is left running when the cluster stops: every
        cluster on the machine authenticates through the one munged (two test modules' clusters can run at once, and
        the first to stop took the other's authentication with it: its job step could not report its end)."""
        if subprocess.run(["munge", "-n"], capture_output=True, timeout=10).returncode == 0:
            return
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create"], check=False, capture_output=True, timeout=30)
        for d in (Path("/run/munge"), Path("/var/lib/munge"), Path("/var/log/munge")):
            d.mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        if key.exists():
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
        cmd = ["setpriv", "--reuid=munge", "--regid=munge", "--init-groups", _which("munged"), "-F"]
        out = subprocess.DEVNULL  # munged keeps its own log (/var/log/munge)
        subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)  # not stopped with the cluster: shared
        deadline = time.monotonic() + 15
        while subprocess.run(["munge", "-n"], capture_output=True, timeout=10).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("munged did not start; see /var/log/munge/munged.log")
            time.sleep(0.2)

    def _spawn(self, cmd: list[str], log_name: str) -> None:
        log = open(self.root / "log" / log_name, "a")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        self._procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def start(self, timeout: float = 30.0) -> SlurmCluster:
        """Start munged (if needed), slurmctld and slurmd; return once the node is idle."""
        self._write_config()
        self._start_munge()
        self._spawn([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        self._spawn([_which("slurmd"), "-D", "-f", str(self.conf), "-N", "localhost"], "slurmd.out")
        deadline = time.monotonic() + timeout
        while True:
            out = self.command(["sinfo", "-h", "-o", "%t"], check=False).stdout.strip()
            if out.startswith("idle"):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the SLURM node is not idle after {timeout:.0f} s (sinfo: {out!r}):\n{self.logs()}")
            if any(p.poll() is not None for p in self._procs):
                logs = self.logs()
                self.stop()
                raise RuntimeError(f"a SLURM daemon exited at start:\n{logs}")
            time.sleep(0.3)

    def stop(self) -> None:
        """Cancel every job, stop the daemons this cluster started (their whole sessions), close the logs."""
        if self._procs:
            self.command(["scancel", "--full", "--user", "root"], check=False)
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        self._procs = []
        for log in self._logs:
            log.close()
        self._logs = []

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            parts.append(f"----- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # ------------------------------------------------------------------------------------------------- commands

    def env(self) -> dict[str, str]:
        """The environment that points SLURM's client commands at this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def command(self, cmd: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ...); empty when the job is unknown."""
        proc = self.command(["scontrol", "-o", "show", "job", job_id], check=False)
        if proc.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def wait_state(
        self, job_id: str, states: set[str], timeout: float, release_requeued: bool = True, poll: float = 0.5
    ) -> dict[str, str]:
        """Poll until the job's state is in ``states``; return its last ``scontrol show job`` record.

        Args:
            job_id: the job.
            states: the JobState values to wait for.
            timeout: seconds before giving up (RuntimeError with the daemons' logs).
            release_requeued: a requeued job waits about 120 s before it may start again; issue
                ``scontrol update StartTime=now`` once it has shown PENDING after a restart for RELEASE_AFTER_S.
            poll: seconds between polls.
        """
        deadline = time.monotonic() + timeout
        released_at_restart = -1
        pending_since: dict[int, float] = {}
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            state = info.get("JobState", "")
            if state in states:
                return info
            if state in FINAL_STATES:
                raise RuntimeError(f"job {job_id} ended as {state}, waiting for {sorted(states)}: {info}")
            restarts = int(info.get("Restarts", "0") or 0)
            if release_requeued and state == "PENDING" and restarts > 0 and released_at_restart != restarts:
                # not within the second of the requeue: slurmd refuses a launch whose credential is not newer than
                # the revocation of the job's last one, in whole seconds ("Job credential revoked": the job FAILED)
                pending_since.setdefault(restarts, time.monotonic())
                if time.monotonic() - pending_since[restarts] >= RELEASE_AFTER_S:
                    self.command(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
                    released_at_restart = restarts
            time.sleep(poll)
        raise RuntimeError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {info}\n{self.logs()}")

    def submit(self, args: list[str]) -> str:
        """Run ``sbatch --parsable ARGS`` and return the job id."""
        out = self.command(["sbatch", "--parsable", *args]).stdout.strip()
        return out.split(";")[0]


# --------------------------------------------------------------------------------------- jobs and their callbacks


def kd_job_override(
    run: Path, corpus, target: Path, max_steps: int, every_n: int, batch_size: int = 4, extra_callbacks: tuple = ()
) -> dict:
    """Overrides of recipes/quickstart/kd.yaml for a tiny job writing under ``run``: the test target and student, a
    record of every training batch (``run/batches.jsonl``), ``extra_callbacks`` and last PreemptionCheckpoint."""
    from tests.recipe_runs import kd_override, record_batches

    callbacks = [
        record_batches(run),
        *extra_callbacks,
        {"class_path": "trainer.distributed.preemption.PreemptionCheckpoint"},
    ]
    return kd_override(run, corpus, target, max_steps, every_n, batch_size, callbacks)


@contextlib.contextmanager
def running_cluster(root: Path, min_cpus: int = 1, pythonpath: Path | None = None):
    """A started :class:`SlurmCluster` under ``root``, with ``SLURM_CONF`` (and ``pythonpath`` on ``PYTHONPATH``, for
    the tests' callbacks inside jobs) set in this process's environment until it stops; the test is skipped where
    SLURM cannot be installed or the node has fewer than ``min_cpus`` CPUs, and fails when the cluster does not
    start."""
    import pytest

    reason = ensure_installed()
    if reason is not None:
        pytest.skip(f"SLURM cannot be installed here: {reason}")
    c = SlurmCluster(root)
    try:
        c.start()
    except RuntimeError as err:
        pytest.fail(f"the test SLURM cluster did not start: {err}")
    if c.cpus < min_cpus:
        c.stop()
        pytest.skip(f"the SLURM node has {c.cpus} CPUs, fewer than the {min_cpus} tasks of the test job")
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PYTHONPATH")}
    os.environ["SLURM_CONF"] = str(c.conf)  # sbatch, scontrol and the job itself talk to this cluster
    if pythonpath is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), saved["PYTHONPATH"]) if p)
    try:
        yield c
    finally:
        c.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def recorded_batches(run: Path) -> dict[tuple[int, int], str]:
    """(step, rank) -> batch hash from ``run/batches.jsonl``; a step recorded twice (replayed after a resume from an
    older checkpoint) must have seen the same batch both times."""
    out: dict[tuple[int, int], str] = {}
    for line in (run / "batches.jsonl").read_text().splitlines():
        record = json.loads(line)
        key = (record["step"], record["rank"])
        if key in out and out[key] != record["batch"]:
            raise AssertionError(f"step {key[0]} rank {key[1]} saw a different batch after the resume")
        out[key] = record["batch"]
    return out


class WaitAtStep(L.Callback):
    """At the end of the batch that reaches ``step``, touch ``<marker>.<rank>`` and wait until ``release`` exists, or
    without ``release`` until the run's PreemptionCheckpoint has received a signal (SLURM's USR1 before a real time
    limit): gives a test a fixed point to signal or kill a run at, whatever the machine's speed."""

    def __init__(self, step: int, marker: str, release: str | None = None, timeout: float = 600.0) -> None:
        """Args: step: global step to wait at; marker: path prefix of the "waiting" files; release: the file that
        ends the wait (None: a signal ends it); timeout: seconds before waiting stops anyway."""
        self.step = step
        self.marker = marker
        self.release = None if release is None else Path(release)
        self.timeout = timeout

    def _released(self, trainer) -> bool:
        if self.release is not None:
            return self.release.exists()
        return any(getattr(callback, "_received", None) for callback in trainer.callbacks)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step != self.step or self._released(trainer):
            return
        Path(f"{self.marker}.{trainer.global_rank}").touch()
        deadline = time.monotonic() + self.timeout
        while not self._released(trainer) and time.monotonic() < deadline:
            time.sleep(0.05)


class SignalAtStep(L.Callback):
    """Sends ``signal`` to this process at the end of the batch that reaches ``step`` (an in-process preemption)."""

    def __init__(self, step: int, signal: str = "SIGTERM") -> None:
        """Args: step: global step; signal: signal name."""
        self.step = step
        self.signum = _signal.Signals[signal]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class KillAtStep(L.Callback):
    """Rank ``rank`` kills its own process with SIGKILL at the start of ``step`` (a task lost with its node: nothing
    runs after it); with ``once``, only while that file does not exist (it is created first), so a resumed run
    passes the step."""

    def __init__(self, step: int, rank: int = 1, once: str | None = None) -> None:
        """Args: step: global step; rank: the global rank that dies; once: a file that limits the kill to one run."""
        self.step = step
        self.rank = rank
        self.once = Path(once) if once is not None else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        if self.once is not None:
            if self.once.exists():
                return
            self.once.touch()
        os.kill(os.getpid(), _signal.SIGKILL)
