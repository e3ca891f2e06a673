"""Fixed-length causal-LM rows: packing token streams, padding documents, and the Dataset that serves them.

A row holds `seq_len + 1` token ids and a per-token "trained" flag; an example built from it is::

    input_ids  [S] long   row[:-1]
    labels     [S] long   row[1:] (the next token), IGNORE_INDEX where it is not trained
    loss_mask  [S] bool   True where labels is trained (aligned with labels)
    document_ids [S] long (rows packed with document masking only) the document of each input position within its
                 row, counted from 0 (trainer/models/documents.py): row[0] may be the tail of a document cut at the
                 previous row; it is document 0 of this row

A row "has nothing to train" when no label is trained (`trained[1:]` all False; `trained[0]` is never a label of its
row). `label_sources` tells which stream (file) each label of a row comes from, so that callers can drop such rows
and count trained tokens per file.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100
MIN_PAD_TOKENS = 2  # pad_rows drops streams shorter than this: one token gives no label


class TokenRows(Dataset):
    """Rows of `seq_len + 1` tokens with a trained flag per token, served as next-token examples."""

    def __init__(self, ids: np.ndarray, trained: np.ndarray, starts: np.ndarray | None = None) -> None:
        """Wrap the arrays.

        Args:
            ids: [R, S + 1] token ids.
            trained: [R, S + 1] bool, True where a token is a training target.
            starts: [R, S + 1] bool, True where a token is the first of its document (`document_starts`), or None:
                with it every example carries `document_ids`.
        """
        if ids.shape != trained.shape or ids.ndim != 2:
            raise ValueError(f"ids {ids.shape} and trained {trained.shape} must be equal 2-d shapes")
        if starts is not None and starts.shape != ids.shape:
            raise ValueError(f"starts {starts.shape} must have the shape of ids {ids.shape}")
        self.ids = ids
        self.trained = trained
        self.starts = starts

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = torch.from_numpy(self.ids[index].astype(np.int64))  # [S + 1]
        trained = torch.from_numpy(self.trained[index, 1:].copy())  # [S]
        labels = torch.where(trained, row[1:], torch.full_like(row[1:], IGNORE_INDEX))  # [S]
        example = {"input_ids": row[:-1], "labels": labels, "loss_mask": trained}
        if self.starts is not None:
            example["document_ids"] = document_ids(self.starts[index])
        return example


def document_ids(starts: np.ndarray) -> torch.Tensor:
    """[S] int64 the document of each input position of a row of S + 1 tokens whose document starts are ``starts``
    [S + 1] bool: 0 for the row's first token (whether or not a document starts there), one more at every start."""
    counts = np.cumsum(starts[1:-1], dtype=np.int64)  # [S - 1] starts among tokens 1..t
    return torch.from_numpy(np.concatenate([np.zeros(1, np.int64), counts]))  # [S]


