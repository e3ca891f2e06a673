"""Reading the documents of a text or chat data set: local files, folders and glob patterns, or a hub split.

`expand_data_files` turns `train_files` / `val_files` entries into files (a folder gives every supported file inside
it, recursively, sorted; a pattern its sorted matches). `DocumentReader` reads them: .txt (one document per file),
.jsonl (one record per line, parsed here so that a broken line is an error `FILE:LINE: not valid JSON (...)`), .json (an
array of records, JSON lines, or one object of columns read by `datasets`), .parquet (`datasets`), or a `datasets`
hub split. `Documents` keeps, for every document, the file and the line or record it came from, so that every later
error or warning can name them.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.interface.errors import DataError, PathError

_TEXT_SUFFIXES = (".txt",)
_JSON_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)
_GLOB_CHARS = ("*", "?", "[")


def _supported(p: Path, suffixes: tuple[str, ...], skip: Path | None) -> bool:
    return p.is_file() and p.suffix.lower() in suffixes and (skip is None or not p.resolve().is_relative_to(skip))


def _folder_files(folder: Path, suffixes: tuple[str, ...], skip: Path | None) -> list[str]:
    """Every file with one of `suffixes` under `folder` (recursively; hidden files and folders skipped), sorted."""
    found = []
    for p in sorted(folder.rglob("*")):
        if any(part.startswith(".") for part in p.relative_to(folder).parts):
            continue
        if _supported(p, suffixes, skip):
            found.append(str(p))
    return found


def expand_data_files(
    paths: list[str], suffixes: tuple[str, ...], skip: str | None = None, key: str | None = None
) -> list[str]:
    """The files that `train_files` / `val_files` entries name, in order: a file is itself, a folder gives every file
    with one of `suffixes` inside it (recursively, sorted), a glob pattern gives its sorted matches (folders among them
    expanded, files without a supported suffix left out). Files under `skip` (the cache folder) are never listed.

    Raises PathError (a FileNotFoundError) naming the entry, and the recipe `key` when given, when a path does not
    exist or a folder or pattern holds no supported file.
    """
    skip_path = Path(skip).resolve() if skip else None
    kinds = ", ".join(suffixes)
    where = f"{key}: " if key else ""
    hint = "check the path (relative paths start from the folder draftsmith runs in)"
    out: list[str] = []
    for entry in paths:
        path = os.path.expanduser(str(entry))
        p = Path(path)
        if p.is_file():
            out.append(path)
        elif p.is_dir():
            found = _folder_files(p, suffixes, skip_path)
            if not found:
                raise PathError(f"{where}data folder {entry} holds no data file ({kinds})", hint)
            out.extend(found)
        elif any(c in path for c in _GLOB_CHARS):
            found = []
            for match in sorted(glob.glob(path, recursive=True)):
                m = Path(match)
                if m.is_dir():
                    found.extend(_folder_files(m, suffixes, skip_path))
                elif _supported(m, suffixes, skip_path):
                    found.append(match)
            if not found:
                raise PathError(f"{where}data pattern {entry} matches no data file ({kinds})", hint)
            out.extend(found)
        else:
            raise PathError(f"{where}data file not found: {entry}", hint)
    return out


def data_suffixes(format: str) -> tuple[str, ...]:
    """The file suffixes `train_files` / `val_files` folders and patterns list for `format` ("text" or "chat": chat
    data is never read from .txt files)."""
    return (() if format == "chat" else _TEXT_SUFFIXES) + _JSON_SUFFIXES + _PARQUET_SUFFIXES


def check_data_paths(init_args: Mapping[str, Any] | Any) -> None:
    """Checks that every local path a datamodule's arguments name exists, before anything heavy starts.

    Reads the `data.init_args` of a recipe (a mapping or a jsonargparse Namespace): TextDataModule's `train_files`
    and `val_files` (each entry a file, a folder holding a data file, or a pattern matching one, as
    :func:`expand_data_files` expands them for the `format`), and ShardDataModule's `shards` folder (with its
    manifest.json). Keys a datamodule does not have are ignored.

    Raises:
        PathError: naming the recipe key (``data.train_files``...) and the path.
    """
    args = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})
    suffixes = data_suffixes(str(args.get("format") or "text"))
    for key in ("train_files", "val_files"):
        entries = args.get(key)
        if entries:
            if isinstance(entries, str | os.PathLike):
                entries = [entries]
            expand_data_files([str(e) for e in entries], suffixes, skip=args.get("cache_dir"), key=f"data.{key}")
    shards = args.get("shards")
    if shards is not None:
        check_shards_folder(str(shards))


def check_shards_folder(shards: str, key: str = "data.shards") -> None:
    """A PathError naming `key` when `shards` is not a folder holding the manifest.json `draftsmith precompute` writes
    when it finishes."""
    folder = Path(os.path.expanduser(shards))
    if not folder.is_dir():
        kind = "a file, not a folder" if folder.exists() else "no such folder"
        raise PathError(f"{key}: {shards}: {kind}", "point it to the folder `draftsmith precompute` wrote")
    if not (folder / "manifest.json").is_file():
        finished = len(list(folder.glob("*.tar.json")))
        raise PathError(
            f"{key}: {shards}: no manifest.json ({finished} finished shards there)",
            "run or resume `draftsmith precompute` to the end",
        )


def read_utf8_text(p: Path, path: str) -> str:
    """The text of a .txt data file, which must be UTF-8: other bytes are a :class:`DataError` naming the file, the
    byte offset and the line (nothing is replaced silently)."""
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"{path}: not UTF-8 text at byte {err.start} (line {line}: {err.reason})",
            hint=f"convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > converted.txt",
        ) from err


@dataclass
class Documents:
    """Documents (str) or conversations (message lists) with the file and record each came from."""

    items: list[Any]
    source: np.ndarray  # [N] int64: index into `names`
    record: np.ndarray  # [N] int64: line number (unit "line") or record index (unit "record") in its source
    names: list[str]  # the sources: file paths or "hub_name[split]"
    units: list[str]  # per source: "line", "record" or "file" (one document per file)

    def __len__(self) -> int:
        return len(self.items)

    def where(self, i: int) -> str:
        """`FILE:LINE`, `SOURCE record N` or `FILE` for document i."""
        s = int(self.source[i])
        unit = self.units[s]
        if unit == "line":
            return f"{self.names[s]}:{int(self.record[i])}"
        return self.names[s] if unit == "file" else f"{self.names[s]} record {int(self.record[i])}"

    def take(self, index: np.ndarray) -> Documents:
        """The documents at `index` (in that order), keeping their sources."""
        return Documents(
            [self.items[i] for i in index.tolist()], self.source[index], self.record[index], self.names, self.units
        )

    def label(self) -> str:
        return ", ".join(self.names)


@dataclass
class DocumentReader:
    """Reads documents (text) or conversations (chat) from local files or a hub data set.

    Attributes:
        format: "text" or "chat".
        text_field: key of the document text in .jsonl / .json / .parquet records.
        messages_field: key of the message list in chat records.
        cache_dir: the tokenized-rows cache (never listed as data; `datasets`' own cache under hf/).
        dataset_name: a `datasets` hub name, or None.
        dataset_config: the hub data set's configuration name.
    """

    format: str
    text_field: str
    messages_field: str
    cache_dir: str
    dataset_name: str | None = None
    dataset_config: str | None = None

    def key(self) -> str:
        return self.messages_field if self.format == "chat" else self.text_field

    def field(self, record: Any, where: str) -> Any:
        """The document or conversation of one JSON record read at `where`."""
        key = self.key()
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object with key {key!r}, got a {type(record).__name__}")
        if key not in record:
            raise DataError(f"{where}: record has no key {key!r} (keys: {', '.join(record)})")
        return record[key]

    def read_json_lines(self, p: Path, path: str) -> tuple[list[Any], list[int]]:
        """The records of a JSON-lines file, parsed one line at a time (blank lines skipped), and their line numbers."""
        items: list[Any] = []
        lines: list[int] = []
        with open(p, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{number}: not valid JSON ({err.msg}, column {err.colno})") from err
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}:{number}: not valid JSON (not UTF-8: {err.reason})") from err
                items.append(self.field(record, f"{path}:{number}"))
                lines.append(number)
        return items, lines

    def read_json(self, p: Path, path: str) -> tuple[list[Any], list[int], str]:
        """A .json file: a JSON array of records, JSON lines, or (read by `datasets`) one object of columns."""
        try:
            text = p.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not valid JSON (not UTF-8 at byte {err.start}: {err.reason})") from err
        if not text.strip():
            return [], [], "record"
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as err:
            if err.msg != "Extra data" or text.lstrip().startswith("["):
                raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from err
            whole = None  # a first value followed by more: JSON lines, read (and checked) one line at a time
        if isinstance(whole, list):
            items = [self.field(r, f"{path} record {i}") for i, r in enumerate(whole)]
            return items, list(range(len(items))), "record"
        if isinstance(whole, dict):  # one object: `datasets` reads it (e.g. columns of lists)
            items = self.read_datasets("json", p, path)
            return items, list(range(len(items))), "record"
        if whole is not None:
            raise DataError(f"{path}: expected JSON records, got a {type(whole).__name__}")
        del text  # the line reader reads the file again, one line at a time
        items, lines = self.read_json_lines(p, path)
        return items, lines, "line"

    def read_datasets(self, builder: str, p: Path, path: str) -> list[Any]:
        import datasets

        try:
            ds = datasets.load_dataset(
                builder, data_files=[str(p)], split="train", cache_dir=os.path.join(self.cache_dir, "hf")
            )
        except Exception as err:  # datasets wraps parser errors in several types
            raise DataError(f"could not read {path}: {err}") from err
        return self.column(ds, path)

    def read_file(self, path: str) -> tuple[list[Any], list[int], str]:
        """The documents (str) or conversations (list of messages) in one local file, the number of each record and
        the unit of those numbers: "line" (.jsonl), "record" (index in the file) or "file" (.txt: one document)."""
        p = Path(path)
        if not p.is_file():
            raise PathError(f"data file not found: {path}")
        suffix = p.suffix.lower()
        if suffix in _TEXT_SUFFIXES:
            if self.format == "chat":
                raise DataError(f"{path}: a .txt file holds plain text; chat data needs .jsonl, .json or .parquet")
            return [read_utf8_text(p, path)], [0], "file"
        if suffix == ".jsonl":
            items, lines = self.read_json_lines(p, path)
            return items, lines, "line"
        if suffix == ".json":
            return self.read_json(p, path)
        if suffix in _PARQUET_SUFFIXES:
            items = self.read_datasets("parquet", p, path)
            return items, list(range(len(items))), "record"
        raise DataError(f"{path}: unsupported data file type {suffix!r} (use .txt, .jsonl, .json or .parquet)")

    def column(self, ds: Any, source: str) -> list[Any]:
        key = self.key()
        if len(ds) == 0:
            return []
        if key not in ds.column_names:
            raise DataError(f"{source}: records have no key {key!r} (keys: {', '.join(ds.column_names)})")
        return list(ds[key])

    def read_hub(self, split: str) -> list[Any]:
        import datasets

        try:
            ds = datasets.load_dataset(
                self.dataset_name, self.dataset_config, split=split, cache_dir=os.path.join(self.cache_dir, "hf")
            )
        except FileNotFoundError as err:
            raise PathError(f"data set {self.dataset_name!r} (split {split!r}) not found: {err}") from err
        return self.column(ds, f"{self.dataset_name}[{split}]")

    def expand(self, paths: list[str]) -> list[str]:
        """The files of `train_files` / `val_files` entries (.txt only for text data)."""
        return expand_data_files(paths, data_suffixes(self.format), skip=self.cache_dir)

    def documents(self, files: list[str], split: str | None) -> Documents:
        """Every document of the files, in order, then of the hub split."""
        items: list[Any] = []
        sources: list[np.ndarray] = []
        records: list[np.ndarray] = []
        names: list[str] = []
        units: list[str] = []
        for f in files:
            got, numbers, unit = self.read_file(f)
            items.extend(got)
            sources.append(np.full(len(got), len(names), np.int64))
            records.append(np.asarray(numbers, np.int64))
            names.append(f)
            units.append(unit)
        if split is not None:
            got = self.read_hub(split)
            items.extend(got)
            sources.append(np.full(len(got), len(names), np.int64))
            records.append(np.arange(len(got), dtype=np.int64))
            names.append(f"{self.dataset_name}[{split}]")
            units.append("record")
        empty = np.zeros(0, np.int64)
        source = np.concatenate(sources) if sources else empty
        return Documents(items, source, np.concatenate(records) if records else empty, names, units)
