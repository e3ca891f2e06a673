"""A real ``draftsmith fit`` process stopped by a signal: SIGTERM (a scheduler) and SIGINT (Ctrl-C) leave a
resumable ``last.ckpt`` of the step they arrived at and a non-zero exit status (128 + the signal, as shells report it);
SIGKILL loses only the steps since the last periodic checkpoint, which stays whole. ``--ckpt_path last`` then runs
to the end and exits 0. A disk that fills while a checkpoint is written ends the fit with status 2 and one error line
naming the folder, and the previous ``last.ckpt`` still loads.

Every fit gets PreemptionCheckpoint and AtomicCheckpointIO by default (trainer/training/recipe.py) and exits with
``exit_status_after_fit`` (trainer/cli.py): the recipes here name neither.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import lightning as L
import psutil
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from tests.cli_server import CliChild, CliServer
from tests.recipe_runs import RECIPES, kd_override, merge, record_batches, write_override
from tests.slurm_cluster import recorded_batches
from trainer.distributed.preemption import PreemptionCheckpoint, default_preemption_checkpoint, exit_status_after_fit
from trainer.interface.errors import RecipeError

MAX_STEPS = 12
EVERY_N = 5  # periodic checkpoints at steps 5 and 10
SIGNAL_AT = 7  # the run waits at the end of step 7 while the test signals it
START_TIMEOUT_S = 600.0


def _override(run: Path, corpus, target: Path, wait: bool, workers: int = 0) -> dict:
    """The KD fit of MAX_STEPS steps recording its batches, waiting at the end of step SIGNAL_AT when ``wait``, with
    ``workers`` DataLoader worker processes."""
    callbacks = [record_batches(run)]
    if wait:
        callbacks.append(
            {
                "class_path": "tests.slurm_cluster.WaitAtStep",
                "init_args": {"step": SIGNAL_AT, "marker": str(run / "waiting"), "release": str(run / "release")},
            }
        )
    override = kd_override(run, corpus, target, MAX_STEPS, EVERY_N, callbacks=callbacks)
    return merge(override, {"data": {"init_args": {"num_workers": workers}}}) if workers else override


@pytest.fixture(scope="module")
def cli():
    """One process that has imported ``trainer.cli``, forked per fit (tests/cli_server.py): each fit is still a fresh
    process running what the ``draftsmith`` script runs, in a session of its own, without ten seconds of imports."""
    with CliServer() as server:
        yield server


def _start(cli: CliServer, run: Path, override: dict, name: str, extra: tuple[str, ...] = ()) -> tuple[CliChild, Path]:
    config = write_override(run.parent / f"{name}.yaml", override)
    args = ["fit", "--config", str(RECIPES / "quickstart/kd.yaml"), "--config", str(config), *extra]
    log_path = run.parent / f"{name}.log"
    return cli.start(args, log_path, cwd=run.parent), log_path


def _wait_until_waiting(proc: CliChild, run: Path, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not Path(f"{run / 'waiting'}.0").exists():
        assert proc.poll() is None, f"the run ended early:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"the run never reached step {SIGNAL_AT}:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def _finish(proc: CliChild, log: Path, timeout: float = 600.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail(f"the run did not end:\n{log.read_text()[-4000:]}")


def _ckpt_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def _steps(run: Path) -> list[int]:
    """The global step of every training batch the run's processes started, in order (``run/batches.jsonl``)."""
    recorded_batches(run)  # a step replayed after a resume saw the same batch
    return [json.loads(line)["step"] for line in (run / "batches.jsonl").read_text().splitlines()]


