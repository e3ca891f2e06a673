"""Shard schema: round trips, webdataset compatibility, and refusal of broken or hostile files."""

from __future__ import annotations

import io
import json
import pickle
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data.shards import (
    ShardError,
    ShardMeta,
    ShardWriter,
    check_compatible,
    decode_npy,
    encode_npy,
    finished_shard,
    iter_shard,
    load_manifest,
    write_manifest,
)

META = ShardMeta(
    teacher="t",
    teacher_fingerprint="f" * 64,
    tokenizer_hash="a" * 64,
    vocab_size=50,
    k=4,
    temperature=1.0,
    seq_len=6,
    logprob_dtype="float16",
    hidden_layers=[0, 2],
    hidden_size=3,
    hidden_dtype="bfloat16",
)


def sample(rng: np.random.Generator, meta: ShardMeta = META) -> dict[str, np.ndarray]:
    s, k, v = meta.seq_len, meta.k, meta.vocab_size
    logits = torch.from_numpy(rng.normal(size=(s, v)).astype(np.float32))
    lp, ids = torch.log_softmax(logits, -1).topk(k, -1)
    out = {
        "tokens": rng.integers(0, v, s + 1).astype(np.int32),
        "loss_mask": rng.random(s) > 0.3,
        "topk_ids": ids.to(torch.int32).numpy(),
        "topk_logprobs": lp.numpy().astype(np.float16 if meta.logprob_dtype == "float16" else np.float32),
    }
    for i in meta.hidden_layers:
        h = torch.from_numpy(rng.normal(size=(s, meta.hidden_size)).astype(np.float32)).to(torch.bfloat16)
        out[f"hidden_{i}"] = h.view(torch.int16).numpy().view(np.uint16)
    return out


def write(folder, n=5, meta=META, name="train-000000.tar", seed=0):
    rng = np.random.default_rng(seed)
    samples = [sample(rng, meta) for _ in range(n)]
    writer = ShardWriter(folder / name, "train", meta)
    for i, s in enumerate(samples):
        writer.add(f"{i:09d}", s)
    return writer.close(), samples


def test_round_trip_is_exact_and_the_sidecar_records_it(tmp_path):
    info, samples = write(tmp_path)
    assert info.samples == 5 and finished_shard(tmp_path / info.file) == info
    assert not (tmp_path / "train-000000.tar.partial").exists()
    read = list(iter_shard(tmp_path / info.file, META, verify_sha256=info.sha256))
    assert [k for k, _ in read] == [f"{i:09d}" for i in range(5)]
    for (_, got), want in zip(read, samples, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name])
    # bfloat16 bits survive: viewing them back gives the original bfloat16 values
    h = torch.from_numpy(read[0][1]["hidden_2"].copy()).view(torch.bfloat16)
    assert torch.equal(h, torch.from_numpy(samples[0]["hidden_2"].copy()).view(torch.bfloat16))


def test_identical_content_gives_identical_bytes(tmp_path):
    (a := tmp_path / "a").mkdir()
    (b := tmp_path / "b").mkdir()
    assert write(a)[0].sha256 == write(b)[0].sha256


def test_shards_are_plain_webdataset(tmp_path):
    import webdataset as wds

    info, samples = write(tmp_path)
    ds = wds.WebDataset(str(tmp_path / info.file), shardshuffle=False, empty_check=False).decode()
    got = list(ds)
    assert len(got) == 5
    for g, want in zip(got, samples, strict=True):
        assert np.array_equal(g["topk_ids.npy"], want["topk_ids"])
        assert np.array_equal(g["topk_logprobs.npy"], want["topk_logprobs"])


def test_writer_refuses_arrays_off_schema(tmp_path):
    writer = ShardWriter(tmp_path / "x.tar", "train", META)
    bad = sample(np.random.default_rng(0))
    bad["topk_ids"] = bad["topk_ids"].astype(np.int64)
    with pytest.raises(ValueError, match="topk_ids"):
        writer.add("000000000", bad)
    writer.abort()
    assert not (tmp_path / "x.tar.partial").exists()


def test_decode_npy_never_unpickles_and_checks_shape_and_length():
    with pytest.raises(ShardError, match="dtype object"):
        buf = io.BytesIO()
        np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        decode_npy(buf.getvalue(), (1,), (np.int32,), "x")
    with pytest.raises(ShardError, match="not a valid .npy"):
        decode_npy(pickle.dumps([1, 2]), (2,), (np.int32,), "x")
    data = encode_npy(np.arange(6, dtype=np.int32))
    assert np.array_equal(decode_npy(data, (6,), (np.int32,), "x"), np.arange(6))
    with pytest.raises(ShardError, match=r"shape \(6,\)"):
        decode_npy(data, (5,), (np.int32,), "x")
    with pytest.raises(ShardError, match="truncated"):
        decode_npy(data[:-4], (6,), (np.int32,), "x")


