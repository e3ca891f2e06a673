"""Rows that hold several documents, and attention windows: the one convention every attention of the project reads.

A packed row with document masking carries ``document_ids`` [B, S] (int64): the index, within its row, of the document
each input position belongs to, non-decreasing along the row (0, 0, 0, 1, 1, 2, ...). A position attends only to
earlier positions of its own document, and its rotary position counts from its document's first token
(:func:`document_positions`), so a packed row trains exactly what its documents would train alone. Without
``document_ids`` a row is one document, as before.

A sliding window of ``w`` tokens lets a query at position ``t`` see the keys at ``t - w + 1 .. t`` (its own included:
the convention of HF transformers' ``sliding_window`` and of the engines' configs).
"""

from __future__ import annotations

import torch

from trainer.interface.errors import RecipeError


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] the position of every token within its own document (0 at each document's first token)."""
    B, S = document_ids.shape
    index = torch.arange(S, device=document_ids.device).expand(B, S)  # [B, S]
    starts = torch.ones_like(document_ids, dtype=torch.bool)  # [B, S] True at each document's first token
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index))  # [B, S]
    return index - torch.cummax(first, dim=1).values


def allowed_keys(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    query_documents: torch.Tensor | None = None,
    key_documents: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Which keys each query may attend: causal, within its own document, within the window.

    Args:
        query_positions: [B, N] (or [N]) the queries' positions along the row.
        key_positions: [B, M] (or [M]) the keys' positions along the row.
        query_documents, key_documents: [B, N] and [B, M] document indices, or None (one document).
        window: a query at t sees keys at t - window + 1 .. t; None sees every earlier key.

    Returns:
        [B, N, M] (or [N, M]) bool, True where the query may attend the key.
    """
    q = query_positions.unsqueeze(-1)  # [..., N, 1]
    k = key_positions.unsqueeze(-2)  # [..., 1, M]
    allowed = k <= q  # [..., N, M]
    if window is not None:
        allowed = allowed & (q - k < window)
    if query_documents is not None:
        allowed = allowed & (query_documents.unsqueeze(-1) == key_documents.unsqueeze(-2))
    return allowed


def check_window(window: int | None, key: str) -> None:
    """Refuses a window that is not a positive number of tokens, naming the recipe key."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise RecipeError(f"{key}={window!r}: a sliding window is a positive number of tokens (or null for none)")