def _resume_to_the_end(cli: CliServer, run: Path, corpus, target: Path, from_step: int, workers: int = 0) -> None:
    """``--ckpt_path last`` in a fresh process: it starts at ``from_step``, runs to MAX_STEPS and exits 0."""
    before = len(_steps(run))
    override = _override(run, corpus, target, wait=False, workers=workers)
    proc, log = _start(cli, run, override, "resume", ("--ckpt_path", "last"))
    status = _finish(proc, log)
    assert status == 0, log.read_text()[-4000:]
    assert _steps(run)[before:] == list(range(from_step, MAX_STEPS))


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_last_ckpt_and_exits_non_zero(cli, tiny_corpus, random_target, tmp_path, signum, status):
    run = tmp_path / "run"
    run.mkdir()
    proc, log = _start(cli, run, _override(run, tiny_corpus, random_target, wait=True), "signalled")
    try:
        _wait_until_waiting(proc, run, log)
        os.kill(proc.pid, signum)  # the main process only, as `kill PID` does
        time.sleep(0.5)
        (run / "release").touch()
        code = _finish(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert code == status, f"exit status {code}, expected {status}:\n{log.read_text()[-4000:]}"
    assert _ckpt_step(run / "checkpoints" / "last.ckpt") == SIGNAL_AT
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert _steps(run) == list(range(SIGNAL_AT))
    if signum == signal.SIGTERM:  # both signals save the same last.ckpt: one resume shows it runs on to the end
        _resume_to_the_end(cli, run, tiny_corpus, random_target, SIGNAL_AT)


WORKERS = 2


@pytest.fixture(scope="module")
def uninterrupted_with_workers(cli, tiny_corpus, random_target, tmp_path_factory) -> Path:
    """The run the signalled ones are compared with: MAX_STEPS steps with WORKERS DataLoader workers, no signal."""
    run = tmp_path_factory.mktemp("uninterrupted_with_workers") / "run"
    run.mkdir()
    proc, log = _start(cli, run, _override(run, tiny_corpus, random_target, wait=False, workers=WORKERS), "whole")
    assert _finish(proc, log) == 0, log.read_text()[-4000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_with_dataloader_workers(
    cli, tiny_corpus, random_target, uninterrupted_with_workers, tmp_path, signum, status
):
    """``data.num_workers: 2``, the signal sent to the fit's whole process group (as Ctrl-C in a terminal and SLURM's
    scancel or time limit send it), so that the DataLoader workers receive it too: the fit saves last.ckpt of the step
    it arrived at and exits with 128 + the signal as without workers, no worker process outlives it, and the resume
    ends with the batches and weights of an uninterrupted run with workers."""
    run = tmp_path / "run"
    run.mkdir()
    proc, log = _start(cli, run, _override(run, tiny_corpus, random_target, wait=True, workers=WORKERS), "signalled")
    try:
        _wait_until_waiting(proc, run, log)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= WORKERS, [c.cmdline() for c in children]  # the training loader's persistent workers
        assert os.getpgid(proc.pid) == proc.pid  # a session of its own: the group is the fit and its children
        os.killpg(proc.pid, signum)
        time.sleep(0.5)
        (run / "release").touch()
        code = _finish(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left running: {[c.pid for c in alive]}"
    assert code == status, f"exit status {code}, expected {status}:\n{log.read_text()[-4000:]}"
    assert _ckpt_step(run / "checkpoints" / "last.ckpt") == SIGNAL_AT
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert _steps(run) == list(range(SIGNAL_AT))
    _resume_to_the_end(cli, run, tiny_corpus, random_target, SIGNAL_AT, workers=WORKERS)
    assert recorded_batches(run) == recorded_batches(uninterrupted_with_workers)
    ours, theirs = (load_file(r / "student" / "model.safetensors") for r in (run, uninterrupted_with_workers))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_kill_9_keeps_the_last_periodic_checkpoint(cli, tiny_corpus, random_target, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc, log = _start(cli, run, _override(run, tiny_corpus, random_target, wait=True), "killed")
    try:
        _wait_until_waiting(proc, run, log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert _ckpt_step(run / "checkpoints" / "last.ckpt") == EVERY_N  # steps 6 and 7 are lost
    _resume_to_the_end(cli, run, tiny_corpus, random_target, EVERY_N)


class FillDisk(L.Callback):
    """At the end of step ``step``, fills the file system of ``folder`` with a file there, leaving ``leave`` bytes:
    the checkpoint written at the next interval finds the disk full."""

    def __init__(self, step: int, folder: str, leave: int = 4096) -> None:
        self.step, self.folder, self.leave = step, Path(folder), leave

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step != self.step:
            return
        stats = os.statvfs(self.folder)
        todo = stats.f_bavail * stats.f_frsize - self.leave
        chunk = b"\0" * (1 << 20)
        with (self.folder / "filler").open("wb") as f:
            try:
                while todo > 0:
                    todo -= f.write(chunk[: min(len(chunk), todo)])
                    f.flush()
            except OSError:
                pass


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs mounted under ``tmp_path`` (skips where this process may not mount one)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow
def test_a_disk_that_fills_while_checkpointing_ends_the_fit_with_one_error(
    cli, tiny_corpus, random_target, tmp_path, small_disk
):
    run = tmp_path / "run"
    run.mkdir()
    folder = small_disk / "checkpoints"
    override = _override(run, tiny_corpus, random_target, wait=False)
    checkpoint = override["trainer"]["callbacks"][0]["init_args"]
    checkpoint.update(dirpath=str(folder), every_n_train_steps=2, save_top_k=0, save_last=True)
    fill = {"class_path": f"{__name__}.FillDisk", "init_args": {"step": 3, "folder": str(small_disk)}}
    override["trainer"]["callbacks"].append(fill)
    proc, log = _start(cli, run, override, "disk_full")
    status = _finish(proc, log)
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.strip()]
    assert status == 2, output[-4000:]
    assert "Traceback" not in output, output[-6000:]
    assert lines[-2] == (
        f"error: could not write checkpoint last.ckpt in {folder}: No space left on device; the previous last.ckpt "
        "there is intact"
    ), output[-3000:]
    assert lines[-1].startswith(f"hint: free space in {folder}")
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert _ckpt_step(folder / "last.ckpt") == 2  # the previous checkpoint, whole


# ------------------------------------------------------------------------------------------------- in one process


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0))), batch_size=4)


