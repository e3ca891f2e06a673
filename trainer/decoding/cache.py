"""KV-cache surgery for speculative decoding: keep only the committed tokens of an HF cache.

Works on transformers' ``Cache`` objects (``DynamicCache`` and its per-layer ``DynamicLayer``), whose layers hold
``keys`` and ``values`` of shape ``[B, H, S, D]`` with the tokens in dimension 2. A chain keeps a prefix of what it
verified, so cropping is enough; a tree keeps one root-to-leaf path, whose entries are scattered among the verified
nodes, so they are gathered and moved down next to the prefix (compaction).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache


def new_cache(config) -> DynamicCache:
    """An empty dynamic cache for a model config, able to roll back (sliding-window layers record their past)."""
    cache = DynamicCache(config=config)
    cache.activate_past_recording()
    return cache


def cache_length(cache: Cache) -> int:
    """Number of tokens held by the cache (0 for an empty one)."""
    return int(cache.get_seq_length())


def truncate_cache(cache: Cache, length: int) -> None:
    """Keep the first ``length`` tokens of every layer, in place.

    Args:
        cache: the HF cache to crop.
        length: how many tokens to keep; must not exceed the current length.
    """
    current = cache_length(cache)
    if length < 0 or length > current:
        raise ValueError(f"cannot truncate a cache of {current} tokens to {length}")
    if length < current:
        # transformers >= 5 takes the number of tokens to remove, as a negative integer
        cache.crop(length - current)


def compact_cache(cache: Cache, prefix: int, keep: torch.Tensor) -> None:
    """Keep the first ``prefix`` tokens and then the tokens at positions ``prefix + keep``, in that order, in place.

    Layers may hold different numbers of entries after ``prefix`` (a self-speculative round drafts with the first
    layers only); each is cut to ``prefix + len(keep)``, and every layer must hold the kept entries.

    Args:
        cache: the HF cache; tree paths need layers exposing ``keys`` and ``values`` ``[B, H, S, D]`` (DynamicLayer).
        prefix: the number of leading tokens kept untouched (the committed context before the verified block).
        keep: ``[n]`` increasing offsets, relative to ``prefix``, of the verified tokens to keep (an accepted path).
    """
    keep = keep.to(torch.long).flatten()  # [n]
    n = keep.numel()
    needed = prefix + (int(keep.max()) + 1 if n else 0)
    is_prefix = bool((keep == torch.arange(n, device=keep.device)).all())
    for index, layer in enumerate(cache.layers):
        current = int(layer.get_seq_length())
        if current == 0 and not getattr(layer, "is_initialized", False):
            continue  # a layer never run (shared KV or not reached)
        if (n and int(keep.min()) < 0) or current < needed:
            raise ValueError(
                f"keep offsets {keep.tolist()} out of range for cache layer {index} of {current} entries, "
                f"prefix {prefix}"
            )
        if is_prefix:
            if current > prefix + n:
                layer.crop(prefix + n - current)  # transformers >= 5 takes the number of tokens to remove, negative
            continue
        if getattr(layer, "is_sliding", False) or getattr(layer, "keys", None) is None:
            raise NotImplementedError(f"tree compaction of a {type(layer).__name__} cache layer; use chains")
        index_ = (prefix + keep).to(layer.keys.device)  # [n]
        kept_keys = layer.keys.index_select(2, index_)  # [B, H, n, D]
        kept_values = layer.values.index_select(2, index_)  # [B, H, n, D]
        layer.keys = torch.cat([layer.keys[:, :, :prefix], kept_keys], dim=2)  # [B, H, prefix + n, D]
        layer.values = torch.cat([layer.values[:, :, :prefix], kept_values], dim=2)  # [B, H, prefix + n, D]