def pack_rows(streams: list[tuple[np.ndarray, np.ndarray]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (ids, trained) streams and cut them into rows of seq_len + 1 with stride seq_len.

    Returns ids [R, S + 1] int32 and trained [R, S + 1] bool, R = (total - 1) // S (0 when too short).
    """
    if not streams:
        return np.zeros((0, seq_len + 1), np.int32), np.zeros((0, seq_len + 1), bool)
    ids = np.concatenate([s[0] for s in streams]).astype(np.int32)  # [N]
    trained = np.concatenate([s[1] for s in streams]).astype(bool)  # [N]
    rows = max(0, (ids.shape[0] - 1) // seq_len)
    index = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # [R, S + 1]
    return ids[index], trained[index]


def document_starts(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """[R, S + 1] bool: which tokens of the `pack_rows` rows of streams of these lengths are a stream's first token.

    Args:
        lengths: [D] tokens of each stream, in the order given to pack_rows.
        seq_len: the rows' seq_len.
    """
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    rows = max(0, (total - 1) // seq_len)
    first = np.zeros(total, bool)  # [N]
    first[(np.cumsum(lengths) - lengths)[lengths > 0]] = True
    index = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # [R, S + 1]
    return first[index]


def pad_rows(streams: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One row per stream: truncated to seq_len + 1 tokens or right-padded with pad_id (pads not trained)."""
    keep = [s for s in streams if s[0].shape[0] >= MIN_PAD_TOKENS]
    ids = np.full((len(keep), seq_len + 1), pad_id, np.int32)  # [R, S + 1]
    trained = np.zeros((len(keep), seq_len + 1), bool)  # [R, S + 1]
    for r, (doc_ids, doc_trained) in enumerate(keep):
        n = min(doc_ids.shape[0], seq_len + 1)
        ids[r, :n] = doc_ids[:n]
        trained[r, :n] = doc_trained[:n]
    return ids, trained


def label_sources(lengths: np.ndarray, tags: np.ndarray, seq_len: int, pack: bool) -> tuple[np.ndarray, np.ndarray]:
    """The tag of the stream each label of `pack_rows` (pack=True) or `pad_rows` (pack=False) rows comes from.

    Args:
        lengths: [D] tokens of each stream, in the order given to pack_rows / pad_rows.
        tags: [D] an integer tag of each stream (e.g. the index of its file).
        seq_len: the rows' seq_len.
        pack: whether the rows were packed (True) or padded (False).

    Returns tag [R, S] (label j of a row is its token j + 1) and real [R, S] bool: the label is a stream token, not
    padding. The arrays may be read-only views.
    """
    lengths = np.asarray(lengths, np.int64)
    tags = np.asarray(tags)
    if pack:
        total = int(lengths.sum())
        rows = max(0, (total - 1) // seq_len)
        per_token = np.repeat(tags, lengths)  # [N]
        label = per_token[1 : rows * seq_len + 1].reshape(rows, seq_len)  # [R, S]
        return label, np.ones((rows, seq_len), bool)
    keep = lengths >= MIN_PAD_TOKENS
    n = np.minimum(lengths[keep], seq_len + 1)  # [R] stream tokens in each row
    label = np.broadcast_to(tags[keep][:, None], (int(keep.sum()), seq_len))  # [R, S]
    real = np.arange(1, seq_len + 1)[None, :] < n[:, None]  # [R, S]
    return label, real


class MixedRows(Dataset):
    """Packed rows of ``split * S + 1`` tokens (stride ``split * S``), each served whole (one long row) or as the
    ``split`` rows of ``S + 1`` tokens (stride ``S``) that `pack_rows` at ``S`` would cut from the same tokens: either
    way every token of it but the first is a label exactly once. Keys are ``(index, long)`` pairs (`MixedLengthSampler`
    in trainer/data/sampler.py); an example's tensors are [n, T]: [1, split * S] long, [split, S] short, which
    `collate_rows` concatenates into a batch."""

    def __init__(self, ids: np.ndarray, trained: np.ndarray, starts: np.ndarray | None, split: int) -> None:
        """Wrap the arrays.

        Args:
            ids: [R, split * S + 1] token ids.
            trained: [R, split * S + 1] bool, True where a token is a training target.
            starts: [R, split * S + 1] bool document starts (`document_starts`), or None: without document_ids.
            split: short rows per long row (long_seq_len / seq_len).
        """
        if (ids.shape[1] - 1) % split:
            raise ValueError(f"rows of {ids.shape[1] - 1} tokens do not split into {split} equal rows")
        self.rows = TokenRows(ids, trained, starts)
        self.split = split
        self.seq_len = (ids.shape[1] - 1) // split

    @property
    def ids(self) -> np.ndarray:
        """[R, split * S + 1] the long rows' token ids (every token but each row's first is a label once)."""
        return self.rows.ids

    @property
    def trained(self) -> np.ndarray:
        """[R, split * S + 1] their trained flags."""
        return self.rows.trained

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: tuple[int, bool]) -> dict[str, torch.Tensor]:
        index, long = key
        if long:
            return {name: value[None] for name, value in self.rows[index].items()}  # each [1, split * S]
        S = self.seq_len
        cut = np.arange(self.split)[:, None] * S + np.arange(S + 1)[None, :]  # [split, S + 1]
        short = TokenRows(
            self.rows.ids[index][cut],
            self.rows.trained[index][cut],
            None if self.rows.starts is None else self.rows.starts[index][cut],
        )
        examples = [short[j] for j in range(self.split)]
        return {name: torch.stack([e[name] for e in examples]) for name in examples[0]}  # each [split, S]


def collate_rows(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch of `MixedRows` examples: their [n, T] tensors concatenated into [sum n, T]."""
    return {name: torch.cat([e[name] for e in examples]) for name in examples[0]}
