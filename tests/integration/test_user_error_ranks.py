"""A user error in a 2-process DDP fit (Lightning's own process launcher, gloo on CPU) through the real ``draftsmith
fit``: the ``error:`` line is printed once, by the rank that saw it (rank 0 for an error every rank raises; ``rank 1:``
for one only rank 1 raised, while rank 0 waits for it in a collective), the command exits with status 2 without a
traceback, and no rank is left running.

The error is raised in ``setup`` by a test callback on the ranks a row names, as a shard only one rank reads would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import yaml

from tests.recipe_runs import RECIPES, ROOT, kd_override
from trainer.interface.errors import DataError

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
TIMEOUT_S = 400
MESSAGE = "shard /data/train-000001.tar: truncated (1234 bytes, the manifest says 5678)"


class RaiseOnRanks(L.Callback):
    """Raises a DataError in ``setup`` on the global ranks ``ranks``."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.global_rank in self.ranks:
            raise DataError(MESSAGE, hint="rerun draftsmith precompute")


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("ranks", "line"),
    [([0, 1], f"error: {MESSAGE}"), ([1], f"error: rank 1: {MESSAGE}")],
    ids=["every-rank", "rank-1-only"],
)
def test_a_user_error_under_ddp_is_printed_once(tiny_corpus, random_target, tmp_path, ranks, line):
    run = tmp_path / "run"
    run.mkdir()
    raise_on = {"class_path": f"{__name__}.RaiseOnRanks", "init_args": {"ranks": ranks}}
    override = kd_override(run, tiny_corpus, random_target, 4, 4, 2, callbacks=[raise_on])
    (tmp_path / "override.yaml").write_text(yaml.safe_dump(override))
    cmd = [str(Path(sys.executable).parent / "draftsmith"), "fit", "--config", str(RECIPES / "quickstart/kd.yaml")]
    cmd += ["--config", str(RECIPES / "_base/ddp.yaml"), "--config", str(tmp_path / "override.yaml")]
    cmd += ["--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    env = {k: v for k, v in os.environ.items() if k != "DRAFTSMITH_DEBUG"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    log = tmp_path / "fit.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        status = proc.wait(timeout=TIMEOUT_S)
        deadline = time.monotonic() + 20  # the other rank ends too, within seconds
        while _alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left_running = _alive(proc.pid)
    except subprocess.TimeoutExpired:
        status, left_running = None, True
    finally:
        if _alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    output = log.read_text(errors="replace")
    assert status is not None, f"the fit hung:\n{output[-4000:]}"
    assert not left_running, f"a rank was still running after the main process ended:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-6000:]
    errors = [x for x in output.splitlines() if x.startswith("error:")]
    assert errors == [line], output[-4000:]
    assert output.splitlines().count("hint: rerun draftsmith precompute") == 1
    assert status == 2, output[-4000:]
