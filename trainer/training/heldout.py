"""Held-out next-token loss of a causal LM, and the unigram baseline it has to beat.

A model that learned nothing beyond token frequencies scores the unigram cross entropy: the baseline tells whether a
tiny target has learned anything about the text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from transformers import PreTrainedModel


@torch.no_grad()
def heldout_loss(model: PreTrainedModel, batches: Iterable[dict[str, torch.Tensor]], max_batches: int = 50) -> float:
    """Mean cross entropy (nats per token) over the trained positions of up to ``max_batches`` batches."""
    model.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(batches):
        if i >= max_batches:
            break
        logits = model(input_ids=batch["input_ids"]).logits.float()  # [B, S, V]
        labels = batch["labels"]  # [B, S], -100 where not trained
        losses = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        total += losses.item()
        count += int((labels != -100).sum())
    if count == 0:
        raise ValueError("held-out loss: the held-out batches contain no trained positions")
    return total / count


def unigram_counts(batches: Iterable[dict[str, torch.Tensor]], vocab_size: int, max_batches: int = 200) -> torch.Tensor:
    """Token frequencies of the trained labels: [V] float64."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for i, batch in enumerate(batches):
        if i >= max_batches:
            break
        labels = batch["labels"][batch["labels"] != -100]
        counts += torch.bincount(labels, minlength=vocab_size).double()
    return counts


def unigram_baseline(
    train_counts: torch.Tensor, heldout_batches: Iterable[dict[str, torch.Tensor]], max_batches: int = 50
) -> float:
    """Cross entropy of the held-out labels under the train split's add-one-smoothed unigram distribution."""
    log_probs = torch.log((train_counts + 1.0) / (train_counts.sum() + train_counts.numel()))  # [V]
    total, count = 0.0, 0
    for i, batch in enumerate(heldout_batches):
        if i >= max_batches:
            break
        labels = batch["labels"][batch["labels"] != -100]
        total -= log_probs[labels].sum().item()
        count += labels.numel()
    if count == 0:
        raise ValueError("unigram baseline: the held-out batches contain no trained positions")
    return total / count


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
