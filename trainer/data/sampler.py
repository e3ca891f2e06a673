"""A sampler whose order is a function of (seed, epoch), split across ranks, that can start mid-epoch.

How exact resume works (Lightning 2.6)
--------------------------------------
The order of one epoch is a permutation of the data set drawn from `seed + epoch` (or the identity when not
shuffling). It is cut into *global batches* of `batch_size * world_size` samples (a ragged tail is dropped); rank `r`
takes the `r`-th slice of `batch_size` samples of every global batch. So the data seen up to a point is described by
two numbers: the epoch and the number of global batches consumed in it, and that description does not depend on how
a global batch is split across ranks.

Saving: Lightning calls `LightningDataModule.state_dict()` while writing a checkpoint. The data module answers with
`ResumableSampler.position(batches_done)`, where `batches_done` is Lightning's own count of training batches that
finished their `training_step` in the current epoch (`fit_loop.epoch_loop.batch_progress.current.processed`). That
count is exact whatever the prefetching: batches fetched ahead by the loop or by worker processes are not counted,
and a checkpoint written at an epoch's end records the start of the next epoch.

Restoring: `trainer.fit(..., ckpt_path=...)` restores the data module's state (`load_state_dict`) and the loops'
progress before it calls `train_dataloader()`. The data module then builds the sampler at the saved epoch with
`start_batch` set, and the first iteration of that epoch skips the consumed global batches by index arithmetic
(no data is read for them). `len()` stays the full epoch, as Lightning expects: its progress counter resumes at the
consumed count and stops the epoch at `len()`. Lightning then calls `set_epoch()` with the same epoch; later epochs
start at batch 0. Worker processes only receive indices from this sampler (it runs in the main process), so
`num_workers > 0` changes nothing. (The train DataLoader also exposes an empty `state_dict` so that Lightning, which
warns about loaders it cannot resume, knows this one resumes; the position lives in the data module's state.)

Tested in tests/unit/test_resume_batches.py with a real Trainer: N steps straight against N/2 steps, a checkpoint and
a resume, for checkpoints written mid-epoch, on an epoch's last batch, in the next epoch, at an epoch's end, after a
mid-epoch validation, with gradient accumulation, with worker processes, and from 2 DDP ranks to 1 process.

A different world size resumes exactly when the global batch size (`batch_size * world_size`) is unchanged. A
different global batch size, data set size, seed or shuffle setting is refused with an error that names the values:
the position could not be mapped without dropping or repeating data.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from trainer.interface.errors import CheckpointError, DataError

log = logging.getLogger(__name__)

POSITION_VERSION = 1


class ResumableSampler(DistributedSampler):
    """Per-rank sample indices of fixed-size global batches, deterministic in (seed, epoch), resumable mid-epoch.

    It subclasses `DistributedSampler` only so that Lightning leaves it in place under distributed strategies (it
    replaces or wraps any other sampler); none of the parent's behaviour is used.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        epoch: int = 0,
        start_batch: int = 0,
    ) -> None:
        """Build the sampler.

        Args:
            num_samples: size of the data set.
            batch_size: samples per batch on one rank.
            rank: this process's global rank.
            world_size: number of ranks; a global batch holds `batch_size * world_size` samples.
            seed: seeds the per-epoch permutation (`seed + epoch`).
            shuffle: permute each epoch; False keeps the data set order.
            epoch: the epoch of the first iteration.
            start_batch: global batches of `epoch` already consumed; the first iteration of that epoch skips them.
        """
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad sampler geometry: batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.num_samples_total = int(num_samples)
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.num_replicas = int(world_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = int(epoch)
        self.global_batch_size = self.batch_size * self.num_replicas
        self.batches_per_epoch = self.num_samples_total // self.global_batch_size
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the data set has {num_samples} sequences, fewer than one global batch of {self.global_batch_size}"
                f" (batch_size={batch_size} x world_size={world_size})"
            )
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch={start_batch} is outside the epoch's {self.batches_per_epoch} batches")
        # The parent's public attributes, for code that inspects a DistributedSampler.
        self.num_samples = self.batches_per_epoch * self.batch_size
        self.total_size = self.batches_per_epoch * self.global_batch_size
        self.drop_last = True
        self._resume: tuple[int, int] | None = (self.epoch, int(start_batch)) if start_batch else None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration (Lightning calls this at the start of every epoch)."""
        if self._resume is not None and epoch != self._resume[0]:
            log.warning(
                "resume position was for epoch %d but epoch %d starts: starting it at 0", self._resume[0], epoch
            )
            self._resume = None
        self.epoch = int(epoch)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The global order of `epoch`: [num_samples] indices, a function of (seed, epoch) only."""
        if not self.shuffle:
            return torch.arange(self.num_samples_total)
        gen = torch.Generator()
        gen.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples_total, generator=gen)

    def _batches(self) -> tuple[int, torch.Tensor]:
        """The first global batch this iteration serves, and this rank's samples of it and of every later batch of the
        epoch, [batches - start, B] (consuming the resume position)."""
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        self._resume = None
        order = self.epoch_order(self.epoch)[: self.batches_per_epoch * self.global_batch_size]
        # [batches, world, B] -> this rank's [batches - start, B]
        return start, order.view(self.batches_per_epoch, self.num_replicas, self.batch_size)[start:, self.rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._batches()[1].reshape(-1).tolist())

    def __len__(self) -> int:
        # The full epoch even when resuming mid-epoch: Lightning's progress counter resumes at the consumed count.
        return self.batches_per_epoch * self.batch_size

    def position(self, batches_done: int) -> dict[str, Any]:
        """The data position after `batches_done` batches of the current epoch, as saved in a checkpoint."""
        epoch, done = self.epoch, int(batches_done)
        if done >= self.batches_per_epoch:
            epoch, done = epoch + 1, 0
        return {
            "version": POSITION_VERSION,
            "epoch": epoch,
            "consumed_samples": done * self.global_batch_size,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.num_samples_total,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }


