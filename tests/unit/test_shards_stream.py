"""ShardDataModule streams: rank and worker split, equal batch counts, exact mid-epoch resume, broken shards."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tests.unit.test_shards_format import META, flip_payload_bytes, sample
from trainer.data.shard_datamodule import ShardDataModule, ShardLoader, round_robin
from trainer.data.shards import ShardError, ShardWriter, write_manifest

SIZES = [7, 5, 9, 3, 8, 6, 4]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    infos, n = [], 0
    for j, size in enumerate(SIZES):
        writer = ShardWriter(folder / f"train-{j:06d}.tar", "train", META)
        for _ in range(size):
            s = sample(rng)
            s["tokens"][0] = n % META.vocab_size  # distinct rows: the first token and the rest identify a sample
            writer.add(f"{n:09d}", s)
            n += 1
        infos.append(writer.close())
    write_manifest(folder, META, infos)
    return folder


def digests(loader) -> list[str]:
    return [hashlib.sha256(b["input_ids"].numpy().tobytes()).hexdigest()[:12] for b in loader]


def rows(loader) -> list[bytes]:
    return [row.numpy().tobytes() for b in loader for row in b["input_ids"]]


class Tagged(IterableDataset):
    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __iter__(self):
        w = get_worker_info().id
        for i in range(self.counts[w]):
            yield torch.tensor([w, i])


@pytest.mark.parametrize("counts", [[3, 1, 4], [0, 2, 5], [2, 2, 2]])
def test_round_robin_matches_the_dataloader_worker_order(counts):
    seen = [tuple(t.tolist()) for t in DataLoader(Tagged(counts), batch_size=None, num_workers=3)]
    assert len(seen) == sum(counts)
    for total in range(sum(counts) + 1):
        taken, nxt = round_robin(counts, total)
        assert taken == [sum(1 for w, _ in seen[:total] if w == i) for i in range(3)]
        if total < len(seen):  # the next turn is the worker that delivers the next item
            order = [(nxt + i) % 3 for i in range(3)]
            assert seen[total][0] == next(w for w in order if taken[w] < counts[w])


def loader(dm: ShardDataModule, epoch: int = 0, rank: int = 0, world: int = 1, start: int = 0) -> ShardLoader:
    stream = dm.stream("train", dm.batch_size, True, rank, world)
    stream.epoch, stream.start_batch, stream.resuming = epoch, start, start > 0
    return ShardLoader(stream, lambda: epoch, dm.num_workers)


def test_ranks_get_equal_batch_counts_and_disjoint_samples(shard_dir):
    dm = ShardDataModule(str(shard_dir), batch_size=2, shuffle_buffer=4)
    per_rank = [rows(loader(dm, rank=r, world=2)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    everything = per_rank[0] + per_rank[1]
    assert len(set(everything)) == len(everything)  # no sample twice in an epoch
    assert len(loader(dm, rank=1, world=2)) * 2 == len(per_rank[1])


@pytest.mark.parametrize("workers,buffer", [(0, 0), (0, 5), (2, 0), (2, 5)])
def test_resume_mid_epoch_continues_exactly(shard_dir, workers, buffer):
    dm = ShardDataModule(str(shard_dir), batch_size=2, num_workers=workers, shuffle_buffer=buffer, seed=3)
    straight = digests(loader(dm, epoch=1))
    assert len(straight) == len(loader(dm, epoch=1)) and len(set(straight)) == len(straight)
    for start in (1, 5, len(straight) - 1):
        assert digests(loader(dm, epoch=1, start=start)) == straight[start:]
    assert digests(loader(dm, epoch=1)) == straight  # deterministic in (seed, epoch)
    if buffer:
        assert digests(loader(dm, epoch=2)) != straight  # a new epoch, a new order


def test_workers_cover_the_same_samples_as_one_process(shard_dir):
    one = ShardDataModule(str(shard_dir), batch_size=1, shuffle_buffer=0, shuffle_shards=False)
    two = ShardDataModule(str(shard_dir), batch_size=1, num_workers=2, shuffle_buffer=0, shuffle_shards=False)
    a, b = rows(loader(one)), rows(loader(two))
    assert len(a) == sum(SIZES) and len(set(a)) == len(a)
    assert set(b) <= set(a) and len(b) == len(loader(two)) >= sum(SIZES) - 1


def test_batches_are_the_shard_contents(shard_dir):
    dm = ShardDataModule(str(shard_dir), batch_size=3, shuffle_buffer=0, shuffle_shards=False, hidden_layers=[2])
    batch = next(iter(loader(dm)))
    first = sample(np.random.default_rng(0))
    first["tokens"][0] = 0
    assert torch.equal(batch["input_ids"][0], torch.from_numpy(first["tokens"][:-1].astype(np.int64)))
    labels = torch.from_numpy(first["tokens"][1:].astype(np.int64))
    mask = torch.from_numpy(first["loss_mask"])
    assert torch.equal(batch["labels"][0], torch.where(mask, labels, torch.full_like(labels, -100)))
    assert torch.equal(batch["teacher_topk_ids"][0], torch.from_numpy(first["topk_ids"]))
    assert batch["teacher_hidden"].shape == (3, 1, META.seq_len, META.hidden_size)
    assert batch["teacher_hidden"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"hidden_layers \[5\] not stored"):
        ShardDataModule(str(shard_dir), hidden_layers=[5]).setup()


def test_broken_shard_raises_naming_it_or_is_skipped_and_counted(shard_dir, tmp_path, caplog):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(shard_dir, broken)
    path = broken / "train-000002.tar"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 700] = b"\x07" * 700  # same size: only reading finds it
    path.write_bytes(bytes(raw))
    dm = ShardDataModule(str(broken), batch_size=2, shuffle_buffer=0, shuffle_shards=False)
    with pytest.raises(ShardError, match=r"train-000002.tar.*sample"):
        digests(loader(dm))
    skip = ShardDataModule(str(broken), batch_size=2, shuffle_buffer=0, shuffle_shards=False, on_error="skip")
    with caplog.at_level(logging.WARNING):
        got = digests(loader(skip))
    assert len(got) == len(loader(skip))  # the share is refilled: the epoch keeps its length
    assert "train-000002.tar" in caplog.text and "samples skipped so far" in caplog.text


def test_a_shard_with_changed_bytes_is_refused_by_default(shard_dir, tmp_path, caplog):
    import shutil

    changed = tmp_path / "changed"
    shutil.copytree(shard_dir, changed)
    path = changed / "train-000001.tar"
    first = sum(SIZES[:1])  # the key of the shard's first sample
    flip_payload_bytes(path, f"{first + 2:09d}.hidden_0.npy", sample(np.random.default_rng(0))["hidden_0"])
    dm = ShardDataModule(str(changed), batch_size=2, shuffle_buffer=0, shuffle_shards=False)
    assert dm.verify_sha256
    with pytest.raises(ShardError, match=r"train-000001\.tar: sha256 \w+ differs from the manifest"):
        digests(loader(dm))
    with pytest.raises(ShardError, match=r"train-000001\.tar: sha256"):
        list(dm.training_rows())
    skip = ShardDataModule(str(changed), batch_size=2, shuffle_buffer=0, shuffle_shards=False, on_error="skip")
    with caplog.at_level(logging.WARNING):
        digests(loader(skip))
    assert "train-000001.tar: sha256" in caplog.text
    off = ShardDataModule(str(changed), batch_size=2, shuffle_buffer=0, shuffle_shards=False, verify_sha256=False)
    intact = ShardDataModule(str(shard_dir), batch_size=2, shuffle_buffer=0, shuffle_shards=False)
    assert digests(loader(off)) == digests(loader(intact))  # unchecked, the change passes: only hidden_0 differs


def test_too_few_shards_for_the_world_is_refused(shard_dir):
    dm = ShardDataModule(str(shard_dir), batch_size=8, num_workers=2)
    with pytest.raises(ValueError, match="too small for 4 ranks x 2 workers x batch 8"):
        dm.stream("train", 8, True, 0, 4)
