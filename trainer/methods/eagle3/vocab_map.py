"""The reduced draft vocabulary of EAGLE-3: ``d2t`` and ``t2d`` from token frequencies under the loss mask.

The draft vocabulary is the ``draft_vocab_size`` most frequent target tokens among the trained labels, ties broken by
the smaller id, then sorted by id. ``d2t[d]`` is ``target_id - d`` (int64, the engines' convention: target id =
d + d2t[d]); ``t2d[t]`` is True when target token t is in the draft vocabulary. When fewer distinct tokens occur
than the draft vocabulary holds, the rest is filled with the smallest unseen ids (count 0, ties by id).

The map is computed once, before training; after that it lives in the drafter's state dict and is never rebuilt.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from trainer.interface.errors import RecipeError


def check_draft_vocab(draft_vocab_size: int, target_vocab_size: int, target: str) -> None:
    """Refuses a draft vocabulary (``model.draft_vocab_size``) larger than the target's output rows, or not positive:
    a RecipeError naming the key, both sizes and the target."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise RecipeError(
            f"model.draft_vocab_size={draft_vocab_size} must be in 1..{target_vocab_size}: the draft vocabulary is a "
            f"subset of the target {target!r}'s vocabulary of {target_vocab_size} tokens",
            hint=f"set model.draft_vocab_size to at most {target_vocab_size} (32000 for a 128k-token target)",
        )


def count_label_tokens(rows: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> torch.Tensor:
    """Token counts [V] (int64) of the trained labels of ``(ids, trained)`` row pairs ([R, S + 1] each, as in
    trainer/data/packing.py: token j is a label of the row when ``trained[j]`` and j > 0)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, trained in rows:
        ids = np.asarray(ids)
        trained = np.asarray(trained, dtype=bool)
        labels = ids[..., 1:][trained[..., 1:]]  # [n]
        if labels.size and (labels.min() < 0 or labels.max() >= vocab_size):
            raise ValueError(f"training data holds token id {int(labels.max())} outside the vocabulary of {vocab_size}")
        counts += np.bincount(labels.astype(np.int64), minlength=vocab_size)
    return torch.from_numpy(counts)


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts: [V] token frequencies -> (d2t int64 [Vd], t2d bool [V])."""
    V = counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V}, got {draft_vocab_size}")
    ids = torch.arange(V)
    # sort by count descending, then by id ascending (stable sort of ids already in ascending order)
    order = torch.sort(-counts.to(torch.int64), stable=True).indices  # [V]
    chosen = torch.sort(ids[order[:draft_vocab_size]]).values  # [Vd] target ids, ascending
    d2t = chosen - torch.arange(draft_vocab_size)  # [Vd]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.to(torch.int64), t2d


