"""Teacher-signal shards: the on-disk schema, an atomic shard writer, a validating reader and the manifest.

A shard set is a folder::

    manifest.json                 meta (below) + every finished shard: split, file, samples, bytes, sha256
    precompute.json               the meta alone, written first (a resumed precompute must match it)
    train-000000.tar              webdataset tar shards, one sample per sequence
    train-000000.tar.json         the shard's sidecar record, written after the tar is complete
    val-000000.tar ...

A sample is the webdataset members ``{key}.{field}.npy`` (``key`` is the sequence's index in its split, 9 digits):

    tokens.npy          int32 [S + 1]   the row: input_ids = tokens[:-1], next-token labels = tokens[1:]
    loss_mask.npy       bool  [S]       True where labels (tokens[1:]) is trained
    topk_ids.npy        int32 [S, k]    the teacher's k most likely next tokens at every position (descending)
    topk_logprobs.npy   float16|float32 [S, k]  log_softmax(teacher logits / temperature) at those ids
    hidden_{i}.npy      float16|uint16|float32 [S, H]   HF hidden_states[i] of the teacher (uint16: bfloat16 bits)

The meta records the schema version, the teacher (path and a fingerprint), the tokenizer hash, the shared vocabulary
size, k, temperature, seq_len, dtypes and hidden layers. Readers check it against the recipe and refuse a mismatch.

Safety: arrays are .npy parsed by header (``allow_pickle`` is never used); the dtype, shape and id range of every
array are checked before use, so a broken or hostile shard gives an error naming the shard and sample. Changed bytes
that still parse (a flipped bit in a hidden state) are caught by the sha256 the manifest records: ``iter_shard``
hashes the bytes as it streams them (one read of the file) and raises naming the shard when the digest differs, at
the end of the shard, so the samples before the check have already been served.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from trainer.interface.errors import DataError, PathError, TokenizerError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
META = "precompute.json"
LOGPROB_DTYPES = {"float16": np.float16, "float32": np.float32}
# numpy has no bfloat16: its bits ride in uint16; float32 is exact (tests comparing offline with online training)
HIDDEN_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
_FINGERPRINT_BYTES = 1 << 20
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash")


class ShardError(DataError):
    """A shard that cannot be read or does not match its meta; the message names the shard and sample."""


@dataclass(frozen=True)
class ShardMeta:
    """What a shard set holds and how it was made (the versioned record the readers check)."""

    teacher: str
    teacher_fingerprint: str
    tokenizer_hash: str
    vocab_size: int
    k: int
    temperature: float
    seq_len: int
    logprob_dtype: str = "float16"
    hidden_layers: list[int] = field(default_factory=list)
    hidden_size: int = 0
    hidden_dtype: str = "bfloat16"
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, record: Any, source: str) -> ShardMeta:
        """Validates the types and values of a meta record read from ``source``."""
        if not isinstance(record, dict):
            raise ShardError(f"{source}: meta is not a JSON object")
        if record.get("schema_version") != SCHEMA_VERSION:
            raise ShardError(
                f"{source}: schema_version {record.get('schema_version')!r} is not {SCHEMA_VERSION}: rerun precompute"
            )
        names = {f.name for f in fields(cls)}
        unknown, missing = set(record) - names, names - set(record)
        if unknown or missing:
            raise ShardError(f"{source}: meta keys unknown {sorted(unknown)} / missing {sorted(missing)}")
        ints = ("vocab_size", "k", "seq_len", "hidden_size")
        for key in ints:
            if not isinstance(record[key], int) or record[key] < 0:
                raise ShardError(f"{source}: meta {key}={record[key]!r} is not a non-negative integer")
        if not 0 < record["k"] <= record["vocab_size"] or record["seq_len"] < 1:
            raise ShardError(f"{source}: meta k={record['k']} must be in [1, vocab_size={record['vocab_size']}]")
        if record["logprob_dtype"] not in LOGPROB_DTYPES or record["hidden_dtype"] not in HIDDEN_DTYPES:
            raise ShardError(f"{source}: meta dtypes {record['logprob_dtype']!r}, {record['hidden_dtype']!r} unknown")
        layers = record["hidden_layers"]
        if not isinstance(layers, list) or not all(isinstance(i, int) and i >= 0 for i in layers):
            raise ShardError(f"{source}: meta hidden_layers={layers!r} is not a list of layer indices")
        if layers and record["hidden_size"] < 1:
            raise ShardError(f"{source}: meta has hidden_layers but hidden_size={record['hidden_size']}")
        if not isinstance(record["temperature"], int | float) or record["temperature"] <= 0:
            raise ShardError(f"{source}: meta temperature={record['temperature']!r} is not positive")
        return cls(**{**record, "temperature": float(record["temperature"])})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def sample_spec(self) -> dict[str, tuple[tuple[int, ...], tuple[type, ...]]]:
        """Field name -> (shape, allowed numpy dtypes) of one sample."""
        s, k = self.seq_len, self.k
        spec: dict[str, tuple[tuple[int, ...], tuple[type, ...]]] = {
            "tokens": ((s + 1,), (np.int32,)),
            "loss_mask": ((s,), (np.bool_,)),
            "topk_ids": ((s, k), (np.int32,)),
            "topk_logprobs": ((s, k), (LOGPROB_DTYPES[self.logprob_dtype],)),
        }
        for i in self.hidden_layers:
            spec[f"hidden_{i}"] = ((s, self.hidden_size), (HIDDEN_DTYPES[self.hidden_dtype],))
        return spec


@dataclass(frozen=True)
class ShardInfo:
    """One finished shard as listed in the manifest."""

    split: str
    file: str
    samples: int
    bytes: int
    sha256: str


# ---------------------------------------------------------------------------------------------------------- npy


def encode_npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def decode_npy(data: bytes, shape: tuple[int, ...], dtypes: tuple[type, ...], where: str) -> np.ndarray:
    """Parses a .npy payload by its header (never unpickles) and checks shape, dtype and length before use."""
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        got_shape, fortran, dtype = read_header(stream)
    except Exception as err:  # numpy raises ValueError or others on a broken header
        raise ShardError(f"{where}: not a valid .npy payload ({err})") from err
    if dtype.hasobject or dtype.type not in dtypes or fortran:
        raise ShardError(f"{where}: dtype {dtype} (fortran={fortran}) is not one of {[d.__name__ for d in dtypes]}")
    if tuple(got_shape) != shape:
        raise ShardError(f"{where}: shape {tuple(got_shape)} != expected {shape}")
    payload = data[stream.tell() :]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(payload) != expected:
        raise ShardError(f"{where}: {len(payload)} data bytes, expected {expected} (truncated or padded)")
    return np.frombuffer(payload, dtype=dtype).reshape(shape)


def check_sample(arrays: dict[str, np.ndarray], meta: ShardMeta, where: str) -> None:
    """Value checks that shapes and dtypes cannot express: ids in range, finite non-positive log-probabilities."""
    v = meta.vocab_size
    for name in ("tokens", "topk_ids"):
        a = arrays.get(name)
        if a is not None and a.size and (int(a.min()) < 0 or int(a.max()) >= v):
            raise ShardError(f"{where}: {name} holds ids outside [0, {v})")
    lp = arrays.get("topk_logprobs")
    if lp is not None and (not np.isfinite(lp).all() or float(lp.max()) > 1e-3):
        raise ShardError(f"{where}: topk_logprobs are not finite log-probabilities (<= 0)")


# ---------------------------------------------------------------------------------------------------------- writing


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class ShardWriter:
    """Writes one shard to ``{path}.partial`` and, on ``close()``, renames it and writes its sidecar record.

    A shard without a sidecar is unfinished: resumed precomputes rewrite it and manifests never list it.
    """

    def __init__(self, path: Path, split: str, meta: ShardMeta) -> None:
        self.path, self.split, self.meta = Path(path), split, meta
        self.partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self.partial, "wb")  # noqa: SIM115 -- closed in close()
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self.samples = 0

    def add(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        """Adds one sample; ``arrays`` must match the meta's sample spec exactly (checked)."""
        spec = self.meta.sample_spec()
        if set(arrays) != set(spec):
            raise ValueError(f"sample {key}: fields {sorted(arrays)} != schema fields {sorted(spec)}")
        for name in sorted(arrays):
            shape, dtypes = spec[name]
            a = arrays[name]
            if tuple(a.shape) != shape or a.dtype.type not in dtypes:
                raise ValueError(f"sample {key}: {name} is {a.dtype}{tuple(a.shape)}, schema says {shape}")
            data = encode_npy(a)
            info = tarfile.TarInfo(f"{key}.{name}.npy")
            info.size, info.mtime, info.mode = len(data), 0, 0o444  # fixed mtime: identical runs give identical bytes
            self._tar.addfile(info, io.BytesIO(data))
        self.samples += 1

    def close(self) -> ShardInfo:
        self._tar.close()
        self._file.close()
        digest, size = file_sha256(self.partial), self.partial.stat().st_size
        os.replace(self.partial, self.path)
        info = ShardInfo(self.split, self.path.name, self.samples, size, digest)
        _atomic_write_text(self.path.with_name(self.path.name + ".json"), json.dumps(asdict(info)))
        return info

    def abort(self) -> None:
        self._file.close()
        self.partial.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def finished_shard(path: Path) -> ShardInfo | None:
    """The sidecar record of a finished shard whose tar has the recorded size, else None (to be rewritten)."""
    sidecar = path.with_name(path.name + ".json")
    if not sidecar.is_file() or not path.is_file():
        return None
    try:
        info = ShardInfo(**json.loads(sidecar.read_text()))
    except (ValueError, TypeError):
        return None
    return info if info.bytes == path.stat().st_size else None


