"""Fixed-length causal-LM rows: packing token streams, padding documents, and the Dataset that serves them.

A row holds `seq_len + 1` token ids and a per-token "trained" flag; an example built from it is::

    input_ids  [S] long   row[:-1]
    labels     [S] long   row[1:] (the next token), IGNORE_INDEX where it is not trained
    loss_mask  [S] bool   True where labels is trained (aligned with labels)
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100


class TokenRows(Dataset):
    """Rows of `seq_len + 1` tokens with a trained flag per token, served as next-token examples."""

    def __init__(self, ids: np.ndarray, trained: np.ndarray) -> None:
        """Wrap the arrays.

        Args:
            ids: [R, S + 1] token ids.
            trained: [R, S + 1] bool, True where a token is a training target.
        """
        if ids.shape != trained.shape or ids.ndim != 2:
            raise ValueError(f"ids {ids.shape} and trained {trained.shape} must be equal 2-d shapes")
        self.ids = ids
        self.trained = trained

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = torch.from_numpy(self.ids[index].astype(np.int64))  # [S + 1]
        trained = torch.from_numpy(self.trained[index, 1:].copy())  # [S]
        labels = torch.where(trained, row[1:], torch.full_like(row[1:], IGNORE_INDEX))  # [S]
        return {"input_ids": row[:-1], "labels": labels, "loss_mask": trained}


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


def pad_rows(streams: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One row per stream: truncated to seq_len + 1 tokens or right-padded with pad_id (pads not trained)."""
    keep = [s for s in streams if s[0].shape[0] >= 2]
    ids = np.full((len(keep), seq_len + 1), pad_id, np.int32)  # [R, S + 1]
    trained = np.zeros((len(keep), seq_len + 1), bool)  # [R, S + 1]
    for r, (doc_ids, doc_trained) in enumerate(keep):
        n = min(doc_ids.shape[0], seq_len + 1)
        ids[r, :n] = doc_ids[:n]
        trained[r, :n] = doc_trained[:n]
    return ids, trained
