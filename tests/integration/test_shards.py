"""Teacher shards end to end: precompute (sharded, resumable), offline KD equal to online KD at k = V, refusals.

Choice for the equality test: the shards store float32 log-probabilities (``logprob_dtype: float32``), so offline and
online KD see the same teacher distribution up to float32 rounding, and their losses agree to 1e-4 relative over the
steps. (float16 storage, the default, rounds log-probabilities by up to ~1e-3 relative: a different, tested-elsewhere
trade of bytes for precision.)
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.recipe_runs import TINY_STUDENT, fit, merge, trainer_overrides
from trainer.data.precompute import main as precompute_main

pytestmark = pytest.mark.slow

DOCS = 6  # training documents: a few hundred 64-token sequences


class RecordLosses(L.Callback):
    """Appends each training step's loss to ``path`` (one JSON number per line)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(float(outputs["loss"])) + "\n")


def text_data(corpus, **extra) -> dict:
    return {
        "class_path": "trainer.data.text.TextDataModule",
        "init_args": {
            "tokenizer": str(corpus.tokenizer_dir),
            "train_files": [str(corpus.train_file)],
            "val_files": [str(corpus.heldout_file)],
            "seq_len": 64,
            "batch_size": 4,
            "shuffle": False,
            "max_documents": DOCS,
            "cache_dir": str(Path(corpus.out_dir) / "tokenized"),
            **extra,
        },
    }


def run_precompute(corpus, target: Path, out: Path, *args: str) -> int:
    data = json.dumps(text_data(corpus))
    argv = ["--target", str(target), "--output_dir", str(out), "--data", data, "--progress", "false", *args]
    return precompute_main(argv)


@pytest.fixture(scope="module")
def full_vocab_shards(tiny_corpus, tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards_k512")
    args = ("--top_logprobs", "512", "--logprob_dtype", "float32", "--samples_per_shard", "48", "--batch_size", "4")
    assert run_precompute(tiny_corpus, tiny_target, out, *args) == 0
    return out


def record(run: Path) -> dict:
    return {"class_path": "tests.integration.test_shards.RecordLosses", "init_args": {"path": str(run / "loss.jsonl")}}


def offline_override(run: Path, corpus, target: Path, shards: Path, steps: int, callbacks=(), **data) -> dict:
    override = merge(
        trainer_overrides(run, max_steps=steps, every_n=steps),
        {
            "model": {
                "init_args": {
                    "target": str(target),
                    "export_dir": str(run / "student"),
                    "drafter_config": TINY_STUDENT,
                    "loss_chunk_size": 64,
                }
            },
            "data": {
                "init_args": {
                    "shards": str(shards),
                    "tokenizer": str(corpus.tokenizer_dir),
                    "batch_size": 4,
                    "num_workers": 0,
                    "shuffle_shards": False,
                    "shuffle_buffer": 0,
                    **data,
                }
            },
        },
    )
    override["trainer"]["callbacks"] += list(callbacks)
    return override


def losses(run: Path) -> list[float]:
    return [json.loads(line) for line in (run / "loss.jsonl").read_text().splitlines()]


def test_offline_kd_at_full_vocabulary_follows_the_online_loss(tiny_corpus, tiny_target, full_vocab_shards, tmp_path):
    steps = 6
    online = tmp_path / "online"
    override = merge(
        trainer_overrides(online, max_steps=steps, every_n=steps),
        {"data": text_data(tiny_corpus)},
        {
            "model": {
                "init_args": {
                    "target": str(tiny_target),
                    "export_dir": str(online / "student"),
                    "drafter_config": TINY_STUDENT,
                    "loss_chunk_size": 64,
                }
            }
        },
    )
    override["trainer"]["callbacks"].append(record(online))
    fit("quickstart/kd.yaml", override, online)

    offline = tmp_path / "offline"
    fit(
        "quickstart/kd_offline.yaml",
        offline_override(offline, tiny_corpus, tiny_target, full_vocab_shards, steps, [record(offline)]),
        offline,
    )
    a, b = torch.tensor(losses(online)), torch.tensor(losses(offline))
    assert len(a) == len(b) == steps, (a, b)
    assert float(a.max() - a.min()) > 1e-2, a  # a moving trajectory, not one repeated value
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=lambda m: f"{m}\nonline {a}\noffline {b}")
    # the offline student never loaded the teacher's weights, yet was exported as an HF checkpoint
    assert (offline / "student" / "model.safetensors").is_file()


