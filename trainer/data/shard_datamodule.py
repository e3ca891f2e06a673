"""Streams teacher-signal shards (``draftsmith precompute``) as batches for the offline KD and EAGLE-3 objectives.

A batch is the TextDataModule's ``{input_ids, labels, loss_mask}`` ([B, S] each) plus

    teacher_topk_ids       [B, S, k] int32    the teacher's top-k next-token ids at every position
    teacher_topk_logprobs  [B, S, k] float16|float32  their log-probabilities at the shards' temperature
    teacher_hidden         [B, n, S, H] float16|bfloat16|float32  (only when ``hidden_layers`` is set) in that order

How the stream is split and ordered (one epoch):
- Shard ``j`` of a split belongs to rank ``j % world`` (fixed across epochs). Each epoch, a rank permutes its shards
  with ``(seed, epoch)`` (``shuffle_shards``) and deals them to its DataLoader workers round-robin; each worker reads
  its shards in order through a shuffle buffer of ``shuffle_buffer`` samples seeded by ``(seed, epoch, rank,
  worker)`` and yields whole batches (a worker's ragged tail is dropped).
- Every rank yields the same number of batches per epoch, ``floor((N_r - workers * (B - 1)) / B)`` minimised over
  ranks (N_r: the rank's samples), so DDP ranks never wait on one another; the surplus batches of an epoch are dropped.
  The DataLoader takes batches from its workers round-robin; each worker yields exactly its share of that count.

What resume guarantees: the order is a function of (manifest, seed, epoch, batch size, world size, workers) only.
The checkpoint records the epoch and the number of batches the rank consumed in it (Lightning's count of finished
training steps); on resume every worker regenerates its stream and skips its consumed batches (reading, not
training on, them; without a shuffle buffer whole shards are skipped unread), and the workers are rotated so the
round-robin continues where it stopped: the batches after the checkpoint are exactly those of an uninterrupted run.
Resuming with another batch size, world size, worker count, seed or shard set is refused with the values named.

Bad input: every array is checked (trainer/data/shards.py); a broken shard raises an error naming the shard and
sample, or with ``on_error="skip"`` the rest of that shard is skipped, logged with a running count, and the worker
refills its share by reading its shards again. Each shard's sha256 is compared with the manifest's
(``verify_sha256``, on by default) while the shard streams, so a shard whose bytes changed after precompute raises
naming it once it has been read to the end (its earlier samples have been served by then; with ``on_error="skip"``
the mismatch is logged). A shard a worker stops reading part-way (the end of its share in an epoch) is not checked
in that epoch. Hashing costs about 1 s of one CPU core per GB read, in the loader's workers.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.data.shards import ShardError, ShardInfo, ShardMeta, check_compatible, iter_shard, load_manifest
from trainer.data.sources import check_shards_folder
from trainer.distributed.preemption import stop_signal_worker_init
from trainer.distributed.sequence_parallel import data_parallel_rank_world
from trainer.interface.errors import CheckpointError, DataError, RecipeError

log = logging.getLogger(__name__)

POSITION_VERSION = 1
IGNORE_INDEX = -100


def round_robin(counts: list[int], total: int) -> tuple[list[int], int]:
    """Items taken from each worker in the first ``total`` of a round-robin that skips exhausted workers, and the
    worker whose turn is next."""
    if total > sum(counts):
        raise ValueError(f"cannot take {total} batches from workers holding {counts}")
    taken, pos = [min(min(counts), total // len(counts))] * len(counts), 0  # whole rounds where none runs out
    while sum(taken) < total:
        if taken[pos] < counts[pos]:
            taken[pos] += 1
        pos = (pos + 1) % len(counts)
    return taken, pos


class ShardStream(IterableDataset):
    """One rank's batches of one split, for the epoch in ``self.epoch`` (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        meta: ShardMeta,
        shards: list[ShardInfo],
        batch_size: int,
        workers: int,
        rank: int,
        batches_per_epoch: int,
        seed: int,
        shuffle_shards: bool,
        shuffle_buffer: int,
        hidden_layers: list[int],
        on_error: str,
        verify_sha256: bool,
    ) -> None:
        self.folder, self.meta, self.shards = folder, meta, shards
        self.batch_size, self.workers, self.rank = batch_size, workers, rank
        self.batches_per_epoch = batches_per_epoch
        self.seed, self.shuffle_shards, self.shuffle_buffer = seed, shuffle_shards, shuffle_buffer
        self.hidden_layers, self.on_error, self.verify_sha256 = hidden_layers, on_error, verify_sha256
        self.epoch, self.start_batch, self.resuming = 0, 0, False

    def __len__(self) -> int:
        return self.batches_per_epoch  # the full epoch even when resuming: Lightning's counter resumes mid-epoch

    def worker_shards(self, epoch: int) -> list[list[ShardInfo]]:
        """The shards each logical worker reads in ``epoch``."""
        order = list(range(len(self.shards)))
        if self.shuffle_shards:
            order = np.random.default_rng([self.seed, epoch, self.rank]).permutation(len(self.shards)).tolist()
        return [[self.shards[i] for i in order[w :: self.workers]] for w in range(self.workers)]

    def shares(self, epoch: int, start: int) -> tuple[list[int], list[int], list[int]]:
        """(batches each logical worker yields this epoch, batches it skips on resume, logical worker of each
        physical worker in the resumed round-robin)."""
        counts = [sum(s.samples for s in ws) // self.batch_size for ws in self.worker_shards(epoch)]
        take, _ = round_robin(counts, self.batches_per_epoch)
        skip, nxt = round_robin(take, start)
        rotated = [(nxt + i) % self.workers for i in range(self.workers)]
        return take, skip, [w for w in rotated if take[w] > skip[w]]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        physical, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if workers != self.workers:
            raise RuntimeError(f"ShardStream planned for {self.workers} workers, runs in {workers}")
        # planned now, not lazily: the loader resets start_batch once the iterator exists
        take, skip, order = self.shares(self.epoch, self.start_batch)
        if physical >= len(order):
            return iter(())
        worker = order[physical]
        batches = self._batches(self.worker_shards(self.epoch)[worker], worker, skip[worker] * self.batch_size)
        return itertools.islice(batches, take[worker] - skip[worker])

    def _samples(self, shards: list[ShardInfo], skip: int) -> Iterator[dict[str, np.ndarray]]:
        """The worker's samples in shard order, without the first ``skip`` (whole shards among them are not read)."""
        skipped_bad, passes = 0, 0
        while True:
            produced = 0
            for shard in shards:
                if skip >= shard.samples:
                    skip -= shard.samples
                    continue
                path = self.folder / shard.file
                seen = 0
                try:
                    for _key, arrays in iter_shard(path, self.meta, shard.sha256 if self.verify_sha256 else None):
                        seen += 1
                        if skip > 0:
                            skip -= 1
                            continue
                        produced += 1
                        yield arrays
                    if seen != shard.samples:
                        raise ShardError(f"{path}: {seen} samples, the manifest says {shard.samples}")
                except ShardError as err:
                    if self.on_error == "raise":
                        raise
                    skipped_bad += shard.samples - seen
                    log.warning("skipping the rest of a broken shard (%d samples skipped so far): %s", skipped_bad, err)
            if skipped_bad == 0:
                return
            if produced == 0 and passes > 0:
                raise ShardError(f"no readable sample in {[s.file for s in shards]}")
            passes += 1  # broken shards were skipped: refill the worker's share by reading its shards again

    def _batches(self, shards: list[ShardInfo], worker: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        if self.shuffle_buffer > 1:
            rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker])
            stream = _shuffled(self._samples(shards, 0), self.shuffle_buffer, rng)
        else:
            stream, skip = self._samples(shards, skip), 0
        batch: list[dict[str, np.ndarray]] = []
        for arrays in stream:
            if skip > 0:  # consumed before the checkpoint: regenerated through the buffer, then dropped
                skip -= 1
                continue
            batch.append(arrays)
            if len(batch) == self.batch_size:
                yield self.collate(batch)
                batch = []

    def collate(self, samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))  # [B, S + 1]
        mask = torch.from_numpy(np.stack([s["loss_mask"] for s in samples]))  # [B, S]
        labels = torch.where(mask, tokens[:, 1:], torch.full_like(tokens[:, 1:], IGNORE_INDEX))  # [B, S]
        batch = {
            "input_ids": tokens[:, :-1].contiguous(),
            "labels": labels,
            "loss_mask": mask,
            "teacher_topk_ids": torch.from_numpy(np.stack([s["topk_ids"] for s in samples])),  # [B, S, k]
            "teacher_topk_logprobs": torch.from_numpy(np.stack([s["topk_logprobs"] for s in samples])),  # [B, S, k]
        }
        if self.hidden_layers:
            hidden = np.stack([np.stack([s[f"hidden_{i}"] for i in self.hidden_layers]) for s in samples])
            t = torch.from_numpy(hidden)  # [B, n, S, H]
            batch["teacher_hidden"] = t.view(torch.bfloat16) if self.meta.hidden_dtype == "bfloat16" else t
        return batch


