"""Fault tolerance of a local run: SIGTERM saves last.ckpt and stops; SIGKILL loses only the steps since the last
checkpoint; either way ``--ckpt_path last`` ends with the same weights (and the same batches) as an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.recipe_runs import RECIPES, ROOT, fit, write_override
from tests.slurm_cluster import kd_job_override, recorded_batches

pytestmark = pytest.mark.slow

MAX_STEPS = 30
EVERY_N = 10


def _ckpt_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def _assert_same_weights(a_dir: Path, b_dir: Path) -> None:
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def reference(tiny_corpus, tiny_target, tmp_path_factory) -> Path:
    """The uninterrupted run: MAX_STEPS steps, checkpoints every EVERY_N."""
    run = tmp_path_factory.mktemp("uninterrupted")
    fit("quickstart/kd.yaml", kd_job_override(run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N), run)
    return run


def test_sigterm_saves_last_checkpoint_and_resume_matches(reference, tiny_corpus, tiny_target, tmp_path):
    run = tmp_path / "run"
    signal_at = {"class_path": "tests.slurm_cluster.SignalAtStep", "init_args": {"step": 13, "signal": "SIGTERM"}}
    override = kd_job_override(run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N, extra_callbacks=(signal_at,))
    before = signal.getsignal(signal.SIGTERM)
    cli = fit("quickstart/kd.yaml", override, run)
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored after fit
    # stopped at step 13, between the step-10 and step-20 checkpoints, with a checkpoint of step 13
    assert cli.trainer.global_step == 13
    assert _ckpt_step(run / "checkpoints" / "last.ckpt") == 13
    assert max(step for step, _ in recorded_batches(run)) == 12

    # a fresh process would run this exact command line
    override_resume = kd_job_override(run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N)
    cli = fit("quickstart/kd.yaml", override_resume, run, extra_args=("--ckpt_path", "last"))
    assert cli.trainer.global_step == MAX_STEPS
    assert recorded_batches(run) == recorded_batches(reference)
    _assert_same_weights(reference / "student", run / "student")


def test_sigkill_then_ckpt_path_last_matches(reference, tiny_corpus, tiny_target, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    wait = {
        "class_path": "tests.slurm_cluster.WaitAtStep",
        "init_args": {"step": 25, "marker": str(run / "waiting"), "release": str(run / "release")},
    }
    override = write_override(
        tmp_path / "override.yaml",
        kd_job_override(run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N, extra_callbacks=(wait,)),
    )
    cmd = [sys.executable, "-m", "trainer.cli", "fit", "--config", str(RECIPES / "quickstart/kd.yaml")]
    cmd += ["--config", str(override)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not Path(f"{run / 'waiting'}.0").exists():
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached step 25"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
    assert proc.returncode == -signal.SIGKILL
    assert _ckpt_step(run / "checkpoints" / "last.ckpt") == 20  # steps 21-25 are lost

    cli = fit(
        "quickstart/kd.yaml",
        kd_job_override(run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N),
        run,
        extra_args=("--ckpt_path", "last"),
    )
    assert cli.trainer.global_step == MAX_STEPS
    # steps 20-24 ran twice, on the same batches (recorded_batches checks), and the whole run saw the reference's
    assert recorded_batches(run) == recorded_batches(reference)
    _assert_same_weights(reference / "student", run / "student")
