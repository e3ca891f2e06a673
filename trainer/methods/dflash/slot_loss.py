"""DFlash's slot loss with its gradients taken in forward, one chunk of slots at a time, on the chunked-loss engine
(trainer/losses/chunked.py): the per-slot loss is :func:`slot_rows`, one of the losses toward a target distribution
(trainer/losses/distribution.py, ``model.loss``: ``kl`` by default, the cross entropy of token labels).

A slot's logits are ``h @ head.T`` (the target's frozen lm_head, bare, as the proposer computes them), plus with a block
refiner's low-rank logit bias (refiner.py ``LogitBias``) ``e @ w2.T`` of the slot's features ``e``: both linear in the
trained inputs, so the gradient of the loss with respect to the logits, ``G = w * (q - p)`` (q the drafter's
distribution, p the label's: one-hot for token labels, the target's distribution for soft ones, w the slot's weight),
gives every gradient at once: ``G @ head`` for ``h``, ``G @ w2`` for ``e`` and ``G.T @ e`` for ``w2``. Only one chunk's
[C, V] logits exist at a time, and none is recomputed in backward: a checkpointed chunk costs three vocabulary
projections (forward, its recomputation, the backward's), this one two. (With ``kl``; the other losses of
trainer/losses/distribution.py take ``G`` by autograd on the chunk.)

Weights may depend on the losses (D-PACE, :func:`block_dpace_weights`): given as a function of a chunk's slots and their
losses, they are taken per chunk before its gradients, which is exact when the chunks hold whole blocks
(:func:`block_chunks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.losses.chunked import RowLoss, RowLosses, Target, Term, Weights, chunked_loss, cross_entropy_rows
from trainer.losses.distribution import DistributionLoss, distribution_rows

Labels = Callable[[slice], "ChunkLabels"]
KL = DistributionLoss("kl")
"""The slot loss of DFlash's default ``model.loss``."""


@dataclass
class ChunkLabels:
    """The labels of one chunk of C slots: token ids (the loss is toward their one-hot: the cross entropy for ``kl``)
    and/or the target's distribution, dense or sparse (the loss is toward it when no ids are given; the acceptance
    rates ``sum min(q, p)`` are taken from it when wanted).

    Attributes:
        ids: [C] token ids, or None.
        probs: [C, V] the target's distribution, or None.
        sparse: ([C, k] ids, [C, k] probabilities summing to 1), the target's top-k renormalised, or None.
        want_accept: return the slots' acceptance rates (the objective's ``alpha_k`` metrics and a block refiner's
            loss terms read them): over the whole vocabulary with ``probs``, the overlap over the stored ids with
            ``sparse``, ``q`` at the id with token ids alone.
    """

    ids: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    sparse: tuple[torch.Tensor, torch.Tensor] | None = None
    want_accept: bool = False


def slot_rows(spec: DistributionLoss = KL) -> RowLoss:
    """DFlash's per-slot loss on the chunked-loss engine: ``spec`` (trainer/losses/distribution.py) toward the token
    labels' one-hot, else toward the target's distribution (``kl``: :func:`~trainer.losses.chunked.cross_entropy_rows`,
    its gradient ``q - p`` in closed form; the others by autograd on the chunk), with the right-argmax flags [C] and
    the acceptance rates [C] against the target's distribution (empty unless wanted) as statistics. logits: [C, V]
    float32 (overwritten)."""
    rows = distribution_rows(spec)

    def slot_rows(logits: torch.Tensor, labels: ChunkLabels, need_grad: bool) -> RowLosses:
        if labels.ids is not None:
            right = labels.ids  # [C]
        elif labels.probs is not None:
            right = labels.probs.max(-1).indices  # [C]
        else:
            right = labels.sparse[0][:, 0]  # [C] the stored top-1
        hits = logits.max(-1).indices == right  # [C], before the logits are overwritten
        target = Target(ids=labels.ids, probs=labels.probs, sparse=labels.sparse)
        # without the acceptance rates, kl is the cross entropy alone (rows' kl takes q at the id besides)
        out = (cross_entropy_rows if spec.is_kl and not labels.want_accept else rows)(logits, target, need_grad)
        accept = out.stats[0] if labels.want_accept else out.loss.new_zeros(0)  # [C] or [0]
        return RowLosses(out.loss, out.grad, (hits, accept))

    return slot_rows


