"""Virtualenvs for the reference clients (opt-in tests, ``DRAFTSMITH_TEST_CLIENTS=1``): each under
``.cache/clients/<name>``, built once with torch==2.13.0 first (so that pip keeps the CPU build) and the client's
pinned package constrained to that torch, reused while its stamp matches the pins. A failed install skips the test
with pip's message."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
# pip pulls these as the clients' dependencies, built for another torch: their extensions fail to load, and
# transformers imports torchvision whenever it is installed. No client imports either.
UNUSED = ("torchvision", "torchaudio")
INSTALL_TIMEOUT = 1200  # seconds per pip command


def opt_in(name: str) -> list:
    """The markers of a client test: ``clients``, skipped unless DRAFTSMITH_TEST_CLIENTS=1."""
    return [
        pytest.mark.clients,
        pytest.mark.skipif(
            os.environ.get("DRAFTSMITH_TEST_CLIENTS") != "1",
            reason=f"client test: set DRAFTSMITH_TEST_CLIENTS=1 (builds a {name} virtualenv in .cache/clients)",
        ),
    ]


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "--quiet", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{' '.join(cmd)}: no result after {INSTALL_TIMEOUT} s")
    if done.returncode:
        pytest.skip(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


def client_python(name: str, package: str) -> Path:
    """The python of the ``name`` client venv holding ``package`` (a pip requirement), built on first use under a lock
    (parallel sessions share the folder)."""
    client = ROOT / ".cache" / "clients" / name
    python, stamp, want = client / "bin" / "python", client / ".installed", f"{TORCH} {package}\n"
    client.parent.mkdir(parents=True, exist_ok=True)
    with open(client.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == want and python.is_file():
            return python
        stamp.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-m", "venv", "--clear", str(client)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"python -m venv {client} failed:\n{done.stderr[-2000:]}")
        _pip(python, TORCH)
        constraints = client / "constraints.txt"
        constraints.write_text(TORCH + "\n")
        _pip(python, package, "-c", str(constraints))
        subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *UNUSED], capture_output=True)
        stamp.write_text(want)
    return python
