"""Exact resume of the training data position with a real lightning.Trainer, and the sampler it relies on."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from trainer.data.sampler import ResumableSampler, resume_point
from trainer.data.text import TextDataModule

SEQ, BATCH, DOCS = 8, 2, 24  # pack=False: one row per document, 12 batches per epoch

pytestmark = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")


class Recorder(L.LightningModule):
    """Records the input ids of every training batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        return (self.w * batch["input_ids"].float().mean() - 1.0) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "docs.jsonl"
    docs = [f"value_{i} = {i * 7919 % 1000}  # doc {i}\n" * 2 for i in range(DOCS)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def _dm(tiny_corpus, data_file, cache, num_workers=0, batch_size=BATCH):
    return TextDataModule(
        tokenizer=tiny_corpus.tokenizer_dir,
        train_files=[data_file],
        seq_len=SEQ,
        pack=False,
        batch_size=batch_size,
        num_workers=num_workers,
        seed=5,
        cache_dir=str(cache),
    )


def _fit(dm, root: Path, ckpt_path=None, ckpt_every=None, epoch_end_ckpt=False, **trainer_kw) -> list[torch.Tensor]:
    callbacks = []
    if ckpt_every:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=root, filename="{step}", every_n_train_steps=ckpt_every, save_top_k=-1
            )
        )
    if epoch_end_ckpt:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=root, filename="{epoch}", every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
            )
        )
    model = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        limit_val_batches=0,
        default_root_dir=str(root),
        **trainer_kw,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def epoch_batches(tiny_corpus, data_file, tmp_path_factory):
    dm = _dm(tiny_corpus, data_file, tmp_path_factory.mktemp("cache"))
    dm.setup("fit")
    return len(dm.train_dataset) // BATCH


@pytest.mark.parametrize(
    ("stop", "num_workers", "accumulate"),
    [
        ("mid", 0, 1),  # mid-epoch checkpoint, resumed into the next epoch
        ("boundary", 2, 1),  # checkpoint on the epoch's last batch, with worker processes
        ("next_epoch", 2, 1),  # checkpoint inside the second epoch
        ("mid", 0, 2),  # gradient accumulation: steps count optimizer steps
    ],
)
def test_resume_yields_the_uninterrupted_batches(
    tiny_corpus, data_file, tmp_path, epoch_batches, stop, num_workers, accumulate
):
    n = epoch_batches  # batches per epoch
    assert n == DOCS // BATCH
    total_batches = n + n // 2 + 2 - (n + n // 2) % 2  # into the second epoch, even for accumulate=2
    stop_batch = {"mid": n // 2 - (n // 2) % 2, "boundary": n - n % 2, "next_epoch": n + 2}[stop]
    total_steps, stop_steps = total_batches // accumulate, stop_batch // accumulate
    cache = tmp_path / "cache"
    kw = {"accumulate_grad_batches": accumulate}
    straight = _fit(_dm(tiny_corpus, data_file, cache, num_workers), tmp_path / "a", max_steps=total_steps, **kw)
    assert len(straight) == total_batches
    first = _fit(
        _dm(tiny_corpus, data_file, cache, num_workers),
        tmp_path / "b",
        max_steps=stop_steps,
        ckpt_every=stop_steps,
        **kw,
    )
    ckpt = tmp_path / "b" / f"step={stop_steps}.ckpt"
    assert ckpt.is_file() and len(first) == stop_batch
    rest = _fit(
        _dm(tiny_corpus, data_file, cache, num_workers),
        tmp_path / "c",
        ckpt_path=str(ckpt),
        max_steps=total_steps,
        **kw,
    )
    assert _same(first + rest, straight)
    # and the second epoch really is another order (the test would pass trivially otherwise)
    assert not _same(straight[n : 2 * n - 2], straight[: n - 2])


def test_resume_from_an_epoch_end_checkpoint(tiny_corpus, data_file, tmp_path, epoch_batches):
    cache = tmp_path / "cache"
    straight = _fit(_dm(tiny_corpus, data_file, cache), tmp_path / "a", max_epochs=2)
    first = _fit(_dm(tiny_corpus, data_file, cache), tmp_path / "b", max_epochs=1, epoch_end_ckpt=True)
    rest = _fit(
        _dm(tiny_corpus, data_file, cache), tmp_path / "c", ckpt_path=str(tmp_path / "b" / "epoch=0.ckpt"), max_epochs=2
    )
    assert len(first) == epoch_batches and _same(first + rest, straight)


class ValRecorder(Recorder):
    def validation_step(self, batch, batch_idx):
        return None


def test_resume_from_a_checkpoint_written_after_mid_epoch_validation(tiny_corpus, data_file, tmp_path):
    def fit(root, max_steps, ckpt_path=None):
        dm = TextDataModule(
            tokenizer=tiny_corpus.tokenizer_dir,
            train_files=[data_file],
            seq_len=SEQ,
            pack=False,
            batch_size=BATCH,
            val_fraction=0.2,
            seed=5,
            cache_dir=str(tmp_path / "cache"),
        )
        model = ValRecorder()
        ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, filename="{step}", save_top_k=-1)
        trainer = L.Trainer(
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ckpt],
            val_check_interval=3,
            check_val_every_n_epoch=None,
            max_steps=max_steps,
            num_sanity_val_steps=0,
            default_root_dir=str(root),
        )
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return model.seen

    straight = fit(tmp_path / "a", 14)
    first = fit(tmp_path / "b", 7)
    assert (tmp_path / "b" / "step=6.ckpt").is_file()
    rest = fit(tmp_path / "c", 14, ckpt_path=str(tmp_path / "b" / "step=6.ckpt"))
    assert _same(first[:6] + rest, straight)