class SignalAt(L.Callback):
    """Sends ``signum`` to this process ``times`` times at the end of step ``step``."""

    def __init__(self, step: int, signum: int, times: int = 1) -> None:
        self.step, self.signum, self.times = step, signum, times

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def _tiny_fit(folder: Path, max_steps: int, signal_at: SignalAt) -> tuple[L.Trainer, PreemptionCheckpoint]:
    preemption = PreemptionCheckpoint()
    trainer = L.Trainer(
        max_steps=max_steps,
        callbacks=[signal_at, preemption, ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_last=True)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        default_root_dir=folder,
    )  # fmt: skip
    trainer.fit(Tiny())
    return trainer, preemption


def test_ctrl_c_saves_at_the_batch_end_and_the_status_is_130(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    trainer, preemption = _tiny_fit(tmp_path, 10, SignalAt(3, signal.SIGINT))
    assert signal.getsignal(signal.SIGINT) == before  # Python's handler is back after fit
    assert trainer.global_step == 3 and preemption.stopped_by == signal.SIGINT
    assert _ckpt_step(tmp_path / "last.ckpt") == 3
    assert exit_status_after_fit(trainer) == 130


def test_a_second_ctrl_c_stops_at_once_with_status_1(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exited:  # Lightning's KeyboardInterrupt handling: sys.exit(1)
            _tiny_fit(tmp_path, 10, SignalAt(3, signal.SIGINT, times=2))
    finally:
        signal.signal(signal.SIGINT, before)  # Lightning leaves SIGINT ignored after a KeyboardInterrupt
    assert exited.value.code == 1
    assert _ckpt_step(tmp_path / "last.ckpt") == 2  # the periodic one: nothing was saved at step 3


def test_a_signal_at_the_last_step_or_none_is_status_0(tmp_path):
    trainer, preemption = _tiny_fit(tmp_path / "last", 4, SignalAt(4, signal.SIGTERM))
    assert preemption.stopped_by == signal.SIGTERM and preemption.finished
    assert exit_status_after_fit(trainer) == 0
    trainer, preemption = _tiny_fit(tmp_path / "none", 4, SignalAt(99, signal.SIGTERM))
    assert preemption.stopped_by is None and exit_status_after_fit(trainer) == 0
    trainer, _ = _tiny_fit(tmp_path / "term", 10, SignalAt(2, signal.SIGTERM))
    assert trainer.global_step == 2 and exit_status_after_fit(trainer) == 143


def test_the_default_instance_leaves_a_fit_without_checkpoints_alone(tmp_path):
    options = dict(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(
        callbacks=[default_preemption_checkpoint()], enable_checkpointing=False, default_root_dir=tmp_path, **options
    )
    trainer.fit(Tiny())
    assert trainer.global_step == 3 and exit_status_after_fit(trainer) == 0
    strict = L.Trainer(callbacks=[PreemptionCheckpoint()], enable_checkpointing=False, **options)
    with pytest.raises(RecipeError, match="PreemptionCheckpoint needs a ModelCheckpoint"):
        strict.fit(Tiny())
