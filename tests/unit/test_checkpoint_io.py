"""AtomicCheckpointIO: a checkpoint is replaced whole or not at all; a full disk leaves the previous last.ckpt
loadable and says so, naming the folder; a truncated checkpoint given to ``--ckpt_path`` is named."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from trainer.checkpoints.atomic import AtomicCheckpointIO, default_checkpoint_io
from trainer.interface.errors import CheckpointError


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0))), batch_size=4)


def _trainer(folder: Path, max_steps: int, plugin: AtomicCheckpointIO) -> L.Trainer:
    checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=0, save_last=True)
    return L.Trainer(
        max_steps=max_steps,
        plugins=[plugin],
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=folder,
    )


def _step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_a_fit_writes_whole_checkpoints_and_no_temporary_file(tmp_path):
    folder = tmp_path / "checkpoints"
    plugin = default_checkpoint_io()
    assert isinstance(plugin, AtomicCheckpointIO)
    trainer = _trainer(folder, 3, plugin)
    trainer.fit(Tiny())
    assert trainer.strategy.checkpoint_io is plugin
    assert _step(folder / "last.ckpt") == 3
    assert _leftovers(folder) == []
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((folder / "last.ckpt").stat().st_mode) == 0o666 & ~umask  # as a plain open() would create


def _fail_after(monkeypatch, good_saves: int) -> list[int]:
    """Make AtomicCheckpointIO's writes after the first ``good_saves`` write part of the bytes, then hit a full
    disk; returns the running count of writes."""
    real = AtomicCheckpointIO.write
    count = [0]

    def write(checkpoint, f) -> None:
        count[0] += 1
        if count[0] <= good_saves:
            real(checkpoint, f)
            return
        f.write(b"PK\x03\x04" + b"\0" * 1000)  # a partial zip, as a disk that fills mid-write leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(AtomicCheckpointIO, "write", staticmethod(write))
    return count


def test_a_full_disk_during_a_fit_keeps_the_previous_last_checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    _fail_after(monkeypatch, good_saves=2)
    trainer = _trainer(folder, 5, AtomicCheckpointIO())
    with pytest.raises(CheckpointError, match=rf"last.ckpt in {folder}: No space left on device; the previous") as err:
        trainer.fit(Tiny())
    assert "intact" in str(err.value) and "free space" in err.value.hint
    assert _step(folder / "last.ckpt") == 2  # the step-2 checkpoint, whole
    assert _leftovers(folder) == []


def test_a_full_disk_on_a_direct_save_keeps_the_old_file(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    trainer = _trainer(folder, 2, AtomicCheckpointIO())
    trainer.fit(Tiny())
    before = (folder / "last.ckpt").read_bytes()
    _fail_after(monkeypatch, good_saves=0)
    with pytest.raises(CheckpointError, match=str(folder)):
        trainer.save_checkpoint(folder / "last.ckpt")
    assert (folder / "last.ckpt").read_bytes() == before
    with pytest.raises(CheckpointError, match=r"no other.ckpt was there before"):
        trainer.save_checkpoint(folder / "other.ckpt")
    assert not (folder / "other.ckpt").exists() and _leftovers(folder) == []


def test_resuming_from_a_truncated_checkpoint_names_it(tmp_path):
    folder = tmp_path / "checkpoints"
    _trainer(folder, 2, AtomicCheckpointIO()).fit(Tiny())
    cut = folder / "cut.ckpt"
    data = (folder / "last.ckpt").read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"checkpoint {cut}: truncated"):
        _trainer(tmp_path / "again", 4, AtomicCheckpointIO()).fit(Tiny(), ckpt_path=str(cut))