def test_offline_kd_resumes_the_stream_exactly(tiny_corpus, tiny_target, full_vocab_shards, tmp_path):
    def batches(run):
        return {"class_path": "tests.callbacks.RecordBatches", "init_args": {"path": str(run / "batches.jsonl")}}

    opts = {"shuffle_shards": True, "shuffle_buffer": 16, "num_workers": 1}
    straight = tmp_path / "straight"
    fit(
        "quickstart/kd_offline.yaml",
        offline_override(straight, tiny_corpus, tiny_target, full_vocab_shards, 6, [batches(straight)], **opts),
        straight,
    )
    split = tmp_path / "split"
    stop = {"class_path": "tests.callbacks.StopAtStep", "init_args": {"step": 3}}
    fit(
        "quickstart/kd_offline.yaml",
        offline_override(split, tiny_corpus, tiny_target, full_vocab_shards, 6, [batches(split), stop], **opts),
        split,
    )
    fit(
        "quickstart/kd_offline.yaml",
        offline_override(split, tiny_corpus, tiny_target, full_vocab_shards, 6, [batches(split)], **opts),
        split,
        ("--ckpt_path", str(split / "checkpoints" / "last.ckpt")),
    )

    def digests(run):
        return [json.loads(line)["batch"] for line in (run / "batches.jsonl").read_text().splitlines()]

    assert len(digests(straight)) == 6
    assert digests(split) == digests(straight)


def test_precompute_is_sharded_across_ranks_and_resumable(tiny_corpus, tiny_target, tmp_path, monkeypatch):
    out = tmp_path / "shards"
    args = (
        "--top_logprobs",
        "8",
        "--samples_per_shard",
        "64",
        "--hidden_layers",
        "[0, 2]",
        "--hidden_dtype",
        "float16",
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert run_precompute(tiny_corpus, tiny_target, out, *args) == 0
    assert not (out / "manifest.json").exists()  # rank 0's shards are missing: nothing is listed yet
    rank1 = sorted(p.name for p in out.glob("*.tar"))
    monkeypatch.setenv("RANK", "0")
    assert run_precompute(tiny_corpus, tiny_target, out, *args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    files = [s["file"] for s in manifest["shards"]]
    assert sorted(files) == sorted(p.name for p in out.glob("*.tar")) and set(rank1) < set(files)
    assert rank1 == sorted(files[1::2])  # item g is written by rank g % world
    assert manifest["meta"]["hidden_layers"] == [0, 2] and manifest["meta"]["k"] == 8

    # a crash in the middle of a shard: its sidecar never came, a .partial was left; a rerun rewrites only it
    victim = out / files[2]
    (out / f"{files[2]}.json").unlink()
    victim.rename(out / f"{files[2]}.partial")
    kept = {f: (out / f).stat().st_mtime_ns for f in files if f != files[2]}
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert run_precompute(tiny_corpus, tiny_target, out, *args) == 0
    assert {f: (out / f).stat().st_mtime_ns for f in kept} == kept
    assert json.loads((out / "manifest.json").read_text()) == manifest  # same bytes as the first run wrote
    assert not list(out.glob("*.partial"))

    with pytest.raises(ValueError, match=r"other settings \(k differ\)"):
        run_precompute(tiny_corpus, tiny_target, out, *args[:1], "16", *args[2:])


def test_shards_of_another_target_or_vocabulary_are_refused(tiny_corpus, tiny_target, full_vocab_shards, tmp_path):
    # another target with the same architecture and tokenizer (different weights)
    other = tmp_path / "other_target"
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaForCausalLM.config_class.from_pretrained(tiny_target)).save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_target).save_pretrained(other)
    run = tmp_path / "other"
    with pytest.raises(ValueError, match="made with another target"):
        fit("quickstart/kd_offline.yaml", offline_override(run, tiny_corpus, other, full_vocab_shards, 2), run)

    # a student whose vocabulary is not the shards'
    run = tmp_path / "vocab"
    override = offline_override(run, tiny_corpus, tiny_target, full_vocab_shards, 2)
    override["model"]["init_args"]["drafter_config"] = {**TINY_STUDENT, "vocab_size": 256}
    with pytest.raises(ValueError, match="vocabulary"):
        fit("quickstart/kd_offline.yaml", override, run)

    # shards made at another temperature than the recipe's
    run = tmp_path / "temperature"
    override = offline_override(run, tiny_corpus, tiny_target, full_vocab_shards, 2)
    override["model"]["init_args"]["temperature"] = 2.0
    with pytest.raises(ValueError, match="temperature 1.0"):
        fit("quickstart/kd_offline.yaml", override, run)
