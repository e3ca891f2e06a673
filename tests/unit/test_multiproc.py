"""The process-group runner kills every process of a run when one fails or the timeout fires."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tests._multiproc import run_group


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_failed_rank_kills_its_peers_at_once(tmp_path: Path) -> None:
    # rank 0 fails at once; rank 1 would sleep for a minute (a peer stuck in a collective)
    code = "import os, sys, time; r = int(os.environ['LOCAL_RANK']); sys.exit(3) if r == 0 else time.sleep(60)"
    t0 = time.monotonic()
    res = run_group([sys.executable, "-c", code], timeout=50, log_dir=tmp_path, nprocs=2, rank_env=True)
    assert time.monotonic() - t0 < 30
    assert not res.ok and not res.timed_out
    assert res.returncodes[0] == 3 and res.returncodes[1] != 0


def test_timeout_kills_grandchildren(tmp_path: Path) -> None:
    # the child starts a grandchild (as Lightning starts rank 1) and both hang; the whole group must go
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    res = run_group([sys.executable, "-c", code], timeout=3, log_dir=tmp_path / "logs")
    assert res.timed_out and not res.ok
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_rank_environment_and_logs(tmp_path: Path) -> None:
    code = "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'])"
    res = run_group([sys.executable, "-c", code], timeout=30, log_dir=tmp_path, nprocs=2, rank_env=True)
    assert res.ok, res.output
    lines = [(tmp_path / f"proc{i}.log").read_text().split() for i in range(2)]
    assert [line[:4] for line in lines] == [["rank", "0", "of", "2"], ["rank", "1", "of", "2"]]
    assert lines[0][4] == lines[1][4]  # one rendezvous port for the group