def write_manifest(out: Path, meta: ShardMeta, shards: list[ShardInfo]) -> Path:
    record = {"meta": meta.to_dict(), "shards": [asdict(s) for s in shards]}
    _atomic_write_text(out / MANIFEST, json.dumps(record, indent=1))
    return out / MANIFEST


# ---------------------------------------------------------------------------------------------------------- reading


def load_manifest(folder: str | Path) -> tuple[ShardMeta, list[ShardInfo]]:
    """Reads and validates ``folder/manifest.json``; every listed shard must exist with its recorded size."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        partial = len(list(folder.glob("*.tar.json"))) if folder.is_dir() else 0
        raise PathError(
            f"{path}: no manifest ({partial} finished shards there): run or resume `draftsmith precompute` to the end"
        )
    try:
        record = json.loads(path.read_text())
        meta = ShardMeta.from_dict(record["meta"], str(path))
        shards = [ShardInfo(**s) for s in record["shards"]]
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise ShardError(f"{path}: not a shard manifest ({err})") from err
    for s in shards:
        f = folder / s.file
        if Path(s.file).name != s.file or not f.is_file():
            raise ShardError(f"{path}: shard {s.file!r} is missing")
        if f.stat().st_size != s.bytes:
            raise ShardError(f"{f}: {f.stat().st_size} bytes, the manifest says {s.bytes} (truncated or replaced)")
    return meta, shards


class _HashingReader:
    """A read-only binary stream that feeds every byte read through sha256 (tarfile's stream mode reads in order)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.hash = raw, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.hash.update(data)
        return data

    def hexdigest_to_end(self) -> str:
        """The digest of the whole file: reads (and hashes) what tarfile left after the end-of-archive block."""
        while chunk := self.raw.read(1 << 22):
            self.hash.update(chunk)
        return self.hash.hexdigest()


def iter_shard(
    path: Path, meta: ShardMeta, verify_sha256: str | None = None, fields: Collection[str] | None = None
) -> Iterator[tuple[str, dict]]:
    """Streams (key, {field: array}) from one shard, validated against ``meta``; errors name shard and sample.

    ``verify_sha256`` (the manifest's digest; None: not checked) is compared with the sha256 of the bytes read, hashed
    as they stream (one read of the file): a mismatch raises ShardError naming the shard before the last sample is
    yielded, i.e. after the others were. A reader that stops early (a worker's share ending inside a shard) checks
    nothing. ``fields`` (default: all) limits what is decoded: the other members are checked by name and skipped (they
    are still read, and hashed).
    """
    spec = meta.sample_spec()
    wanted = set(spec) if fields is None else set(fields)
    if not wanted <= set(spec):
        raise ValueError(f"{path}: fields {sorted(wanted - set(spec))} are not in the shards' schema {sorted(spec)}")
    key, arrays, seen = None, {}, set()

    def finish() -> tuple[str, dict]:
        where = f"{path} sample {key}"
        if seen != set(spec):  # then ``arrays`` holds exactly the wanted fields
            raise ShardError(f"{where}: fields {sorted(seen)} != expected {sorted(spec)}")
        check_sample(arrays, meta, where)
        return key, arrays

    try:
        with open(path, "rb") as raw:
            reader = _HashingReader(raw) if verify_sha256 is not None else raw
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                for member in tar:
                    stem, _, rest = member.name.partition(".")
                    name = rest[: -len(".npy")] if rest.endswith(".npy") else None
                    if not member.isfile() or name not in spec:
                        raise ShardError(f"{path} sample {stem}: unexpected member {member.name!r}")
                    if stem != key:
                        if key is not None:
                            yield finish()
                        key, arrays, seen = stem, {}, set()
                    if member.size > 64 * int(np.prod(spec[name][0])) + 4096:
                        raise ShardError(f"{path} sample {key}: member {member.name} has {member.size} bytes")
                    seen.add(name)
                    if name not in wanted:
                        continue  # the stream moves past the member's bytes without keeping them
                    data = tar.extractfile(member).read()
                    arrays[name] = decode_npy(data, *spec[name], f"{path} sample {key} field {name}")
            if isinstance(reader, _HashingReader):
                digest = reader.hexdigest_to_end()
                if digest != verify_sha256:
                    raise ShardError(
                        f"{path}: sha256 {digest[:16]} differs from the manifest's {str(verify_sha256)[:16]}: the"
                        " shard is corrupted or was replaced after precompute (the samples read before this check"
                        " came from it)"
                    )
    except (tarfile.TarError, OSError, EOFError) as err:
        raise ShardError(f"{path} after sample {key}: broken tar ({type(err).__name__}: {err})") from err
    if key is not None:
        yield finish()


# ---------------------------------------------------------------------------------------------------------- identity


def target_fingerprint(name_or_path: str) -> str:
    """A cheap identity of a target: its config (without volatile keys) and, for a local folder, the name, size and
    first and last MiB of every weight file. Different training runs of one architecture get different prints
    without reading whole checkpoints; it is not a full checksum of the weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path).to_dict()
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".pt", ".pth"):
                size = f.stat().st_size
                h.update(f"{f.name}:{size}".encode())
                with open(f, "rb") as fh:
                    h.update(fh.read(_FINGERPRINT_BYTES))
                    fh.seek(max(0, size - _FINGERPRINT_BYTES))
                    h.update(fh.read(_FINGERPRINT_BYTES))
    return h.hexdigest()


def check_compatible(
    meta: ShardMeta,
    source: str,
    *,
    vocab_size: int | None = None,
    tokenizer_hash: str | None = None,
    teacher: str | None = None,
    temperature: float | None = None,
) -> None:
    """Refuses shards made for another student vocabulary, tokenizer, target or temperature (ValueError naming it)."""
    if vocab_size is not None and vocab_size != meta.vocab_size:
        raise DataError(
            f"{source}: the shards hold a {meta.vocab_size}-token vocabulary but the student's shared vocabulary has"
            f" {vocab_size} tokens: train a student with the target's vocabulary"
        )
    if tokenizer_hash is not None and tokenizer_hash != meta.tokenizer_hash:
        raise TokenizerError(
            f"{source}: made with another tokenizer (hash {meta.tokenizer_hash[:16]}, this recipe's"
            f" {tokenizer_hash[:16]}): rerun precompute with this recipe's tokenizer"
        )
    if teacher is not None:
        print_ = target_fingerprint(teacher)
        if print_ != meta.teacher_fingerprint:
            raise DataError(
                f"{source}: made with another target ({meta.teacher!r}, fingerprint {meta.teacher_fingerprint[:16]})"
                f" than this recipe's {teacher!r} (fingerprint {print_[:16]}): rerun precompute with this target"
            )
    if temperature is not None and abs(temperature - meta.temperature) > 1e-9:
        raise DataError(
            f"{source}: log-probabilities were stored at temperature {meta.temperature}, the recipe asks for"
            f" {temperature}: they cannot be re-tempered without the tail; rerun precompute or match the temperature"
        )
