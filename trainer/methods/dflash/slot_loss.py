"""DFlash's slot loss with its gradients taken in forward, one chunk of slots at a time.

A slot's logits are ``h @ head.T`` (the target's frozen lm_head, bare, as the proposer computes them), plus with
DSpark's Markov head the bias ``e @ w2.T`` of the previous token's Markov embedding ``e`` (heads.py): both linear in
the trained inputs, so the gradient of the loss with respect to the logits, ``G = w * (q - p)`` (q the drafter's
distribution, p the label's: one-hot for token labels, the target's distribution for soft ones, w the slot's weight),
gives every gradient at once: ``G @ head`` for ``h``, ``G @ w2`` for ``e`` and ``G.T @ e`` for ``w2``. Only one
chunk's [C, V] logits exist at a time, and none is recomputed in backward: a checkpointed chunk costs three
vocabulary projections (forward, its recomputation, the backward's), this one two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Labels = Callable[[slice], "ChunkLabels"]


@dataclass
class ChunkLabels:
    """The labels of one chunk of C slots: token ids (the loss is their cross entropy) and/or the target's
    distribution, dense or sparse (the loss is KL(p || q) when no ids are given; the acceptance rates
    ``sum min(q, p)`` are taken from it when wanted).

    Attributes:
        ids: [C] token ids, or None.
        probs: [C, V] the target's distribution, or None.
        sparse: ([C, k] ids, [C, k] probabilities summing to 1), the target's top-k renormalised, or None.
        want_accept: compute the slots' acceptance rates (DSpark's confidence head): over the whole vocabulary with
            ``probs``, the overlap over the stored ids with ``sparse``.
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
    def forward(ctx, hidden, markov_emb, markov_w2, head, weights, labels: Labels, chunk: int):
        n = hidden.shape[0]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [n, H]
        grad_emb = grad_w2 = None
        if markov_emb is not None:
            grad_emb = torch.zeros(markov_emb.shape, dtype=torch.float32, device=hidden.device)  # [n, r]
            grad_w2 = torch.zeros(markov_w2.shape, dtype=torch.float32, device=hidden.device)  # [V, r]
        head_t = head.to(hidden.dtype)  # [V, H]
        losses, hits, accepts = [], [], []
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            logits = (hidden[part] @ head_t.t()).float()  # [C, V]
            if markov_emb is not None:
                emb = markov_emb[part].to(markov_w2.dtype)  # [C, r]
                logits = logits + (emb @ markov_w2.t()).float()
            loss, grad, hit, accept = _chunk_terms(logits, labels(part))
            w = weights[part].float()  # [C]
            total = total + (loss * w).sum()
            grad.mul_(w[:, None])  # [C, V]: d total / d logits
            grad_hidden[part] = grad.to(hidden.dtype) @ head_t  # [C, H]
            if markov_emb is not None:
                grad_emb[part] = grad @ markov_w2.float()  # [C, r]
                grad_w2.addmm_(grad.t(), emb.float())  # [V, r]
            losses.append(loss)
            hits.append(hit)
            accepts.append(accept)
        ctx.save_for_backward(grad_hidden, grad_emb, grad_w2)
        ctx.dtypes = (hidden.dtype, None if markov_emb is None else (markov_emb.dtype, markov_w2.dtype))
        loss, hit, accept = torch.cat(losses), torch.cat(hits), torch.cat(accepts)
        ctx.mark_non_differentiable(loss, hit, accept)
        return total, loss, hit, accept

    @staticmethod
    def backward(ctx, grad_total, *_unused):
        grad_hidden, grad_emb, grad_w2 = ctx.saved_tensors
        hidden_dtype, markov_dtypes = ctx.dtypes
        g_hidden = (grad_hidden * grad_total).to(hidden_dtype)
        if markov_dtypes is None:
            return g_hidden, None, None, None, None, None, None
        g_emb = (grad_emb * grad_total).to(markov_dtypes[0])
        g_w2 = (grad_w2 * grad_total).to(markov_dtypes[1])
        return g_hidden, g_emb, g_w2, None, None, None, None


def slot_loss(
    hidden: torch.Tensor,
    head: torch.Tensor,
    weights: torch.Tensor,
    labels: Labels,
    chunk_size: int,
    markov_emb: torch.Tensor | None = None,
    markov_w2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted loss of n slots, ``sum_i weights_i * loss_i``, differentiable in ``hidden``, ``markov_emb`` and
    ``markov_w2`` (the module docstring), with its detached parts.

    Args:
        hidden: [n, H] the slots' normed outputs.
        head: [V, H] the frozen lm_head (no gradient).
        weights: [n] each slot's weight in the sum.
        labels: ``labels(part)`` gives the :class:`ChunkLabels` of the slots ``part`` (a slice of 0..n-1), built per
            chunk so that only one chunk's dense labels exist at a time.
        chunk_size: slots per chunk.
        markov_emb: [n, r] the Markov embedding of each slot's previous token, or None (no Markov head).
        markov_w2: [V, r] the Markov head's output map (with ``markov_emb``).

    Returns:
        the weighted sum [] float32, the slots' losses [n], their right-argmax flags [n] and their acceptance rates
        [n] (empty unless the labels want them).
    """
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return hidden.sum().float() * 0.0, empty, empty.bool(), empty
    return _SlotLoss.apply(hidden, markov_emb, markov_w2, head.detach(), weights.detach(), labels, chunk_size)