def resume_point(
    position: dict[str, Any], num_samples: int, batch_size: int, world_size: int, seed: int, shuffle: bool
) -> tuple[int, int]:
    """Map a saved `position` to (epoch, start_batch) for a new sampler, or refuse with an error naming the values."""
    if position.get("version") != POSITION_VERSION:
        raise CheckpointError(
            f"unknown data position version {position.get('version')!r} (expected {POSITION_VERSION})"
        )
    expected = {"num_samples": num_samples, "seed": seed, "shuffle": shuffle}
    for key, value in expected.items():
        if position[key] != value:
            raise CheckpointError(
                f"cannot resume the data position: the checkpoint has {key}={position[key]!r}, this run has"
                f" {key}={value!r} (the data set or its order changed)"
            )
    global_batch = batch_size * world_size
    if position["global_batch_size"] != global_batch:
        raise CheckpointError(
            f"cannot resume the data position exactly: the checkpoint used a global batch of"
            f" {position['global_batch_size']} samples, this run uses {global_batch} (batch_size={batch_size} x"
            f" world_size={world_size}); keep batch_size x world_size unchanged to resume"
        )
    consumed = int(position["consumed_samples"])
    return int(position["epoch"]), consumed // global_batch


class MixedLengthSampler(ResumableSampler):
    """A `ResumableSampler` over long rows (trainer/data/packing.py `MixedRows`) that also says, per global batch,
    whether the batch is served as long rows or split into short ones: it yields ``(index, long)`` pairs.

    The long batches of an epoch are ``round(long_fraction * batches_per_epoch)`` of its global batches, drawn from
    ``seed + epoch`` after the epoch's order: a function of (seed, epoch, batch) only, the same on every rank, so a
    resumed run serves the batches (and their lengths) of an uninterrupted one.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        epoch: int = 0,
        start_batch: int = 0,
        long_fraction: float = 0.0,
    ) -> None:
        """Build the sampler.

        Args:
            num_samples: long rows in the data set.
            batch_size: long rows per batch on one rank (a short batch splits each into several short rows).
            rank: this process's global rank.
            world_size: number of ranks.
            seed: seeds the per-epoch permutation and schedule (`seed + epoch`).
            shuffle: permute each epoch; False keeps the data set order (the schedule is still drawn).
            epoch: the epoch of the first iteration.
            start_batch: global batches of `epoch` already consumed.
            long_fraction: share of each epoch's global batches served as long rows, in [0, 1].
        """
        super().__init__(num_samples, batch_size, rank, world_size, seed, shuffle, epoch, start_batch)
        self.long_fraction = float(long_fraction)

    def long_batches(self, epoch: int) -> torch.Tensor:
        """[batches_per_epoch] bool: which global batches of `epoch` are long; a function of (seed, epoch) only."""
        gen = torch.Generator()
        gen.manual_seed(self.seed + epoch)
        if self.shuffle:
            torch.randperm(self.num_samples_total, generator=gen)  # the epoch's order: the schedule is the next draw
        n = self.batches_per_epoch
        chosen = torch.randperm(n, generator=gen)[: round(self.long_fraction * n)]  # [n_long]
        long = torch.zeros(n, dtype=torch.bool)
        long[chosen] = True
        return long

    def __iter__(self) -> Iterator[tuple[int, bool]]:  # type: ignore[override]
        epoch = self.epoch
        start, mine = self._batches()  # [batches - start, B]
        long = self.long_batches(epoch)[start:]  # [batches - start]
        flags = long[:, None].expand_as(mine)  # [batches - start, B]
        return iter(zip(mine.reshape(-1).tolist(), flags.reshape(-1).tolist(), strict=True))

    def position(self, batches_done: int) -> dict[str, Any]:
        """`ResumableSampler.position`, with the long share (a resume under another share is refused)."""
        return {**super().position(batches_done), "long_fraction": self.long_fraction}