def test_truncated_shard_names_the_shard_and_sample(tmp_path):
    info, _ = write(tmp_path)
    path = tmp_path / info.file
    path.write_bytes(path.read_bytes()[: info.bytes // 2])
    with pytest.raises(ShardError) as err:
        list(iter_shard(path, META))
    assert str(path) in str(err.value) and "sample 00000000" in str(err.value)


def test_corrupted_values_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    bad = sample(rng)
    bad["topk_ids"][2, 1] = META.vocab_size + 3  # an id outside the vocabulary
    writer = ShardWriter(tmp_path / "bad.tar", "train", META)
    writer.add("000000000", sample(rng))
    writer.add("000000001", bad)
    info = writer.close()
    it = iter_shard(tmp_path / info.file, META)
    next(it)
    with pytest.raises(ShardError, match=r"bad.tar sample 000000001: topk_ids holds ids outside"):
        next(it)
    # a flipped byte is caught by the checksum when asked
    raw = bytearray((tmp_path / info.file).read_bytes())
    raw[2000] ^= 0xFF
    (tmp_path / info.file).write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="sha256"):
        list(iter_shard(tmp_path / info.file, META, verify_sha256=info.sha256))


def flip_payload_bytes(path: Path, member: str, array: np.ndarray) -> None:
    """Changes two bytes inside the data of ``member`` (after its .npy header): the shard still parses."""
    with tarfile.open(path) as tar:
        start = tar.getmember(member).offset_data + len(encode_npy(array)) - array.nbytes
    raw = bytearray(path.read_bytes())
    raw[start + 1] ^= 0x01
    raw[start + 4] ^= 0x10
    path.write_bytes(bytes(raw))


def test_two_changed_payload_bytes_are_refused_naming_the_shard(tmp_path):
    info, samples = write(tmp_path)
    path = tmp_path / info.file
    flip_payload_bytes(path, "000000003.hidden_2.npy", samples[3]["hidden_2"])
    unchecked = list(iter_shard(path, META))  # every array still parses and passes the value checks
    assert len(unchecked) == 5 and not np.array_equal(unchecked[3][1]["hidden_2"], samples[3]["hidden_2"])
    with pytest.raises(ShardError, match=re.escape(f"{path}: sha256 ") + r"\w+ differs from the manifest's"):
        list(iter_shard(path, META, verify_sha256=info.sha256))
    with pytest.raises(ShardError, match="sha256"):  # members read but not decoded are hashed too
        list(iter_shard(path, META, verify_sha256=info.sha256, fields=("tokens", "loss_mask")))
    intact, _ = write(tmp_path, name="intact.tar")  # the check passes on an unchanged shard (one read, not two)
    assert len(list(iter_shard(tmp_path / intact.file, META, verify_sha256=intact.sha256))) == 5


def test_manifest_lists_finished_shards_and_catches_truncation(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest"):
        load_manifest(tmp_path)
    info, _ = write(tmp_path)
    write_manifest(tmp_path, META, [info])
    meta, shards = load_manifest(tmp_path)
    assert meta == META and shards == [info]
    path = tmp_path / info.file
    path.write_bytes(path.read_bytes()[:-512])
    with pytest.raises(ShardError, match="truncated or replaced"):
        load_manifest(tmp_path)
    assert finished_shard(path) is None  # a resumed precompute rewrites it


def test_meta_validation_names_the_key(tmp_path):
    record = META.to_dict()
    for key, value, match in [
        ("schema_version", 99, "schema_version"),
        ("k", 0, "k=0"),
        ("logprob_dtype", "int8", "dtypes"),
        ("hidden_layers", ["x"], "hidden_layers"),
    ]:
        with pytest.raises(ShardError, match=match):
            ShardMeta.from_dict({**record, key: value}, "m.json")
    with pytest.raises(ShardError, match="unknown"):
        ShardMeta.from_dict({**record, "extra": 1}, "m.json")
    (tmp_path / "manifest.json").write_text(json.dumps({"meta": record, "shards": [{"file": "../x"}]}))
    with pytest.raises(ShardError, match="not a shard manifest"):
        load_manifest(tmp_path)


def test_check_compatible_refuses_each_mismatch():
    check_compatible(META, "s", vocab_size=50, tokenizer_hash="a" * 64, temperature=1.0)
    with pytest.raises(ValueError, match="50-token vocabulary.*48 tokens"):
        check_compatible(META, "s", vocab_size=48)
    with pytest.raises(ValueError, match="another tokenizer"):
        check_compatible(META, "s", tokenizer_hash="b" * 64)
    with pytest.raises(ValueError, match="temperature 1.0"):
        check_compatible(META, "s", temperature=2.0)
