"""Run commands as one process group under a hard timeout, and kill the whole group on timeout or on a failed rank.

When one rank of a multi-process run dies, its peers can wait forever in a collective, spinning at full CPU; a
plain ``subprocess.run(timeout=...)`` kills only the direct child and leaves them orphaned. Everything started
here lives in one new process group (children launched by Lightning included), which is killed as a whole.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class GroupResult:
    """Outcome of a process group run."""

    returncodes: list[int | None]  # one per started process; None: killed before it exited
    timed_out: bool
    output: str  # the logs of every process, rank by rank

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def end_worker() -> None:
    """Ends a test worker rank once its checks passed: waits for every rank at a barrier (no rank leaves while a peer
    still talks to it), flushes its output and exits with status 0 without running the interpreter's teardown. A gloo
    group torn down at interpreter exit has aborted finished ranks on CI (``terminate called without an active
    exception``, exit -6), with and without ``destroy_process_group`` first, since DeepSpeed keeps its own reference
    to the group."""
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_group(
    cmd: Sequence[str],
    timeout: float,
    log_dir: Path,
    nprocs: int = 1,
    env: Mapping[str, str] | None = None,
    rank_env: bool = False,
    cwd: str | None = None,
) -> GroupResult:
    """Start ``nprocs`` copies of ``cmd`` in one new process group and wait for all of them.

    Args:
        cmd: the command line.
        timeout: seconds before the whole group is killed.
        log_dir: each process writes its stdout and stderr to ``log_dir/proc{i}.log``.
        nprocs: copies to start.
        env: environment of every process (default: this process's environment).
        rank_env: give copy i the torch.distributed variables of local rank i (MASTER_ADDR, MASTER_PORT,
            WORLD_SIZE, NODE_RANK, LOCAL_RANK, RANK), as torchrun does; Lightning then uses these processes
            instead of launching its own.
        cwd: working folder of the processes.

    Returns:
        The return codes, whether the timeout fired, and the logs. As soon as one process exits non-zero, the rest of
        the group is killed (its peers would otherwise hang in a collective).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ if env is None else env)
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = []
    pgid: int | None = None
    try:
        for i in range(nprocs):
            proc_env = dict(base_env)
            if rank_env:
                proc_env.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    WORLD_SIZE=str(nprocs),
                    NODE_RANK="0",
                    LOCAL_RANK=str(i),
                    RANK=str(i),
                )
            log = open(log_dir / f"proc{i}.log", "w")  # noqa: SIM115 - closed in finally
            logs.append(log)
            # the first process founds a new group (its pid is the group id); the others join it
            group = 0 if pgid is None else pgid
            p = subprocess.Popen(
                list(cmd), stdout=log, stderr=subprocess.STDOUT, env=proc_env, cwd=cwd, process_group=group
            )
            if pgid is None:
                pgid = p.pid
            procs.append(p)
        deadline = time.monotonic() + timeout
        timed_out = False
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                break  # a rank failed: its peers would hang
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        if pgid is not None:
            _kill_group(pgid)  # also reaps Lightning's own child ranks and leftovers
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    output = "\n".join(
        f"===== process {i} (exit {codes[i]}) =====\n{(log_dir / f'proc{i}.log').read_text(errors='replace')}"
        for i in range(len(procs))
    )
    return GroupResult(returncodes=codes, timed_out=timed_out, output=output)