def _shuffled(stream: Iterator[Any], size: int, rng: np.random.Generator) -> Iterator[Any]:
    """A shuffle buffer: fill to ``size``, then yield a random element and replace it with the next one."""
    buffer: list[Any] = []
    for item in stream:
        if len(buffer) < size:
            buffer.append(item)
            continue
        i = int(rng.integers(len(buffer)))
        buffer[i], item = item, buffer[i]
        yield item
    rng.shuffle(buffer)
    yield from buffer


def _epoch_of(trainer: Any) -> int:
    return int(trainer.fit_loop.epoch_progress.current.processed) if trainer is not None else 0


class ShardLoader(DataLoader):
    """Sets the stream's epoch before each iteration (workers receive a fresh copy of the stream every epoch)."""

    def __init__(self, stream: ShardStream, epoch_fn: Callable[[], int], num_workers: int) -> None:
        super().__init__(
            stream, batch_size=None, num_workers=num_workers, persistent_workers=False,
            worker_init_fn=stop_signal_worker_init(),  # Ctrl-C, SIGTERM: the main process saves
        )  # fmt: skip
        self.epoch_fn = epoch_fn

    def __iter__(self):
        stream: ShardStream = self.dataset  # type: ignore[assignment]
        if stream.resuming:
            stream.resuming = False  # the first iteration after a resume runs the checkpoint's epoch and position
        else:
            stream.epoch, stream.start_batch = self.epoch_fn(), 0
        return super().__iter__()  # workers (or the in-process iterator) take their plan here

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class ShardDataModule(L.LightningDataModule):
    """Teacher-signal shards written by ``draftsmith precompute``, streamed as KD batches."""

    def __init__(
        self,
        shards: str,
        tokenizer: str | None = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        shuffle_shards: bool = True,
        shuffle_buffer: int = 1000,
        hidden_layers: list[int] | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        verify_sha256: bool = True,
    ) -> None:
        """
        Args:
            shards: the folder written by ``draftsmith precompute`` (with manifest.json).
            tokenizer: the recipe's tokenizer; when set, shards made with another tokenizer are refused.
            batch_size: sequences per batch on one device.
            val_batch_size: sequences per validation batch (default: batch_size).
            num_workers: DataLoader worker processes per rank (shards are dealt to them).
            seed: seeds the shard order and the shuffle buffer (with the epoch, rank and worker).
            shuffle_shards: permute each rank's shards every epoch.
            shuffle_buffer: samples in each worker's shuffle buffer (0 or 1: stream order).
            hidden_layers: teacher hidden_states indices to load as ``teacher_hidden`` (must be in the shards).
            on_error: "raise" stops at a broken shard naming it and the sample; "skip" logs, counts and skips it.
            verify_sha256: check each shard's sha256 against the manifest, hashing the bytes as they are read (no
                second read; about 1 s of CPU per GB): a corrupted shard raises naming it once read to the end.
                False skips the check (for shards on a checksummed file system, or to save that CPU time).
        """
        super().__init__()
        if batch_size < 1 or num_workers < 0 or shuffle_buffer < 0:
            raise RecipeError(
                f"batch_size >= 1, num_workers >= 0, shuffle_buffer >= 0: got {batch_size}, "
                f"{num_workers}, {shuffle_buffer}"
            )
        check_shards_folder(shards)  # at construction, before anything is read
        # kept in checkpoints, not logged: the objective's hyperparameters are, and Lightning refuses to merge a key
        # both hold with two values (model.seed and data.seed); the run folder's config.yaml holds every value
        self.save_hyperparameters(logger=False)
        self.shards_dir = Path(shards)
        self.tokenizer_path = tokenizer
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.num_workers, self.seed = num_workers, seed
        self.shuffle_shards, self.shuffle_buffer = shuffle_shards, shuffle_buffer
        self.hidden_layers = list(hidden_layers or [])
        self.on_error, self.verify_sha256 = on_error, verify_sha256
        self.meta: ShardMeta | None = None
        self.shard_list: list[ShardInfo] = []
        self._train: ShardStream | None = None
        self._resume_position: dict[str, Any] | None = None

    @property
    def seq_len(self) -> int:
        return self.meta.seq_len if self.meta is not None else 0

    def setup(self, stage: str | None = None) -> None:
        """Reads and checks the manifest (and the tokenizer, when given)."""
        if self.meta is not None:
            return
        meta, shard_list = load_manifest(self.shards_dir)
        missing = [i for i in self.hidden_layers if i not in meta.hidden_layers]
        if missing:
            raise DataError(
                f"{self.shards_dir}: hidden_layers {missing} not stored (the shards hold {meta.hidden_layers})"
            )
        if self.tokenizer_path is not None:
            from trainer.data.tokenizer import load_tokenizer, tokenizer_hash

            check_compatible(
                meta, str(self.shards_dir), tokenizer_hash=tokenizer_hash(load_tokenizer(self.tokenizer_path))
            )
        self.meta, self.shard_list = meta, shard_list

    def training_rows(self, chunk_rows: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The training split's rows, in manifest order, as (ids [r, S + 1] int32, trained [r, S + 1] bool) chunks.

        The convention of TextDataModule's rows (trainer/data/packing.py): ``trained[j]`` flags token ``j`` as a
        trained label, so ``trained[1:]`` is a shard's ``loss_mask`` and ``trained[0]`` (never a label) is False.
        Counting these with trainer/methods/eagle3/vocab_map.py gives the counts of the same rows read through
        TextDataModule. Only tokens and loss masks are decoded (no top-k, no hidden states); every rank reads every
        training shard. Broken shards raise, or with ``on_error="skip"`` the rest of the shard is skipped and logged.
        """
        self.setup()
        assert self.meta is not None
        ids: list[np.ndarray] = []
        trained: list[np.ndarray] = []
        for shard in (s for s in self.shard_list if s.split == "train"):
            path = self.shards_dir / shard.file
            digest = shard.sha256 if self.verify_sha256 else None
            try:
                for _key, arrays in iter_shard(path, self.meta, digest, fields=("tokens", "loss_mask")):
                    ids.append(arrays["tokens"])  # [S + 1]
                    trained.append(np.concatenate([np.zeros(1, dtype=bool), arrays["loss_mask"]]))  # [S + 1]
                    if len(ids) == chunk_rows:
                        yield np.stack(ids), np.stack(trained)
                        ids, trained = [], []
            except ShardError as err:
                if self.on_error == "raise":
                    raise
                log.warning("skipping the rest of a broken shard while reading the training rows: %s", err)
        if ids:
            yield np.stack(ids), np.stack(trained)

    def _rank_world(self) -> tuple[int, int]:
        """(rank, world size) among the data-parallel replicas: the ranks sharing rows under sequence parallelism
        read the same rows."""
        return data_parallel_rank_world(self.trainer)

    def manifest_digest(self) -> str:
        return hashlib.sha256("".join(s.sha256 for s in self.shard_list).encode()).hexdigest()[:16]

    def stream(self, split: str, batch_size: int, shuffle: bool, rank: int, world: int) -> ShardStream:
        """The ``split`` stream of ``rank`` (of ``world``)."""
        self.setup()
        assert self.meta is not None
        split_shards = [s for s in self.shard_list if s.split == split]
        workers = max(1, self.num_workers)
        per_rank = [split_shards[r::world] for r in range(world)]
        totals = [sum(s.samples for s in shards) for shards in per_rank]
        batches = min((n - workers * (batch_size - 1)) // batch_size for n in totals)
        if batches < 1:
            raise DataError(
                f"{self.shards_dir}: the {split} split ({len(split_shards)} shards, {sum(totals)} sequences) is too "
                f"small for {world} ranks x {workers} workers x batch {batch_size}: write smaller shards "
                f"(samples_per_shard) or use fewer workers"
            )
        return ShardStream(
            self.shards_dir,
            self.meta,
            per_rank[rank],
            batch_size,
            workers,
            rank,
            batches,
            self.seed,
            shuffle and self.shuffle_shards,
            self.shuffle_buffer if shuffle else 0,
            self.hidden_layers,
            self.on_error,
            self.verify_sha256,
        )

    def _position_key(self, world: int) -> dict[str, Any]:
        return {
            "version": POSITION_VERSION,
            "batch_size": self.batch_size,
            "world_size": world,
            "num_workers": max(1, self.num_workers),
            "seed": self.seed,
            "shuffle_shards": self.shuffle_shards,
            "shuffle_buffer": self.shuffle_buffer,
            "shards": self.manifest_digest(),
        }

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        self._train = self.stream("train", self.batch_size, True, rank, world)
        resuming = self.trainer is None or getattr(self.trainer, "ckpt_path", None) is not None
        if self._resume_position and resuming:
            key = self._position_key(world)
            for name, value in key.items():
                if self._resume_position.get(name) != value:
                    raise CheckpointError(
                        f"cannot resume the shard stream exactly: the checkpoint has {name}="
                        f"{self._resume_position.get(name)!r}, this run has {name}={value!r}"
                    )
            self._train.epoch = int(self._resume_position["epoch"])
            self._train.start_batch = int(self._resume_position["batches_done"])
            self._train.resuming = True
        self._resume_position = None
        trainer = self.trainer
        # Lightning's own epoch index, the one it passes to samplers' set_epoch (trainer.current_epoch lags it)
        return ShardLoader(self._train, lambda: _epoch_of(trainer), self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        self.setup()
        if not any(s.split == "val" for s in self.shard_list):
            return []
        rank, world = self._rank_world()
        return ShardLoader(self.stream("val", self.val_batch_size, False, rank, world), lambda: 0, self.num_workers)

    def state_dict(self) -> dict[str, Any]:
        """The training position: epoch and batches this rank consumed in it (see the module docstring)."""
        trainer = self.trainer
        if self._train is None or trainer is None or trainer.state.fn != "fit":
            return {"position": self._resume_position} if self._resume_position else {}
        done, epoch = trainer.fit_loop.epoch_loop.batch_progress.current.processed, self._train.epoch
        if done >= min(trainer.num_training_batches, self._train.batches_per_epoch):
            epoch, done = epoch + 1, 0
        return {"position": {**self._position_key(trainer.world_size), "epoch": epoch, "batches_done": done}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume_position = state_dict.get("position")


def checked_shard_data(
    datamodule: Any, *, vocab_size: int, tokenizer: Any | None, teacher: str, temperature: float
) -> ShardDataModule:
    """The recipe's datamodule for an objective with ``teacher_signals: shards``: a ShardDataModule, set up, whose
    shards were made with this vocabulary size, tokenizer (when given), teacher and temperature (ValueError otherwise,
    naming the shards and the value)."""
    if not isinstance(datamodule, ShardDataModule):
        raise RecipeError(
            "model.teacher_signals=shards needs data: trainer.data.shard_datamodule.ShardDataModule, got "
            f"{type(datamodule).__name__}"
        )
    from trainer.data.tokenizer import tokenizer_hash

    datamodule.setup("fit")  # refuses shards that lack a requested hidden layer, naming it
    check_compatible(
        datamodule.meta,
        str(datamodule.shards_dir),
        vocab_size=vocab_size,
        tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else None,
        teacher=teacher,
        temperature=temperature,
    )
    return datamodule