def slot_loss(
    hidden: torch.Tensor,
    head: torch.Tensor,
    weights: Weights,
    labels: Labels,
    chunks: int | list[slice],
    bias_features: torch.Tensor | None = None,
    bias_weight: torch.Tensor | None = None,
    spec: DistributionLoss = KL,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted loss of n slots, ``sum_i weights_i * loss_i``, differentiable in ``hidden``, ``bias_features``
    and ``bias_weight`` (the module docstring), with its detached parts.

    Args:
        hidden: [n, H] the slots' normed outputs.
        head: [V, H] the frozen lm_head (no gradient).
        weights: [n] each slot's weight in the sum, or ``weights(part, losses)``: the weights [C] of the slots
            ``part`` from their losses [C] (no gradient flows through them), called once per chunk.
        labels: ``labels(part)`` gives the :class:`ChunkLabels` of the slots ``part`` (a slice of 0..n-1), built per
            chunk so that only one chunk's dense labels exist at a time.
        chunks: slots per chunk, or the chunks themselves (consecutive slices covering 0..n-1; whole blocks each
            when the weights depend on a block's losses, :func:`block_chunks`).
        bias_features: [n, r] the features of each slot's low-rank logit bias, or None (no bias).
        bias_weight: [V, r] the bias's map onto the vocabulary (with ``bias_features``).
        spec: each slot's loss (``model.loss``; :func:`slot_rows`).

    Returns:
        the weighted sum [] float32, the slots' losses [n], their right-argmax flags [n] and their acceptance rates
        [n] (empty unless the labels want them).
    """
    terms = [Term(hidden, head.detach())]
    if bias_features is not None:
        terms.append(Term(bias_features.to(bias_weight.dtype), bias_weight))  # projected in the bias weight's dtype
    out = chunked_loss(terms, slot_rows(spec), labels, weights, chunks=chunks, dtype=torch.float32)
    if not out.stats:  # no slot
        empty = out.losses.new_zeros(0)
        return out.total, out.losses, empty.bool(), empty
    hits, accept = out.stats
    return out.total, out.losses, hits, accept


def block_chunks(block: torch.Tensor, chunk_size: int) -> list[slice]:
    """Consecutive chunks of about ``chunk_size`` slots that never split a block: block: [n] the block of each slot,
    non-decreasing. A chunk ends at the first block boundary at or after ``chunk_size`` slots (a block longer than
    that is one chunk)."""
    n = block.shape[0]
    starts = torch.ones(n, dtype=torch.bool, device=block.device)  # [n]: slot i starts a block
    starts[1:] = block[1:] != block[:-1]
    boundaries = starts.nonzero()[:, 0].tolist() + [n]  # block starts, then the end
    chunks, begin = [], 0
    for edge in boundaries[1:]:
        if edge - begin >= chunk_size or edge == n:
            chunks.append(slice(begin, edge))
            begin = edge
    return chunks


def dpace_weights(probability: torch.Tensor, present: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's weights of drafts verified in order (speculators' ``dpace``, its default for DFlash).

    A block's drafts are accepted up to the first wrong one, so its expected accepted length is ``sum_j prod_{i <= j}
    c_i``, with ``c_i`` the chance draft i is right; its derivative with respect to draft k's log-confidence, ``sum_{j
    >= k} prod_{i <= j} c_i``, is how much draft k's loss is worth: little while an earlier draft is usually wrong,
    more as the earlier ones get right. D-PACE weights each draft's cross entropy by it, with the drafter's own
    probability of the label smoothed as ``c = (1 - alpha) * p + alpha``.

    probability: [..., K] the drafter's probability of each draft's label, in order; present: [..., K] bool, False
    where a draft is not trained (it counts as certain and weighs nothing) -> [..., K] float32 weights, 0 where not
    present; no gradient.
    """
    with torch.no_grad():
        on = present.float()
        conf = torch.where(present, (1 - alpha) * probability.float() + alpha, torch.ones_like(on))  # [..., K]
        reach = conf.cumprod(-1) * on  # [..., K]: drafts 0..j all accepted, at trained j
        return reach.flip(-1).cumsum(-1).flip(-1) * on  # [..., K]: sum over j >= k


def block_dpace_weights(losses: torch.Tensor, block: torch.Tensor, slot: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's slot weights (:func:`dpace_weights`) of a chunk of whole blocks: slot k of a block weighted by
    ``sum_{j >= k} prod_{i <= j} c_i`` over the block's trained slots, ``c = (1 - alpha) * exp(-loss) + alpha``.

    losses: [C] the slots' token cross entropies; block, slot: [C] each slot's block (non-decreasing, whole blocks
    only) and index in its block (0 = the first draft) -> [C] weights, no gradient.
    """
    with torch.no_grad():
        row = block - block[0]  # [C]
        nb, width = int(row[-1]) + 1, int(slot.max()) + 1
        probability = torch.ones(nb, width, dtype=torch.float32, device=losses.device)  # [nb, w]
        probability[row, slot] = torch.exp(-losses.float())
        present = torch.zeros(nb, width, dtype=torch.bool, device=losses.device)  # [nb, w]
        present[row, slot] = True
        return dpace_weights(probability, present, alpha)[row, slot]  # [C]
