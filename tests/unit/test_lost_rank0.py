"""A surviving rank's report when rank 0 dies, decided in trainer/cli.py's ``_end``: the order in which a dying rank 0's
sockets close must not change it. A real TCPStore hosted by a child process stands in for rank 0's store; a plain
listening socket on MASTER_PORT for the listening socket a dying process has not closed yet."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from tests._multiproc import free_port
from trainer import cli

GLOO_RESET = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:16014: Connection reset by peer.")
HOST = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, wait_for_workers=False)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def orphaned_store():
    """A store client whose host (a child process, rank 0) was killed: every call on it fails."""
    import torch.distributed as dist

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", HOST, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "ready"
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
        store.set("draftsmith/probe", b"1")
    finally:
        host.kill()
        host.wait(timeout=30)
    time.sleep(0.2)
    return store


def _end_on_rank1(store, monkeypatch, master_port: int, capsys) -> tuple[int, str]:
    from trainer.training.recipe import DraftsmithCLI

    monkeypatch.setattr(DraftsmithCLI, "running_trainer", None)  # no fit in this process (another test's may linger)
    monkeypatch.setattr(cli, "_rank_and_store", lambda: (1, store))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master_port))
    status = cli._end(GLOO_RESET)
    return status, capsys.readouterr().err


LINE = (
    "error: rank 1: rank 0 of 2 stopped answering (its process died or was killed, unless it printed an error of its "
    "own); the other ranks stop too"
)


def test_rank0_still_closing_its_listener_is_reported_as_lost(orphaned_store, monkeypatch, capsys):
    """The probe connects (the dying rank 0's listening socket still accepts), the store call after it fails: rank 1
    reports rank 0 lost with status 1, as when the probe is refused (it answered status 2 and no line before)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        status, err = _end_on_rank1(orphaned_store, monkeypatch, listener.getsockname()[1], capsys)
    assert status == cli.PEER_LOST_STATUS == 1, err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [LINE], err


def test_rank0_gone_is_reported_as_lost(orphaned_store, monkeypatch, capsys):
    """The probe is refused: the same line and status."""
    status, err = _end_on_rank1(orphaned_store, monkeypatch, free_port(), capsys)
    assert status == 1, err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [LINE], err
