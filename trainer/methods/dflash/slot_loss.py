"""DFlash's slot loss with its gradients taken in forward, one chunk of slots at a time.

A slot's logits are ``h @ head.T`` (the target's frozen lm_head, bare, as the proposer computes them), plus with a
block refiner's low-rank logit bias (refiner.py ``LogitBias``) ``e @ w2.T`` of the slot's features ``e``: both linear
in the trained inputs, so the gradient of the loss with respect to the logits, ``G = w * (q - p)`` (q the drafter's
distribution, p the label's: one-hot for token labels, the target's distribution for soft ones, w the slot's weight),
gives every gradient at once: ``G @ head`` for ``h``, ``G @ w2`` for ``e`` and ``G.T @ e`` for ``w2``. Only one
chunk's [C, V] logits exist at a time, and none is recomputed in backward: a checkpointed chunk costs three
vocabulary projections (forward, its recomputation, the backward's), this one two.

Weights may depend on the losses (D-PACE, :func:`block_dpace_weights`): given as a function of a chunk's slots and their
losses, they are taken per chunk before its gradients, which is exact when the chunks hold whole blocks
(:func:`block_chunks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Labels = Callable[[slice], "ChunkLabels"]
# the slots' weights [n], or a function of a chunk's slots and their losses [C] giving their weights [C]
Weights = torch.Tensor | Callable[[slice, torch.Tensor], torch.Tensor]


@dataclass
class ChunkLabels:
    """The labels of one chunk of C slots: token ids (the loss is their cross entropy) and/or the target's
    distribution, dense or sparse (the loss is KL(p || q) when no ids are given; the acceptance rates
    ``sum min(q, p)`` are taken from it when wanted).

    Attributes:
        ids: [C] token ids, or None.
        probs: [C, V] the target's distribution, or None.
        sparse: ([C, k] ids, [C, k] probabilities summing to 1), the target's top-k renormalised, or None.
        want_accept: compute the slots' acceptance rates (a block refiner's loss terms read them): over the whole
            vocabulary with ``probs``, the overlap over the stored ids with ``sparse``.
    """

    ids: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    sparse: tuple[torch.Tensor, torch.Tensor] | None = None
    want_accept: bool = False


def _chunk_terms(logits: torch.Tensor, labels: ChunkLabels) -> tuple[torch.Tensor, ...]:
    """Losses [C], the gradient of each loss with respect to the logits [C, V], right-argmax flags [C] and the
    acceptance rates [C] (empty unless wanted) of float32 logits [C, V]."""
    log_q = torch.log_softmax(logits, dim=-1)  # [C, V]
    grad = log_q.exp()  # [C, V]: q, turned into q - p below
    guess = logits.max(-1).indices  # [C]
    accept = logits.new_zeros(0)
    if labels.want_accept:
        if labels.sparse is not None:
            ids, p = labels.sparse
            accept = torch.minimum(grad.gather(-1, ids), p).sum(-1)  # [C]: the overlap over the stored ids
        else:
            accept = torch.minimum(grad, labels.probs).sum(-1)  # [C]: 1 - TV(q, p)
    if labels.ids is not None:
        ids = labels.ids[:, None]  # [C, 1]
        loss = -log_q.gather(-1, ids)[:, 0]
        grad.scatter_add_(-1, ids, torch.full_like(ids, -1.0, dtype=grad.dtype))
        return loss, grad, guess == labels.ids, accept
    if labels.probs is not None:
        p = labels.probs  # [C, V]
        loss = (torch.xlogy(p, p) - p * log_q).sum(-1)
        return loss, grad.sub_(p), guess == p.max(-1).indices, accept
    ids, p = labels.sparse  # [C, k] each
    loss = (torch.xlogy(p, p) - p * log_q.gather(-1, ids)).sum(-1)
    return loss, grad.scatter_add_(-1, ids, -p.to(grad.dtype)), guess == ids[:, 0], accept


class _SlotLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, bias_features, bias_weight, head, weights: Weights, labels: Labels, chunks: list[slice]):
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [n, H]
        grad_emb = grad_w2 = None
        if bias_features is not None:
            grad_emb = torch.zeros(bias_features.shape, dtype=torch.float32, device=hidden.device)  # [n, r]
            grad_w2 = torch.zeros(bias_weight.shape, dtype=torch.float32, device=hidden.device)  # [V, r]
        head_t = head.to(hidden.dtype)  # [V, H]
        losses, hits, accepts = [], [], []
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for part in chunks:
            logits = (hidden[part] @ head_t.t()).float()  # [C, V]
            if bias_features is not None:
                emb = bias_features[part].to(bias_weight.dtype)  # [C, r]
                logits = logits + (emb @ bias_weight.t()).float()
            loss, grad, hit, accept = _chunk_terms(logits, labels(part))
            w = (weights(part, loss) if callable(weights) else weights[part]).detach().float()  # [C]
            total = total + (loss * w).sum()
            grad.mul_(w[:, None])  # [C, V]: d total / d logits
            grad_hidden[part] = grad.to(hidden.dtype) @ head_t  # [C, H]
            if bias_features is not None:
                grad_emb[part] = grad @ bias_weight.float()  # [C, r]
                grad_w2.addmm_(grad.t(), emb.float())  # [V, r]
            losses.append(loss)
            hits.append(hit)
            accepts.append(accept)
        ctx.save_for_backward(grad_hidden, grad_emb, grad_w2)
        ctx.dtypes = (hidden.dtype, None if bias_features is None else (bias_features.dtype, bias_weight.dtype))
        loss, hit, accept = torch.cat(losses), torch.cat(hits), torch.cat(accepts)
        ctx.mark_non_differentiable(loss, hit, accept)
        return total, loss, hit, accept

    @staticmethod
    def backward(ctx, grad_total, *_unused):
        grad_hidden, grad_emb, grad_w2 = ctx.saved_tensors
        hidden_dtype, bias_dtypes = ctx.dtypes
        g_hidden = (grad_hidden * grad_total).to(hidden_dtype)
        if bias_dtypes is None:
            return g_hidden, None, None, None, None, None, None
        g_emb = (grad_emb * grad_total).to(bias_dtypes[0])
        g_w2 = (grad_w2 * grad_total).to(bias_dtypes[1])
        return g_hidden, g_emb, g_w2, None, None, None, None


def slot_loss(
    hidden: torch.Tensor,
    head: torch.Tensor,
    weights: Weights,
    labels: Labels,
    chunks: int | list[slice],
    bias_features: torch.Tensor | None = None,
    bias_weight: torch.Tensor | None = None,
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

    Returns:
        the weighted sum [] float32, the slots' losses [n], their right-argmax flags [n] and their acceptance rates
        [n] (empty unless the labels want them).
    """
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return hidden.sum().float() * 0.0, empty, empty.bool(), empty
    n = hidden.shape[0]
    parts = [slice(s, min(s + chunks, n)) for s in range(0, n, chunks)] if isinstance(chunks, int) else chunks
    weights = weights if callable(weights) else weights.detach()
    return _SlotLoss.apply(hidden, bias_features, bias_weight, head.detach(), weights, labels, parts)


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
