"""Session fixtures built once per test run, also when pytest-xdist runs the suite in several worker processes.

Each worker has its own session, so a plain session fixture would train the tiny target once per worker. The folders
here live in the run's shared temporary folder (the parent of each worker's own) and are built by the first worker
that asks, under a file lock; the others wait for the lock and find the folder done.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

DONE = ".built"


def worker_id() -> str | None:
    """The pytest-xdist worker this process is (``gw0``, ``gw1``...), None when the suite runs in one process."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``<run tmp>/<name>``, built by ``build(folder)`` exactly once per test run, whichever worker asks first.

    A build that raised leaves no marker, so the next worker that asks builds it again (and fails the same way).
    """
    root = tmp_path_factory.getbasetemp()
    if worker_id() is not None:
        root = root.parent  # xdist gives each worker <run tmp>/popen-gwN: the parent is the run's, shared
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / DONE).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            (folder / DONE).write_text("")
    return folder