def test_resume_refuses_another_global_batch(tiny_corpus, data_file, tmp_path):
    cache = tmp_path / "cache"
    _fit(_dm(tiny_corpus, data_file, cache), tmp_path / "b", max_steps=3, ckpt_every=3)
    state = torch.load(tmp_path / "b" / "step=3.ckpt", weights_only=True)["TextDataModule"]
    assert state["position"]["consumed_samples"] == 3 * BATCH
    dm = _dm(tiny_corpus, data_file, cache, batch_size=BATCH + 1)
    dm.load_state_dict(state)
    with pytest.raises(ValueError, match=r"global batch of 2 samples, this run uses 3"):
        dm.train_dataloader()


# ---------------------------------------------------------------------------------------------------- the sampler


def test_sampler_splits_global_batches_across_ranks_without_overlap():
    n, b, world = 53, 3, 4
    per_rank = [list(ResumableSampler(n, b, r, world, seed=1)) for r in range(world)]
    order = ResumableSampler(n, b, 0, world, seed=1).epoch_order(0).tolist()
    g = b * world
    for j in range(n // g):
        for r in range(world):
            assert per_rank[r][j * b : (j + 1) * b] == order[j * g + r * b : j * g + (r + 1) * b]
    flat = sorted(i for rank in per_rank for i in rank)
    assert flat == sorted(order[: (n // g) * g]) and len(set(flat)) == len(flat)
    # one rank with the same global batch sees the same global batches, concatenated
    single = list(ResumableSampler(n, g, 0, 1, seed=1))
    assert single == order[: (n // g) * g]


def test_sampler_order_is_a_function_of_seed_and_epoch():
    s = ResumableSampler(40, 4, seed=7)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    t = ResumableSampler(40, 4, seed=7, epoch=1)
    assert list(t) == e1 and e0 != e1 and sorted(e0) == sorted(e1) == list(range(40))
    assert list(ResumableSampler(40, 4, seed=8)) != e0
    assert list(ResumableSampler(40, 4, shuffle=False)) == list(range(40))


def test_sampler_start_batch_skips_exactly_once_and_keeps_len():
    full = list(ResumableSampler(40, 4, rank=1, world_size=2, seed=3, epoch=2))
    s = ResumableSampler(40, 4, rank=1, world_size=2, seed=3, epoch=2, start_batch=3)
    assert len(s) == len(full) == 20
    assert list(s) == full[3 * 4 :]
    assert list(s) == full  # the offset applies to the first iteration only


def test_position_maps_across_world_sizes_with_the_same_global_batch():
    two = ResumableSampler(64, 4, rank=0, world_size=2, seed=2, epoch=1)
    pos = two.position(batches_done=3)
    assert pos["epoch"] == 1 and pos["consumed_samples"] == 24
    epoch, start = resume_point(pos, num_samples=64, batch_size=8, world_size=1, seed=2, shuffle=True)
    one = ResumableSampler(64, 8, seed=2, epoch=epoch, start_batch=start)
    rest_two = [list(ResumableSampler(64, 4, r, 2, seed=2, epoch=1, start_batch=3)) for r in range(2)]
    rest_one = list(one)
    for j in range(len(rest_one) // 8):
        assert rest_one[j * 8 : (j + 1) * 8] == rest_two[0][j * 4 : (j + 1) * 4] + rest_two[1][j * 4 : (j + 1) * 4]
    # the end of an epoch is the start of the next one
    assert two.position(batches_done=8) == {**pos, "epoch": 2, "consumed_samples": 0}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num_samples", 65, "num_samples=64"),
        ("seed", 9, "seed=2"),
        ("shuffle", False, "shuffle=True"),
        ("world_size", 4, "global batch of 8 samples, this run uses 16"),
    ],
)
def test_resume_point_refuses_what_it_cannot_map(key, value, message):
    pos = ResumableSampler(64, 4, world_size=2, seed=2).position(1)
    args = {"num_samples": 64, "batch_size": 4, "world_size": 2, "seed": 2, "shuffle": True, key: value}
    with pytest.raises(ValueError, match=message):
        resume_point(pos, **args)


# ------------------------------------------------------------------------------------- another world size, real DDP

_DDP_SCRIPT = """
import json, sys, warnings
import lightning as L, torch
from trainer.data.text import TextDataModule
warnings.filterwarnings("ignore")
tokenizer, data, cache, out, devices, batch, steps, ckpt_in, ckpt_dir = sys.argv[1:10]
class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []
    def training_step(self, b, i):
        self.seen.append(b["input_ids"].tolist())
        return (self.w * b["input_ids"].float().mean() - 1.0) ** 2
    def on_train_end(self):
        with open(f"{out}.rank{self.global_rank}.json", "w") as f:
            json.dump(self.seen, f)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
dm = TextDataModule(tokenizer=tokenizer, train_files=[data], seq_len=8, pack=False, batch_size=int(batch), seed=5,
                    cache_dir=cache)
cb = [L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=int(steps),
                                          save_top_k=-1)] if ckpt_dir != "-" else []
trainer = L.Trainer(accelerator="cpu", devices=int(devices), strategy="ddp" if devices != "1" else "auto",
                    max_steps=int(steps), logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=bool(cb), callbacks=cb, limit_val_batches=0)
trainer.fit(Recorder(), datamodule=dm, ckpt_path=None if ckpt_in == "-" else ckpt_in)
"""


@pytest.mark.slow
def test_resume_under_another_world_size_with_the_same_global_batch(tiny_corpus, data_file, tmp_path):
    """Two DDP ranks x batch 2 for 2 steps, then one process x batch 4: the global batches of a 1 x 4 run."""
    import subprocess
    import sys

    script = tmp_path / "ddp_fit.py"
    script.write_text(_DDP_SCRIPT)
    cache, ckpts = str(tmp_path / "cache"), str(tmp_path / "ckpt")

    out = str(tmp_path / "ddp")
    args = [tiny_corpus.tokenizer_dir, data_file, cache, out, "2", "2", "2", "-", ckpts]
    subprocess.run([sys.executable, str(script), *args], check=True, timeout=300, start_new_session=True)
    rank0, rank1 = (json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2))
    straight = [b.tolist() for b in _fit(_dm(tiny_corpus, data_file, cache, batch_size=4), tmp_path / "a", max_steps=5)]
    rest = _fit(
        _dm(tiny_corpus, data_file, cache, batch_size=4), tmp_path / "c", ckpt_path=f"{ckpts}/step=2.ckpt", max_steps=5
    )
    assert [a + b for a, b in zip(rank0, rank1)] == straight[:2]
    assert [b.tolist() for b in rest] == straight[2:]
