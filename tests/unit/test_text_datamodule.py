"""TextDataModule: reading, tokenizing, packing, chat loss masks, caching and error messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import chat_stream, text_datamodule, write_jsonl
from trainer.data.packing import IGNORE_INDEX, pack_rows
from trainer.data.text import TextDataModule
from trainer.interface.errors import DataError

DOCS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 3) for i in range(12)]
CHATS = [
    [
        {"role": "user", "content": f"What is {i} squared?"},
        {"role": "assistant", "content": f"It is {i * i}."},
        {"role": "user", "content": "And cubed?"},
        {"role": "assistant", "content": f"{i**3}"},
    ]
    for i in range(10)
]


def test_packing_rows_are_the_token_stream_and_labels_are_shifted(tiny_corpus, tok, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    seq = 16
    dm = text_datamodule(tiny_corpus, tmp_path, train_files=[data], seq_len=seq, batch_size=4, shuffle=False)
    dm.setup("fit")
    stream = []
    for d in DOCS:
        stream += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = (len(stream) - 1) // seq
    assert len(dm.train_dataset) == rows
    for r in (0, rows // 2, rows - 1):
        item = dm.train_dataset[r]
        assert item["input_ids"].tolist() == stream[r * seq : r * seq + seq]
        assert item["labels"].tolist() == stream[r * seq + 1 : r * seq + seq + 1]
        assert bool(item["loss_mask"].all())
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["loss_mask"].shape == (4, seq)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long and batch["loss_mask"].dtype == torch.bool
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert dm.vocab_size == len(tok) and dm.tokenizer_path == tiny_corpus.tokenizer_dir


def test_pack_rows_stride_covers_every_token_once():
    ids = np.arange(23, dtype=np.int32)
    out, trained = pack_rows([(ids[:10], np.ones(10, bool)), (ids[10:], np.ones(13, bool))], 5)
    assert out.shape == (4, 6) and trained.all()
    labels = out[:, 1:].reshape(-1).tolist()
    assert labels == list(range(1, 21))  # each token after the first is a label exactly once


def test_unpacked_rows_are_padded_and_padding_is_not_trained(tiny_corpus, tok, tmp_path):
    docs = ["short doc", "x = 1\n" * 40]
    data = write_jsonl(tmp_path / "d.jsonl", [{"body": d} for d in docs])
    dm = text_datamodule(
        tiny_corpus, tmp_path, train_files=[data], text_field="body", seq_len=32, pack=False, shuffle=False
    )
    dm.setup("fit")
    short = dm.train_dataset[0]
    ids = tok(docs[0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(ids)
    assert short["input_ids"][:n].tolist() == ids and short["labels"][: n - 1].tolist() == ids[1:]
    assert (short["labels"][n - 1 :] == IGNORE_INDEX).all() and not short["loss_mask"][n - 1 :].any()
    assert (short["input_ids"][n:] == tok.pad_token_id).all()
    long = dm.train_dataset[1]
    assert long["loss_mask"].all()  # truncated to seq_len + 1 tokens, all trained
    assert long["input_ids"].tolist() == tok(docs[1], add_special_tokens=False)["input_ids"][:32]


def test_txt_and_parquet_sources(tiny_corpus, tok, tmp_path):
    import datasets

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(DOCS[0])
    b.write_text(DOCS[1])
    pq = tmp_path / "c.parquet"
    datasets.Dataset.from_dict({"text": DOCS[2:4]}).to_parquet(str(pq))
    dm = text_datamodule(tiny_corpus, tmp_path, train_files=[str(a), str(b), str(pq)], seq_len=8, shuffle=False)
    dm.setup("fit")
    stream = []
    for d in DOCS[:4]:
        stream += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(dm.train_dataset) == (len(stream) - 1) // 8
    assert dm.train_dataset[len(dm.train_dataset) - 1]["labels"].tolist()[-1] == stream[((len(stream) - 1) // 8) * 8]


def test_chat_loss_mask_is_the_assistant_tokens(tiny_corpus, tok, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    dm = text_datamodule(tiny_corpus, tmp_path, train_files=[data], format="chat", seq_len=24, shuffle=False)
    dm.setup("fit")
    ids, mask = chat_stream(tok, CHATS)
    seq = 24
    trained_labels = []
    for r in range(len(dm.train_dataset)):
        item = dm.train_dataset[r]
        assert item["input_ids"].tolist() == ids[r * seq : r * seq + seq]
        assert item["loss_mask"].tolist() == [bool(m) for m in mask[r * seq + 1 : r * seq + seq + 1]]
        assert torch.equal(item["labels"] != IGNORE_INDEX, item["loss_mask"])
        trained_labels += item["labels"][item["loss_mask"]].tolist()
    # what is trained is exactly the assistant replies with their closing EOS
    expected = []
    for c in CHATS:
        for m in c:
            if m["role"] == "assistant":
                expected += tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    covered = len(dm.train_dataset) * seq + 1
    assert trained_labels == [i for i, m in zip(ids[1:covered], mask[1:covered]) if m]
    assert trained_labels == expected[: len(trained_labels)] and len(trained_labels) > len(expected) // 2


def test_dataset_name_reads_a_datasets_folder_with_splits(tiny_corpus, tok, tmp_path):
    folder = tmp_path / "hubish"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"text": d} for d in DOCS[:6]])
    write_jsonl(folder / "validation.jsonl", [{"text": d} for d in DOCS[6:8]])
    dm = text_datamodule(tiny_corpus, tmp_path, dataset_name=str(folder), val_split="validation", seq_len=8, pack=False)
    dm.setup("fit")
    assert len(dm.train_dataset) == 6 and len(dm.val_dataset) == 2
    assert dm.val_dataset[0]["input_ids"].tolist() == tok(DOCS[6], add_special_tokens=False)["input_ids"][:8]


def test_val_fraction_carves_whole_documents(tiny_corpus, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i} " + "x" * (40 + i)} for i in range(20)])
    dm = text_datamodule(tiny_corpus, tmp_path, train_files=[data], seq_len=8, val_fraction=0.25, pack=False)
    dm.setup("fit")
    assert len(dm.val_dataset) == 5 and len(dm.train_dataset) == 15
    train_rows = {tuple(dm.train_dataset[i]["input_ids"].tolist()) for i in range(15)}
    val_rows = {tuple(dm.val_dataset[i]["input_ids"].tolist()) for i in range(5)}
    assert not train_rows & val_rows
    val_batches = list(dm.val_dataloader())
    assert sum(b["input_ids"].shape[0] for b in val_batches) == 5


def test_tokenized_rows_are_cached(tiny_corpus, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    first = text_datamodule(tiny_corpus, tmp_path, train_files=[data], seq_len=16)
    first.setup("fit")

    def refuse(self):
        raise AssertionError("tokenized again despite the cache")

    monkeypatch.setattr(TextDataModule, "_build", refuse)
    second = text_datamodule(tiny_corpus, tmp_path, train_files=[data], seq_len=16)
    second.setup("fit")
    assert np.array_equal(first.train_dataset.ids, second.train_dataset.ids)
    changed = text_datamodule(
        tiny_corpus, tmp_path, train_files=[data], seq_len=12
    )  # another seq_len is another cache entry
    with pytest.raises(AssertionError, match="tokenized again"):
        changed.setup("fit")


def test_missing_file_names_the_path(tiny_corpus, tmp_path):
    # checked when the datamodule is built, before anything is read (a PathError is a FileNotFoundError)
    with pytest.raises(FileNotFoundError, match="data.train_files: data file not found: .*nope.jsonl"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(tmp_path / "nope.jsonl")])


def test_missing_field_names_key_and_file(tiny_corpus, tmp_path):
    data = write_jsonl(tmp_path / "keys.jsonl", [{"content": "hello"}])
    with pytest.raises(DataError, match=r"keys\.jsonl.*'text'"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[data]).setup("fit")
    with pytest.raises(DataError, match=r"keys\.jsonl.*'messages'"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[data], format="chat").setup("fit")


def test_empty_and_too_small_data_say_so(tiny_corpus, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"no documents.*empty\.jsonl"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(empty)]).setup("fit")
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": "a = 1"}])
    with pytest.raises(ValueError, match=r"too small.*small\.jsonl"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[small], seq_len=256).setup("fit")


def test_other_bad_inputs_are_named(tiny_corpus, tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello")
    with pytest.raises(ValueError, match=r"a\.txt.*chat"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(txt)], format="chat").setup("fit")
    csv = tmp_path / "a.csv"
    csv.write_text("x")
    with pytest.raises(ValueError, match=r"a\.csv.*unsupported"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(csv)]).setup("fit")
    with pytest.raises(FileNotFoundError, match="no_tokenizer_here"):
        TextDataModule(tokenizer=str(tmp_path / "no_tokenizer_here"), train_files=[str(txt)]).setup("fit")
    with pytest.raises(ValueError, match="train_files"):
        text_datamodule(tiny_corpus, tmp_path).setup("fit")
