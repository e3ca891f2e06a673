"""One run per checkpoint folder: a second fresh `fit` into a folder holding checkpoints is refused, and so is any fit
while another process runs in it; `--ckpt_path last` resumes into it, also after the other process was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.recipe_runs import RECIPES, ROOT, TINY_MODEL, data_overrides, fit, merge, trainer_overrides, write_override
from trainer.checkpoints.run_folder import LOCK_FILE, CheckpointFolderError

pytestmark = pytest.mark.slow

RECIPE = "quickstart/tiny_target.yaml"  # pretraining: needs only the tokenizer, no trained target


def override(run: Path, corpus, max_steps: int, every_n: int = 2, callbacks=()) -> dict:
    """A tiny pretraining run writing its checkpoints to ``run/checkpoints`` and its model to ``run/model``."""
    out = merge(
        trainer_overrides(run, max_steps=max_steps, every_n=every_n),
        data_overrides(corpus, batch_size=2),
        {"model": {"init_args": {"tokenizer": str(corpus.tokenizer_dir), "export_dir": str(run / "model")}}},
        {"model": {"init_args": TINY_MODEL}},
    )
    out["trainer"]["callbacks"] += list(callbacks)
    return out


def _step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_fresh_run_into_a_used_folder_is_refused_and_a_resume_is_not(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    fit(RECIPE, override(run, tiny_corpus, max_steps=2), tmp_path / "first")
    before = _files(ckpts)
    assert {"last.ckpt", "config.yaml", LOCK_FILE} <= set(before)
    config = (ckpts / "config.yaml").read_text()
    exported = (run / "model" / "model.safetensors").read_bytes()

    # the same recipe again, fresh, for longer: refused before anything is written into the folder
    with pytest.raises(CheckpointFolderError) as err:
        fit(RECIPE, override(run, tiny_corpus, max_steps=4), tmp_path / "second")
    message = str(err.value)
    assert str(ckpts) in message and "last.ckpt" in message and "--ckpt_path last" in message
    assert _files(ckpts) == before and (ckpts / "config.yaml").read_text() == config
    assert (run / "model" / "model.safetensors").read_bytes() == exported

    # a resume from another run's checkpoint into this folder is refused too
    other = tmp_path / "other"
    fit(RECIPE, override(other, tiny_corpus, max_steps=2), tmp_path / "third")
    foreign = other / "checkpoints" / "last.ckpt"
    with pytest.raises(CheckpointFolderError, match=f"a run resumed from {foreign}"):
        fit(RECIPE, override(run, tiny_corpus, max_steps=4), tmp_path / "fourth", ("--ckpt_path", str(foreign)))
    assert _files(ckpts) == before

    # --ckpt_path last resumes this folder's run (the refusals released the folder): one last file, at step 4
    cli = fit(RECIPE, override(run, tiny_corpus, max_steps=4), tmp_path / "fifth", ("--ckpt_path", "last"))
    assert cli.trainer.global_step == 4
    assert [name for name in _files(ckpts) if name.startswith("last")] == ["last.ckpt"]
    assert _step(ckpts / "last.ckpt") == 4
    assert "max_steps: 4" in (ckpts / "config.yaml").read_text()
    # and so does a checkpoint of the folder given by its path
    cli = fit(
        RECIPE, override(run, tiny_corpus, max_steps=6), tmp_path / "sixth", ("--ckpt_path", str(ckpts / "last.ckpt"))
    )
    assert cli.trainer.global_step == 6 and _step(ckpts / "last.ckpt") == 6
    assert [name for name in _files(ckpts) if name.startswith("last")] == ["last.ckpt"]


@pytest.mark.filterwarnings("ignore:.*ckpt_path=.last.. is set, but there is no last checkpoint")
def test_a_running_fit_holds_its_folder_until_it_dies(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    wait = {
        "class_path": "tests.slurm_cluster.WaitAtStep",
        "init_args": {"step": 1, "marker": str(run / "waiting"), "release": str(run / "release")},
    }
    recipe = write_override(tmp_path / "override.yaml", override(run, tiny_corpus, max_steps=3, callbacks=[wait]))
    cmd = [sys.executable, "-m", "trainer.cli", "fit", "--config", str(RECIPES / RECIPE), "--config", str(recipe)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (run / "waiting.0").exists():
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run never reached step 1"
            time.sleep(0.1)
        # the first run is at step 1, before its first checkpoint (step 2): the folder holds no checkpoint yet
        assert not list((run / "checkpoints").glob("*.ckpt"))
        for extra in ((), ("--ckpt_path", "last")):
            with pytest.raises(CheckpointFolderError, match=f"in use by a running fit \\(pid {proc.pid} on "):
                fit(RECIPE, override(run, tiny_corpus, max_steps=3), tmp_path / "second", extra)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
    assert proc.returncode == -signal.SIGKILL
    assert f"pid {proc.pid} " in (run / "checkpoints" / LOCK_FILE).read_text()  # the dead run's lock file stays

    # the lock died with its process: the requeued command line runs (no last checkpoint yet: from the start)
    cli = fit(RECIPE, override(run, tiny_corpus, max_steps=3), tmp_path / "third", ("--ckpt_path", "last"))
    assert cli.trainer.global_step == 3 and _step(run / "checkpoints" / "last.ckpt") == 3
    assert f"pid {os.getpid()} " in (run / "checkpoints" / LOCK_FILE).read_text()
