"""What ``draftsmith generate`` (generate.py) reads and writes, whoever writes the replies (the target in this process,
target_replies.py, or a server, server_client.py): the record fields it checks, chunks of output records, the durable
writer of a ``.jsonl`` or ``.parquet`` output (a jsonl line or a parquet part at a time, so that a restart skips what
is written), and the meta file beside the output."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.interface.errors import DataError, UsageError

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    """Regenerated records and what making them took (replies, cut ones, tokens, indices with an empty reply)."""

    records: list[dict[str, Any]]
    turns: int
    truncated: int
    tokens: int
    empty: list[int]


# ---------------------------------------------------------------------------------------------------------------------
# Reading and writing records.


def check_messages(record: dict[str, Any], field: str, where: str) -> list[dict[str, str]]:
    messages = record.get(field)
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise DataError(f"{where}: field {field!r} must be a list of {{'role': str, 'content': str}} messages")
    return messages


def check_prompt(record: dict[str, Any], field: str, where: str) -> str:
    prompt = record.get(field)
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: field {field!r} must be a non-empty string prompt")
    return prompt


def chunk_ranges(done: int, total: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of the chunks still to write; chunk boundaries are the multiples of ``size``."""
    start = done
    while start < total:
        end = min(total, (start // size + 1) * size)
        yield start, end
        start = end


def complete_jsonl_lines(path: Path, repair: bool = True) -> int:
    """The number of complete records of ``path``; with ``repair``, a partial last line (a crash mid-write) is cut
    off first, else the file is only read."""
    if not path.is_file():
        return 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # 0 when no line is complete
    if end < len(data) and repair:
        log.warning("%s: cutting a partial last line of %d bytes (an interrupted write)", path, len(data) - end)
        with path.open("r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    count = 0
    for n, line in enumerate(data[:end].splitlines(), start=1):
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{n}: not a JSON record; delete the output to start over ({err})") from err
        count += 1
    return count


class ChunkWriter:
    """Appends chunks of records durably to a .jsonl file, or as part files later combined into one .parquet."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.parquet = output.suffix.lower() == ".parquet"
        if not self.parquet and output.suffix.lower() != ".jsonl":
            raise UsageError(f"{output}: unsupported output type {output.suffix!r} (use .jsonl or .parquet)")
        self.parts = output.with_name(output.name + ".parts")

    def done(self, repair: bool = True) -> int:
        """Records already written; with ``repair``, a partial jsonl line or stale parquet part is removed first
        (without it nothing is written)."""
        if not self.parquet:
            return complete_jsonl_lines(self.output, repair)
        import pyarrow.parquet as pq

        if self.output.is_file():
            return pq.read_metadata(self.output).num_rows
        for stale in self.parts.glob("*.tmp") if self.parts.is_dir() and repair else []:
            stale.unlink()
        return sum(pq.read_metadata(f).num_rows for f in sorted(self.parts.glob("part-*.parquet")))

    def write(self, records: list[dict[str, Any]], first: int) -> None:
        if not self.parquet:
            blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
            with self.output.open("ab") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.parts.mkdir(parents=True, exist_ok=True)
        final = self.parts / f"part-{first:09d}.parquet"
        tmp = final.with_name(final.name + ".tmp")
        pq.write_table(pa.Table.from_pylist(records), tmp)
        os.replace(tmp, final)

    def finish(self) -> None:
        if not self.parquet or self.output.is_file():
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = sorted(self.parts.glob("part-*.parquet"))
        table = pa.concat_tables([pq.read_table(f) for f in parts], promote_options="default")
        tmp = self.output.with_name(self.output.name + ".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, self.output)
        for f in parts:
            f.unlink()
        self.parts.rmdir()


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, path)


class OutputLock:
    """``OUTPUT.lock``, held while a run writes OUTPUT: a second ``draftsmith generate`` writing the same output stops
    at once, naming it, instead of appending the same records a second time."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = output.with_name(output.name + ".lock")
        self.handle = None

    def acquire(self) -> None:
        self.handle = self.path.open("a")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            self.handle = None
            raise UsageError(
                f"{self.output}: another draftsmith generate is writing it (it holds {self.path.name}); wait for that "
                "run to end, or write to another output"
            ) from None

    def release(self) -> None:
        if self.handle is not None:
            self.path.unlink(missing_ok=True)
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None