def vocab_map_from_rows(
    rows: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The map of a data set's rows: :func:`count_label_tokens` then :func:`build_vocab_map`."""
    return build_vocab_map(count_label_tokens(rows, vocab_size), draft_vocab_size)


def install_vocab_map(drafter, target_lm_head: torch.Tensor, rows: Iterable[tuple[np.ndarray, np.ndarray]]) -> float:
    """Count the trained labels of ``(ids, trained)`` chunks, install the map in ``drafter`` (an EAGLE-3 or P-EAGLE
    drafter) and copy the target's lm_head rows [V, Ht] of the draft vocabulary into its head when the shapes match.

    Returns:
        The share of the trained labels the draft vocabulary covers.
    """
    cfg = drafter.config
    counts = count_label_tokens(rows, cfg.vocab_size)  # [V]
    d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
    drafter.set_vocab_map(d2t.to(drafter.d2t.device), t2d.to(drafter.t2d.device))
    with torch.no_grad():
        head = target_lm_head.detach()  # [V, Ht]
        rows_ = head.index_select(0, drafter.draft_ids().to(head.device))  # [Vd, Ht]
        if rows_.shape == drafter.lm_head.weight.shape:
            drafter.lm_head.weight.copy_(rows_)
    return float(counts[t2d].sum()) / max(1, int(counts.sum()))


LSE_CHUNK = 1024
"""Positions projected onto the whole vocabulary at a time for the target's log-partition (:func:`draft_mass`)."""


def draft_mass(target, final: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """The target's probability of its draft vocabulary [B, S] float32: ``exp(lse(draft logits) - lse(all logits))``,
    the full vocabulary's log-partition taken :data:`LSE_CHUNK` positions at a time (one [C, V] tensor alive).

    final: [B, S, Ht] the target's normed final hidden states; draft_logits: [B, S, Vd] its logits of the draft
    vocabulary (with its output scaling, ``target.project``)."""
    flat = final.flatten(0, -2)  # [B * S, Ht]
    lse = torch.cat([torch.logsumexp(target.project(part).float(), dim=-1) for part in flat.split(LSE_CHUNK)])
    return (torch.logsumexp(draft_logits.float(), dim=-1) - lse.view(final.shape[:-1])).exp().clamp(max=1.0)


def online_target_signals(
    target,
    ids: torch.Tensor,
    drafter,
    soft: bool,
    with_mass: bool = True,
    documents: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The frozen target's signals for an EAGLE-3 or P-EAGLE drafter over the batch ``ids`` [B, S].

    With soft labels the target's final hidden state is projected onto the draft vocabulary's rows of its lm_head
    only: no [B, S, V] logits are made (the full vocabulary costs 8x the projection at a 1/8 draft vocabulary, and
    at 8B is the step's largest tensor), and the argmax, for the accuracy metrics, is the target's most likely token of
    the draft vocabulary, as speculators reports it; the share of the draft vocabulary (:func:`draft_mass`) takes the
    full vocabulary's log-partition a chunk of positions at a time, skipped without ``with_mass`` (it costs as much as
    the projection onto every row: the objectives ask for it when a loss or a logged metric reads it). Argmax labels
    need the argmax over the whole vocabulary (positions whose argmax is outside the draft vocabulary are skipped), so
    they project onto every row, and the mass comes with them. ``documents`` [B, S] (a packed row's document_ids,
    trainer/models/documents.py): the target runs each document alone (FrozenTarget.forward's document_ids).
    ``position_ids`` [B, S]: the positions of ``ids`` (a slice of a row under sequence parallelism), or None.

    Returns:
        the hidden states of the drafter's aux layers (each [B, S, Ht]), the argmax [B, S] (target ids), the target's
        distribution over the draft vocabulary renormalised [B, S, Vd] (float32; the soft labels) and its mass there
        before renormalising [B, S] (float32; None with soft labels and not ``with_mass``): their product is the
        target's own probabilities of the draft vocabulary, what the expected acceptance is measured against (with
        either labels).
    """
    aux = list(drafter.config.aux_layers)
    rows = drafter.draft_ids()
    if not soft:
        out = target(ids, hidden_layers=aux, document_ids=documents, position_ids=position_ids)  # logits [B, S, V]
        flat = out.logits.flatten(0, -2)  # [B * S, V]
        lse = torch.cat([torch.logsumexp(part.float(), dim=-1) for part in flat.split(LSE_CHUNK)])
        draft = out.logits.index_select(-1, rows.to(out.logits.device)).float()  # [B, S, Vd]
        mass = (torch.logsumexp(draft, dim=-1) - lse.view(draft.shape[:-1])).exp().clamp(max=1.0)  # [B, S]
        return out.hidden_states, out.logits.argmax(-1), torch.softmax(draft, dim=-1), mass
    out = target(
        ids, hidden_layers=[*aux, target.num_layers], logits=False, document_ids=documents, position_ids=position_ids
    )
    *hidden, final = out.hidden_states  # final: [B, S, Ht], the normed output lm_head projects
    logits = target.project(final, rows.to(final.device))  # [B, S, Vd]
    mass = draft_mass(target, final, logits) if with_mass else None  # [B, S]
    return hidden, drafter.to_target_ids(logits.max(-1).indices), torch.softmax(logits.float(), dim=-1), mass
