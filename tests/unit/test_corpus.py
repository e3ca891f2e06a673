"""The standard-library corpus, its tokenizer, chat template and tokenizer hash."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from trainer.data.corpus import main, prepare_corpus
from trainer.data.tokenizer import EOS_TOKEN, PAD_TOKEN, ROLE_TOKENS, tokenizer_hash


def _sources(path: str) -> list[str]:
    return [json.loads(line)["source"] for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """Two independent builds with the same seed and one with another seed (small: 30 files, vocab 300)."""
    root = tmp_path_factory.mktemp("corpora")
    a = prepare_corpus(str(root / "a"), vocab_size=300, seed=3, max_files=30)
    b = prepare_corpus(str(root / "b"), vocab_size=300, seed=3, max_files=30)
    c = prepare_corpus(str(root / "c"), vocab_size=300, seed=4, max_files=30)
    return a, b, c


def test_prepare_is_deterministic_for_a_seed(small_pair):
    a, b, c = small_pair
    assert not a.reused and not b.reused
    assert Path(a.tokenizer_dir, "tokenizer.json").read_bytes() == Path(b.tokenizer_dir, "tokenizer.json").read_bytes()
    assert _sources(a.train_file) == _sources(b.train_file)
    assert _sources(a.heldout_file) == _sources(b.heldout_file)
    assert a.tokenizer_hash == b.tokenizer_hash
    # another seed draws another sample of files
    assert set(_sources(a.train_file)) | set(_sources(a.heldout_file)) != set(_sources(c.train_file)) | set(
        _sources(c.heldout_file)
    )


def test_split_is_by_file_and_matches_the_files(tiny_corpus):
    train = [json.loads(line) for line in Path(tiny_corpus.train_file).read_text().splitlines()]
    heldout = [json.loads(line) for line in Path(tiny_corpus.heldout_file).read_text().splitlines()]
    assert len(train) == tiny_corpus.num_train_files and len(heldout) == tiny_corpus.num_heldout_files
    assert len(train) + len(heldout) == 80
    assert not {r["source"] for r in train} & {r["source"] for r in heldout}
    assert heldout and all(r["source"].endswith(".py") for r in train + heldout)
    assert "site-packages" not in " ".join(r["source"] for r in train + heldout)
    assert sum(len(r["text"].encode()) for r in train) == tiny_corpus.train_bytes
    # each record is its file as read
    root = Path(sysconfig.get_paths()["stdlib"])
    for rec in (train[0], heldout[-1]):
        assert (root / rec["source"]).read_text(encoding="utf-8", errors="ignore") == rec["text"]


def test_rerun_reuses_and_overwrite_rebuilds(tmp_path):
    first = prepare_corpus(str(tmp_path), vocab_size=300, max_files=10)
    again = prepare_corpus(str(tmp_path), vocab_size=300, max_files=10)
    assert again.reused and again.tokenizer_hash == first.tokenizer_hash
    other = prepare_corpus(str(tmp_path), vocab_size=320, max_files=10)
    assert not other.reused and other.vocab_size == 320
    forced = prepare_corpus(str(tmp_path), vocab_size=320, max_files=10, overwrite=True)
    assert not forced.reused and forced.tokenizer_hash == other.tokenizer_hash


def test_autotokenizer_loads_it_and_round_trips(tiny_corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_corpus.tokenizer_dir)
    assert len(tok) == tiny_corpus.vocab_size == 512
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and tok.pad_token_id != tok.eos_token_id
    text = json.loads(Path(tiny_corpus.heldout_file).read_text().splitlines()[0])["text"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges compress
    for role in ROLE_TOKENS:
        assert len(tok(role, add_special_tokens=False)["input_ids"]) == 1
    assert tokenizer_hash(tok) == tiny_corpus.tokenizer_hash == tokenizer_hash(tiny_corpus.tokenizer_dir)


def test_tokenizer_hash_sees_vocab_changes(tiny_corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_corpus.tokenizer_dir)
    before = tokenizer_hash(tok)
    tok.add_tokens(["<|new|>"])
    assert tokenizer_hash(tok) != before


def test_chat_template_masks_exactly_the_assistant_tokens(tiny_corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_corpus.tokenizer_dir)
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list."},
        {"role": "assistant", "content": "def f(xs):\n    return sorted(xs)"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    masked = [i for i, m in zip(ids, mask) if m]
    expected = []
    for m in messages:
        if m["role"] == "assistant":
            expected += tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert masked == expected
    # each masked run starts right after "<|assistant|>\n"
    asst = tok.convert_tokens_to_ids("<|assistant|>")
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    assert len(starts) == 2 and all(ids[s - 2] == asst for s in starts)


def test_cli_prints_a_summary(tmp_path, capsys):
    assert main(["--output_dir", str(tmp_path), "--vocab_size", "300", "--max_files", "12", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    meta = json.loads((tmp_path / "corpus.json").read_text())
    assert f"{meta['num_train_files']} train" in printed and f"{meta['train_tokens']:,} train" in printed
    assert meta["args"]["seed"] == 1 and meta["vocab_size"] == 300


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="heldout_fraction"):
        prepare_corpus(str(tmp_path), heldout_fraction=1.5)
    with pytest.raises(ValueError, match="max_files"):
        prepare_corpus(str(tmp_path), max_files=1)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        prepare_corpus(str(tmp_path), stdlib_dir=str(tmp_path / "nowhere"))
