"""TextDataModule on bad input: chat data with little or nothing to train, broken JSON lines, folders and globs."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import chat_stream, text_datamodule, write_jsonl
from trainer.data.packing import IGNORE_INDEX, label_sources, pack_rows, pad_rows
from trainer.data.sources import expand_data_files
from trainer.interface.errors import DataError
from trainer.losses.distillation import chunked_cross_entropy


def _chat(prompt_items: int, answer: str, i: int = 0) -> list[dict]:
    """A user turn of about 17 tokens per item and a short assistant answer."""
    prompt = " ".join(f"item_{j} = compute(value_{j}, {i})" for j in range(prompt_items))
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


# ---------------------------------------------------------------------------------------------------------- chat


def test_packed_rows_of_prompt_tokens_only_are_dropped_and_counted(tiny_corpus, tok, tmp_path, caplog):
    convs = [_chat(12, f"ok {i}", i) for i in range(6)]
    data = write_jsonl(tmp_path / "long.jsonl", [{"messages": c} for c in convs])
    seq = 16
    dm = text_datamodule(
        tiny_corpus, tmp_path, train_files=[data], val_files=[data], format="chat", seq_len=seq, batch_size=2
    )
    with caplog.at_level(logging.WARNING, logger="trainer.data.text"):
        dm.setup("fit")
    ids, mask = chat_stream(tok, convs)
    rows = (len(ids) - 1) // seq
    kept = [r for r in range(rows) if any(mask[r * seq + 1 : r * seq + seq + 1])]
    assert 0 < len(kept) < rows // 2  # most rows are inside a prompt
    assert len(dm.train_dataset) == len(dm.val_dataset) == len(kept)
    for i, r in enumerate(kept):
        assert dm.train_dataset[i]["input_ids"].tolist() == ids[r * seq : r * seq + seq]
        assert dm.train_dataset[i]["loss_mask"].any()
    assert f"long.jsonl: {rows - len(kept)} of {rows} training rows have no trained label" in caplog.text
    assert f"long.jsonl: {rows - len(kept)} of {rows} validation rows have no trained label" in caplog.text
    # every batch has a trained label: the chunked loss that refused all -100 labels at step 0 now runs
    weight = torch.randn(dm.vocab_size, 8)
    for batch in dm.train_dataloader():
        assert (batch["labels"] != IGNORE_INDEX).any(dim=1).all()
        loss = chunked_cross_entropy(torch.randn(*batch["labels"].shape, 8), weight, batch["labels"], chunk_size=4)
        assert torch.isfinite(loss)


def test_unpacked_prompts_longer_than_a_row_leave_nothing_and_are_refused(tiny_corpus, tok, tmp_path):
    long = write_jsonl(tmp_path / "long.jsonl", [{"messages": _chat(4, "yes", i)} for i in range(5)])
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": _chat(0, "a short answer", i)} for i in range(5)])
    with pytest.raises(
        ValueError, match=r"nothing to train in the training data: .*long\.jsonl: 0% of [\d,]+ label"
    ) as err:
        text_datamodule(tiny_corpus, tmp_path, train_files=[long], format="chat", seq_len=32, pack=False).setup("fit")
    assert "pack=False" in str(err.value) and "seq_len + 1 = 33" in str(err.value)
    # with a good file the long one is still named (and only it)
    with pytest.raises(ValueError, match=r"too little is trained in the training data: [^;]*long\.jsonl: 0%") as err:
        text_datamodule(tiny_corpus, tmp_path, train_files=[good, long], format="chat", seq_len=32, pack=False).setup(
            "fit"
        )
    assert "good.jsonl" not in str(err.value)
    # long and short conversations in one file: the long ones are dropped, the short ones are all kept
    mixed = write_jsonl(
        tmp_path / "mixed.jsonl",
        [{"messages": _chat(4 if i % 2 else 0, "fine", i)} for i in range(8)],
    )
    dm = text_datamodule(
        tiny_corpus, tmp_path, train_files=[mixed], format="chat", seq_len=32, pack=False, shuffle=False
    )
    dm.setup("fit")
    assert len(dm.train_dataset) == 4
    for i in range(4):
        item = dm.train_dataset[i]
        assert item["loss_mask"].any()
        assert item["input_ids"].tolist()[:4] == chat_stream(tok, [_chat(0, "fine", 2 * i)])[0][:4]


def test_a_low_trained_share_is_refused_naming_file_and_share_unless_disabled(tiny_corpus, tok, tmp_path):
    convs = [_chat(40, "ok", i) for i in range(3)]
    data = write_jsonl(tmp_path / "lowshare.jsonl", [{"messages": c} for c in convs])
    seq = 64
    ids, mask = chat_stream(tok, convs)
    rows = (len(ids) - 1) // seq
    trained = sum(mask[1 : rows * seq + 1])
    share = f"{100 * trained / (rows * seq):.3g}%"
    assert 0 < trained / (rows * seq) < 0.01
    with pytest.raises(ValueError, match=re.escape(f"lowshare.jsonl: {share} of {rows * seq:,} label tokens trained")):
        text_datamodule(tiny_corpus, tmp_path, train_files=[data], format="chat", seq_len=seq).setup("fit")
    with pytest.raises(ValueError, match="min_trained_fraction=0.01"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[data], format="chat", seq_len=seq).setup("fit")
    dm = text_datamodule(
        tiny_corpus, tmp_path, train_files=[data], format="chat", seq_len=seq, min_trained_fraction=0.0
    )
    dm.setup("fit")
    assert len(dm.train_dataset) == sum(1 for r in range(rows) if any(mask[r * seq + 1 : r * seq + seq + 1]))
    assert sum(int(dm.train_dataset[i]["loss_mask"].sum()) for i in range(len(dm.train_dataset))) == trained
    with pytest.raises(ValueError, match=r"min_trained_fraction must be in \[0, 1\)"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[data], min_trained_fraction=1.5)


def test_conversations_without_an_assistant_turn_are_left_out_with_a_warning(tiny_corpus, tok, tmp_path, caplog):
    convs = [_chat(1, f"answer {i}", i) for i in range(10)]
    records = [{"messages": c} for c in convs]
    for i in (2, 6):  # lines 3 and 7
        records[i] = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}]}
    data = write_jsonl(tmp_path / "noreply.jsonl", records)
    dm = text_datamodule(
        tiny_corpus, tmp_path, train_files=[data], format="chat", seq_len=64, pack=False, shuffle=False
    )
    with caplog.at_level(logging.WARNING, logger="trainer.data.text"):
        dm.setup("fit")
    assert "noreply.jsonl: 2 of 10 conversations have no assistant turn" in caplog.text
    assert "noreply.jsonl:3, " in caplog.text and "noreply.jsonl:7" in caplog.text
    assert "'system', 'user'" in caplog.text
    others = [c for i, c in enumerate(convs) if i not in (2, 6)]
    assert len(dm.train_dataset) == 8  # one row per conversation: the other eight only
    for row, conv in zip(dm.train_dataset.ids, others, strict=True):
        ids, _ = chat_stream(tok, [conv])
        assert row[: len(ids)].tolist() == ids[:65]

    # a file where no conversation has one is refused, naming the file and the roles it has
    sharegpt = [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]] * 4
    bad = write_jsonl(tmp_path / "sharegpt.jsonl", [{"messages": c} for c in sharegpt])
    with pytest.raises(
        ValueError, match=r"sharegpt\.jsonl: none of its 4 conversations has an assistant turn \(roles: no 'role' key"
    ) as err:
        text_datamodule(tiny_corpus, tmp_path, train_files=[data, bad], format="chat", seq_len=16).setup("fit")
    assert "noreply.jsonl" not in str(err.value)
    with pytest.raises(ValueError, match=r"nothing to train in the training data: .*sharegpt\.jsonl"):
        text_datamodule(
            tiny_corpus, tmp_path, train_files=[bad], format="chat", seq_len=16, min_trained_fraction=0
        ).setup("fit")


def test_a_chat_template_error_names_the_record(tiny_corpus, tmp_path):
    convs = [_chat(1, "x", i) for i in range(3)]
    convs[1] = [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]
    data = write_jsonl(tmp_path / "roles.jsonl", [{"messages": c} for c in convs])
    with pytest.raises(ValueError, match=r"roles\.jsonl:2: the chat template failed.*unknown chat role: tool"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[data], format="chat", seq_len=8).setup("fit")


def test_label_sources_follow_packing_and_padding():
    streams = [(np.arange(5, dtype=np.int32), np.ones(5, bool)), (np.arange(7, dtype=np.int32), np.ones(7, bool))]
    lengths, tags = np.array([5, 7]), np.array([3, 9])
    ids, _ = pack_rows(streams, 4)
    label, real = label_sources(lengths, tags, 4, pack=True)
    assert label.shape == real.shape == (ids.shape[0], 4) and real.all()
    # stream tokens 1..4 are labels of row 0, tokens 5..8 of row 1: token 5 onwards belongs to the second stream
    assert label.tolist() == [[3, 3, 3, 3], [9, 9, 9, 9]]
    ids, trained = pad_rows([*streams, (np.arange(1, dtype=np.int32), np.ones(1, bool))], 5, 0)
    label, real = label_sources(np.array([5, 7, 1]), np.array([3, 9, 4]), 5, pack=False)
    assert label.tolist() == [[3] * 5, [9] * 5]  # the one-token stream gives no row
    assert real.tolist() == [[True] * 4 + [False], [True] * 5]
    assert np.array_equal(real, trained[:, 1:])


# ---------------------------------------------------------------------------------------------------------- JSON


def test_an_invalid_json_line_names_file_and_line(tiny_corpus, tmp_path, monkeypatch):
    import datasets

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a = 1"}\n\n{"text": "b = 2"}\n{"text": "c = 3",}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:4: not valid JSON \(Expecting property name.*column 18\)") as err:
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(bad)]).setup("fit")
    assert "generating the dataset" not in str(err.value)
    array = tmp_path / "array.jsonl"
    array.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"array\.jsonl:2: expected a JSON object with key 'text', got a list"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(array)]).setup("fit")
    keys = write_jsonl(tmp_path / "keys.jsonl", [{"text": "x = 1"}, {"body": "y"}])
    with pytest.raises(DataError, match=r"keys\.jsonl:2: record has no key 'text' \(keys: body\)"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[keys]).setup("fit")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=r"binary\.jsonl:2: not valid JSON \(not UTF-8"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(binary)]).setup("fit")
    # .json: a broken array names its line; JSON lines in a .json file are checked line by line
    arr = tmp_path / "arr.json"
    arr.write_text('[\n {"text": "a = 1"},\n {"text": "b = 2"}\n {"text": "c"}\n]\n')
    with pytest.raises(ValueError, match=r"arr\.json:4: not valid JSON \(Expecting ',' delimiter"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(arr)]).setup("fit")
    lines = tmp_path / "lines.json"
    lines.write_text('{"text": "a"}\n{"text": "b"}\n{"text" "c"}\n')
    with pytest.raises(ValueError, match=r"lines\.json:3: not valid JSON"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(lines)]).setup("fit")

    # good .jsonl and .json (array or lines) are read here, without `datasets`, to the same rows
    def refuse(*args, **kwargs):
        raise AssertionError("datasets.load_dataset called for a JSON-lines or JSON-array file")

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(8)]
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": d} for d in docs])
    (tmp_path / "good_array.json").write_text(json.dumps([{"text": d} for d in docs], indent=1))
    (tmp_path / "good_lines.json").write_text(Path(good).read_text())
    got = []
    for name in ("good.jsonl", "good_array.json", "good_lines.json"):
        dm = text_datamodule(tiny_corpus, tmp_path, train_files=[str(tmp_path / name)], seq_len=8, shuffle=False)
        dm.setup("fit")
        got.append(np.asarray(dm.train_dataset.ids))
    assert got[0].shape[0] > 2 and np.array_equal(got[0], got[1]) and np.array_equal(got[0], got[2])


# ---------------------------------------------------------------------------------------------------------- files


def _tree(root: Path) -> Path:
    data = root / "data"
    (data / "sub").mkdir(parents=True)
    (data / ".hidden").mkdir()
    for name, body in [("b.txt", "b = 2\n" * 9), ("a.txt", "a = 1\n" * 9), ("sub/c.txt", "c = 3\n" * 9)]:
        (data / name).write_text(body)
    (data / ".hidden" / "d.txt").write_text("hidden = 1\n")
    (data / "notes.md").write_text("# not data\n")
    return data


def test_folders_and_globs_expand_to_sorted_supported_files(tiny_corpus, tmp_path):
    data = _tree(tmp_path)
    suffixes = (".txt", ".jsonl", ".json", ".parquet")
    files = [str(data / "a.txt"), str(data / "b.txt"), str(data / "sub" / "c.txt")]
    assert expand_data_files([str(data)], suffixes) == files
    assert expand_data_files([str(data / "*.txt")], suffixes) == files[:2]
    assert expand_data_files([str(data / "**" / "*.txt")], suffixes) == files
    assert expand_data_files([str(data / "*")], suffixes) == files  # sub/ expanded, notes.md left out
    assert expand_data_files([str(data)], suffixes, skip=str(data / "sub")) == files[:2]

    by_folder = text_datamodule(
        tiny_corpus, tmp_path, train_files=[str(data)], val_files=[str(data / "sub")], seq_len=8
    )
    by_folder.setup("fit")
    by_name = text_datamodule(
        tiny_corpus, tmp_path, train_files=files, val_files=files[2:], seq_len=8, cache_dir=str(tmp_path / "c2")
    )
    by_name.setup("fit")
    assert len(by_folder.train_dataset) > 3
    assert np.array_equal(by_folder.train_dataset.ids, by_name.train_dataset.ids)
    assert np.array_equal(by_folder.val_dataset.ids, by_name.val_dataset.ids)


def test_a_folder_or_glob_without_data_is_an_error_naming_it(tiny_corpus, tmp_path):
    data = _tree(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data folder .*empty holds no data file \(\.txt, \.jsonl"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(tmp_path / "empty")]).setup("fit")
    with pytest.raises(FileNotFoundError, match=r"data pattern .*data/\*\.jsonl matches no data file"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(data / "*.jsonl")]).setup("fit")
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*nope\.jsonl"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(data), str(tmp_path / "nope.jsonl")]).setup("fit")
    # chat data is never read from .txt files: a folder of them holds no chat data
    with pytest.raises(
        FileNotFoundError, match=r"data folder .*data holds no data file \(\.jsonl, \.json, \.parquet\)"
    ):
        text_datamodule(tiny_corpus, tmp_path, train_files=[str(data)], format="chat").setup("fit")


def test_the_cache_key_covers_the_files_a_folder_holds(tiny_corpus, tmp_path):
    data = _tree(tmp_path)
    dm = text_datamodule(tiny_corpus, tmp_path, train_files=[str(data)], seq_len=8, shuffle=False)
    dm.setup("fit")
    before = dm._cache_key()
    assert text_datamodule(tiny_corpus, tmp_path, train_files=[str(data)], seq_len=8)._cache_key() == before
    (data / "sub" / "e.txt").write_text("e = 5\n" * 9)
    again = text_datamodule(tiny_corpus, tmp_path, train_files=[str(data)], seq_len=8, shuffle=False)
    assert again._cache_key() != before
    again.setup("fit")
    assert len(again.train_dataset) > len(dm.train_dataset)  # the new file is read, not the old cache entry
