"""The chunked-loss engine: project rows onto the vocabulary a chunk at a time and take a per-row loss and its gradient
in forward, so that no full ``[n, V]`` logits exist, in forward or backward.

Every full-vocabulary loss of the project runs through :func:`chunked_loss` (or :func:`chunked_loss_with_grads`): KD's
divergences and the next-token cross entropy (trainer/losses/distillation.py), the heads of parallel multi-token
prediction (through :func:`trainer.losses.distillation.cross_entropy_with_grads`) and DFlash's slot loss
(trainer/methods/dflash/slot_loss.py).

What a call computes. The logits of row ``i`` are the sum of linear terms (:class:`Term`), ``sum_t rows_t[i] @
weight_t.T`` (a term without a weight is the logits themselves), widened to the compute dtype and scaled by the model's
output scaling (:class:`~trainer.models.logit_scaling.LogitScaling`). The rows scored are ``index`` (or all of them, in
order), processed in chunks of consecutive selected rows. For each chunk the engine asks ``targets(part)`` for what
the chunk is scored against (``part``: the chunk's slice of the selection, so that dense targets are built one chunk
at a time) and the loss function for the rows' losses and their gradients (:data:`RowLoss`); the weights (a tensor,
a function of the chunk's losses, e.g. D-PACE's, or None: each row 1) give ``total = sum_i weights_i * loss_i``. The
gradient of ``total`` with respect to the chunk's logits, ``weights_i * d loss_i / d logits_i`` through the scaling, is
folded at once into the gradients of every term's rows (``G @ weight``) and weights (``G.T @ rows``); backward only
scales these stored gradients, so nothing is recomputed and one chunk's ``[C, V]`` intermediates are alive at a time.

The loss function. ``loss(logits, target, need_grad) -> RowLosses``: ``logits`` ``[C, V]`` in the compute dtype (a
fresh tensor the function may overwrite), ``target`` whatever ``targets(part)`` returned (token ids, a distribution,
top-k ids and probabilities: :class:`Target` is the common form), ``need_grad`` whether the gradient is wanted. It
returns the per-row losses ``[C]``, their gradients ``d loss_i / d logits_i`` ``[C, V]`` (unweighted: the engine
applies the weights) when wanted, and any per-row statistics (``[C]`` each: accuracy flags, acceptance rates, a loss's
parts), concatenated over the chunks. The gradient may be closed-form (:func:`cross_entropy_rows`) or taken by
autograd on the chunk (:func:`autograd_rows` wraps a plain differentiable function of the logits). Row i's loss may
depend only on row i's logits. A chunk holds whole rows, so a per-row reduction over the whole vocabulary (a
logsumexp, ``sum_v |q_v - p_v|``, ``sum_v min(q_v, p_v)``, a target's mass outside a reduced draft vocabulary) is an
ordinary reduction inside the loss function, without a second pass; weights that depend on several rows' losses
(D-PACE's, per block) are exact when the chunks keep those rows together (explicit ``chunks``).

Dtypes. Each term is projected in its rows' dtype (the weight is cast to it once), then widened to the compute dtype
(default ``promote(rows dtype, float32)``: float32 for half-precision inputs, float64 for float64 ones). The rows'
gradients are in the rows' dtype; the weights' are summed over the chunks in the compute dtype, then cast to the
weight's dtype (:func:`chunked_loss`). Under DeepSpeed ZeRO-3 the caller must gather a sharded weight first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.models.logit_scaling import LogitScaling


@dataclass(frozen=True)
class Term:
    """One linear term of the logits: ``rows @ weight.T``, or the rows themselves (already logits) without a weight.

    Attributes:
        rows: ``[N, D]`` (``[N, V]`` without a weight); differentiable when it requires grad.
        weight: ``[V, D]`` (no bias: output heads of causal LMs have none), or None; differentiable when it requires
            grad.
    """

    rows: torch.Tensor
    weight: torch.Tensor | None = None


@dataclass
class RowLosses:
    """What a loss function returns for a chunk of C rows.

    Attributes:
        loss: ``[C]`` each row's loss.
        grad: ``[C, V]`` ``d loss_i / d logits_i`` (with respect to the scaled logits, unweighted), or None when the
            gradient was not wanted.
        stats: per-row statistics, ``[C]`` each (or ``[0]`` when not computed), concatenated over the chunks.
    """

    loss: torch.Tensor
    grad: torch.Tensor | None = None
    stats: tuple[torch.Tensor, ...] = ()


RowLoss = Callable[[torch.Tensor, Any, bool], RowLosses]
"""``(logits [C, V], target, need_grad) -> RowLosses``: a per-method loss (the module docstring)."""

Weights = torch.Tensor | Callable[[slice, torch.Tensor], torch.Tensor]
"""The rows' weights ``[n]`` in the total (selection order), or ``weights(part, losses)``: the weights ``[C]`` of the
chunk ``part`` from its rows' losses ``[C]``. No gradient flows through the weights."""


@dataclass
class ChunkedLoss:
    """The result of :func:`chunked_loss`.

    Attributes:
        total: ``[]`` ``sum_i weights_i * loss_i`` in the compute dtype; differentiable in the terms' tensors.
        losses: ``[n]`` the rows' losses, detached, in selection order.
        stats: the loss function's per-row statistics, ``[n]`` each (``[0]`` where not computed), detached.
    """

    total: torch.Tensor
    losses: torch.Tensor
    stats: tuple[torch.Tensor, ...]


@dataclass
class Target:
    """The common form of what a chunk of C rows is scored against (:func:`cross_entropy_rows`).

    Attributes:
        ids: ``[C]`` token ids (the loss is their cross entropy), or None.
        probs: ``[C, V]`` a distribution per row (the loss is ``KL(p || q)`` when no ids are given), or None.
        log_probs: ``[C, V]`` the same distribution as log-probabilities (in place of ``probs``), or None.
        sparse: ``([C, k] ids, [C, k] probabilities summing to 1)``, a top-k distribution, or None.
        acceptance: also the rows' acceptance rates ``sum_v min(q_v, p_v)``: over the whole vocabulary with a dense
            distribution, over the stored ids with ``sparse``.
    """

    ids: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    sparse: tuple[torch.Tensor, torch.Tensor] | None = None
    acceptance: bool = False


# ---------------------------------------------------------------------------------------------------------------------
# Per-row losses.


def kl_from_log_probs(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``KL(a || b) = sum_v a_v (log a_v - log b_v)`` over the last dim; terms with ``a_v == 0`` count 0.

    log_a, log_b: [..., V] log-probabilities. Returns [...].
    """
    # Clamping -inf to the lowest finite float makes 0 * (-inf) terms 0 (and their gradients finite) with fewer
    # [..., V] temporaries than a torch.where; a term with a_v > 0 and b_v == 0 still comes out (near) infinite.
    lowest = torch.finfo(log_a.dtype).min
    return (log_a.exp() * (log_a.clamp(min=lowest) - log_b.clamp(min=lowest))).sum(-1)


def cross_entropy_rows(logits: torch.Tensor, target: Target, need_grad: bool) -> RowLosses:
    """Per row, the cross entropy of ``target.ids``, else the forward ``KL(p || q)`` from the target's distribution
    (dense, or top-k: then over its k ids), with the closed-form gradient ``q - p`` (``p`` one-hot for ids) computed in
    place of the logits; ``stats``: the acceptance rates ``[C]`` when ``target.acceptance`` (else none).

    logits: ``[C, V]`` (overwritten); target: :class:`Target`.
    """
    q = None  # [C, V] the drafter's distribution, once taken
    if target.ids is not None:
        # the softmax taken in place of the logits: no [C, V] temporary (torch.logsumexp allocates one)
        top = logits.amax(dim=-1, keepdim=True)  # [C, 1]
        picked = logits.gather(-1, target.ids[:, None])[:, 0]  # [C]
        q = logits.sub_(top).exp_()  # [C, V] unnormalised
        total = q.sum(dim=-1, keepdim=True)  # [C, 1]
        loss = total[:, 0].log() + top[:, 0] - picked  # [C] logsumexp - the label's logit
        if need_grad or target.acceptance:
            q.div_(total)
        log_q = None
    elif target.log_probs is not None:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [C, 1]
        loss = kl_from_log_probs(target.log_probs, logits - lse)  # [C]
        log_q = None
    elif target.probs is not None or target.sparse is not None:
        log_q = torch.log_softmax(logits, dim=-1)  # [C, V]
        ids, p = (None, target.probs) if target.probs is not None else target.sparse  # p: [C, V] or [C, k]
        loss = (torch.xlogy(p, p) - p * (log_q if ids is None else log_q.gather(-1, ids))).sum(-1)  # [C]
    else:
        raise ValueError("a Target needs ids, probs, log_probs or sparse")
    if not (need_grad or target.acceptance):
        return RowLosses(loss)
    if q is None:
        q = logits.sub_(lse).exp_() if log_q is None else log_q.exp_()  # [C, V] the drafter's distribution, in place
    stats = ()
    if target.acceptance:
        if target.sparse is not None:
            ids, p = target.sparse
            stats = (torch.minimum(q.gather(-1, ids), p.to(q.dtype)).sum(-1),)  # [C] the overlap over the stored ids
        elif target.probs is not None or target.log_probs is not None:
            p = target.probs if target.probs is not None else target.log_probs.exp()  # [C, V]
            stats = (torch.minimum(q, p.to(q.dtype)).sum(-1),)  # [C] 1 - TV(q, p)
        else:
            raise ValueError("Target.acceptance needs the target's distribution (probs, log_probs or sparse)")
    if not need_grad:
        return RowLosses(loss, None, stats)
    if target.ids is not None:
        q[torch.arange(q.shape[0], device=q.device), target.ids] -= 1.0
    elif target.log_probs is not None:
        q.sub_(target.log_probs.exp())
    elif target.probs is not None:
        q.sub_(target.probs)
    else:
        ids, p = target.sparse
        q.scatter_add_(-1, ids, -p.to(q.dtype))
    return RowLosses(loss, q, stats)


def autograd_rows(
    fn: Callable[[torch.Tensor, Any], tuple[torch.Tensor, tuple[torch.Tensor, ...]]],
) -> RowLoss:
    """A :data:`RowLoss` from a plain differentiable function ``fn(logits [C, V], target) -> (losses [C], stats)``:
    the gradient of the losses with respect to the chunk's logits is taken by autograd on the chunk alone."""

    def rows(logits: torch.Tensor, target: Any, need_grad: bool) -> RowLosses:
        if not need_grad:
            with torch.no_grad():
                loss, stats = fn(logits, target)
            return RowLosses(loss, None, stats)
        leaf = logits.detach().requires_grad_()  # [C, V]
        with torch.enable_grad():
            loss, stats = fn(leaf, target)
            grad = torch.autograd.grad(loss.sum(), leaf)[0] if loss.requires_grad else torch.zeros_like(leaf)
        return RowLosses(loss.detach(), grad, tuple(s.detach() for s in stats))

    return rows


# ---------------------------------------------------------------------------------------------------------------------
# The engine.


@dataclass
class _Plan:
    """Everything of one call but the differentiable tensors."""

    loss: RowLoss
    targets: Callable[[slice], Any]
    weights: Weights | None  # None: every row weighs 1
    index: torch.Tensor | None  # [n] the rows scored, or None: all of them in order
    parts: list[slice]  # consecutive chunks of the selection
    scaling: LogitScaling | None  # None: none, or the identity
    dtype: torch.dtype  # the compute dtype
    grad_scale: float = 1.0


def _parts(n: int, chunks: int | list[slice] | None) -> list[slice]:
    if chunks is None:
        return [slice(0, n)] if n else []
    if isinstance(chunks, list):
        return chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} must be a positive int, a list of slices or None")
    return [slice(s, min(s + chunks, n)) for s in range(0, n, chunks)]


def _plan(
    terms: Sequence[Term],
    loss: RowLoss,
    targets: Callable[[slice], Any],
    weights: Weights | None,
    index: torch.Tensor | None,
    chunks: int | list[slice] | None,
    scaling: LogitScaling | None,
    dtype: torch.dtype | None,
    grad_scale: float = 1.0,
) -> _Plan:
    if not terms:
        raise ValueError("chunked_loss needs at least one term")
    rows = terms[0].rows
    vocab = set()
    for t in terms:
        if t.rows.dim() != 2 or t.rows.shape[0] != rows.shape[0]:
            raise ValueError(f"every term's rows must be [N={rows.shape[0]}, D], got {tuple(t.rows.shape)}")
        if t.weight is not None and (t.weight.dim() != 2 or t.weight.shape[1] != t.rows.shape[1]):
            raise ValueError(f"a term's weight must be [V, {t.rows.shape[1]}], got {tuple(t.weight.shape)}")
        vocab.add(t.rows.shape[1] if t.weight is None else t.weight.shape[0])
    if len(vocab) != 1:
        raise ValueError(f"the terms give logits of different vocabulary sizes {sorted(vocab)}")
    n = rows.shape[0] if index is None else index.numel()
    weights = weights if weights is None or callable(weights) else weights.detach()
    active = None if scaling is None or scaling.is_identity else scaling
    compute = dtype or torch.promote_types(rows.dtype, torch.float32)
    return _Plan(loss, targets, weights, index, _parts(n, chunks), active, compute, grad_scale)


def grad_times_weight(g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The input gradient g [C, V] @ weight [V, D], in the weight's dtype: [C, D]. On CPU a reduced-precision g is laid
    out column-major first: PyTorch's CPU bf16 GEMM on a machine without bf16 instructions takes a scalar path for a
    row-major [C, V] @ [V, D] (55 s against 0.9 s for C = 128, V = 8,192, D = 4,096 on one thread)."""
    g = g.to(weight.dtype)  # [C, V]
    if g.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
        g = g.t().contiguous().t()
    return g @ weight  # [C, D]


def _run(
    plan: _Plan,
    tensors: Sequence[torch.Tensor | None],
    needs: Sequence[bool],
    weight_grads_out: Sequence[torch.Tensor | None] = (),
) -> tuple[ChunkedLoss, list[torch.Tensor | None]]:
    """The loss and, where ``needs`` says, the gradients of ``grad_scale * total`` with respect to ``tensors``
    (``rows_0, weight_0, rows_1, weight_1, ...``): rows' in their dtype, weights' in the compute dtype (added to
    ``weight_grads_out[t]`` where given)."""
    rows = [tensors[2 * k].detach() for k in range(len(tensors) // 2)]
    weights = [None if w is None else w.detach() for w in tensors[1::2]]
    projections = [None if w is None else w.to(r.dtype) for r, w in zip(rows, weights)]  # [V, D] each
    need_grad = any(needs)
    grads: list[torch.Tensor | None] = [None] * len(tensors)
    for k, (r, w) in enumerate(zip(rows, weights)):
        if needs[2 * k]:
            grads[2 * k] = torch.zeros_like(r)  # [N, D]
        if w is not None and needs[2 * k + 1]:
            out = weight_grads_out[k] if k < len(weight_grads_out) else None
            if out is not None and (out.shape != w.shape or out.dtype != plan.dtype):
                raise ValueError(f"a weight's gradient buffer must be {tuple(w.shape)} {plan.dtype}, got "
                                 f"{tuple(out.shape)} {out.dtype}")  # fmt: skip
            grads[2 * k + 1] = out if out is not None else torch.zeros(w.shape, dtype=plan.dtype, device=w.device)
    scaling = plan.scaling
    total = torch.zeros((), dtype=plan.dtype, device=rows[0].device)
    losses, stats = [], []
    for part in plan.parts:
        ids = None if plan.index is None else plan.index[part]  # [C]
        chunk_rows = [r[part] if ids is None else r.index_select(0, ids) for r in rows]  # [C, D] each
        logits = None
        for r, proj in zip(chunk_rows, projections):
            term = (r @ proj.t()).to(plan.dtype) if proj is not None else r.to(plan.dtype, copy=ids is None)  # [C, V]
            logits = term if logits is None else logits.add_(term)
        deriv = None  # [C, V] the soft-cap's 1 - tanh^2
        if scaling is not None:
            logits = scaling(logits)  # [C, V] the model's own logits
            if need_grad and scaling.softcap is not None:
                deriv = 1.0 - (logits / scaling.softcap).square()
        out = plan.loss(logits, plan.targets(part), need_grad)
        del logits
        loss = out.loss.detach()  # [C]
        if plan.weights is None:
            w = None
            total += loss.sum().to(plan.dtype)
        else:
            w = plan.weights(part, loss) if callable(plan.weights) else plan.weights[part]  # [C]
            w = w.detach().to(loss.dtype)
            total += (loss * w).sum().to(plan.dtype)
        losses.append(loss)
        stats.append(out.stats)
        if not need_grad:
            continue
        g = out.grad  # [C, V] d loss_i / d logits_i
        factor = plan.grad_scale * (scaling.multiplier if scaling is not None else 1.0)
        if w is not None:  # d (grad_scale * total) / d logits
            g.mul_((w if factor == 1.0 else w * factor)[:, None].to(g.dtype))
        elif factor != 1.0:
            g.mul_(factor)
        if deriv is not None:
            g.mul_(deriv)  # [C, V] with respect to the raw logits
        del deriv
        for k, (r, proj) in enumerate(zip(chunk_rows, projections)):
            g_rows, g_weight = grads[2 * k], grads[2 * k + 1]
            if g_rows is not None:
                piece = (grad_times_weight(g, proj) if proj is not None else g).to(g_rows.dtype)  # [C, D]
                if ids is None:
                    g_rows[part] = piece
                else:
                    g_rows.index_copy_(0, ids, piece)
            if g_weight is not None:
                g_weight.addmm_(g.t(), r.to(plan.dtype))  # [V, D] += [V, C] @ [C, D]
        del g
    if losses:
        stat_tensors = tuple(torch.cat(column) for column in zip(*stats))
        result = ChunkedLoss(total, torch.cat(losses), stat_tensors)
    else:
        result = ChunkedLoss(total, total.new_zeros(0), ())
    return result, grads


class _ChunkedLossFunction(torch.autograd.Function):
    """Forward computes the loss and the inputs' gradients chunk by chunk; backward scales the stored gradients."""

    @staticmethod
    def forward(ctx, plan: _Plan, *tensors):
        result, grads = _run(plan, tensors, ctx.needs_input_grad[1:])
        ctx.grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, tensors)]
        ctx.mark_non_differentiable(result.losses, *result.stats)
        return result.total, result.losses, *result.stats

    @staticmethod
    def backward(ctx, grad_total, *_unused):
        # scaled in place and handed over (no copy: the optimizer's gradients may take these very tensors)
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("chunked_loss's gradients were handed over already: its backward runs once")
        return None, *(None if g is None else g.mul_(grad_total.to(g.dtype)) for g in grads)


def chunked_loss(
    terms: Sequence[Term],
    loss: RowLoss,
    targets: Callable[[slice], Any],
    weights: Weights | None,
    *,
    index: torch.Tensor | None = None,
    chunks: int | list[slice] | None = 256,
    scaling: LogitScaling | None = None,
    dtype: torch.dtype | None = None,
) -> ChunkedLoss:
    """The weighted loss ``sum_i weights_i * loss_i`` of the selected rows, their logits projected and scored one
    chunk at a time (the module docstring); differentiable in every term's rows and weight that requires grad (the
    gradients are taken in forward when grad mode is on, and only then).

    Args:
        terms: the linear terms summed into the logits (:class:`Term`).
        loss: the per-row loss (:data:`RowLoss`).
        targets: ``targets(part)``: what the chunk ``part`` (a slice of the selection) is scored against, passed to
            ``loss``.
        weights: the rows' weights (:data:`Weights`), or None: every row weighs 1 (a loss function that weighs its
            rows itself).
        index: ``[n]`` int64, the rows of the terms that are scored, in order; None: all of them.
        chunks: rows per chunk, or the chunks (consecutive slices covering ``0 .. n - 1``), or None: one chunk.
        scaling: the output scaling the model applies after its head (None: none).
        dtype: the compute dtype of the logits (None: the first term's rows' dtype promoted to at least float32).
    """
    plan = _plan(terms, loss, targets, weights, index, chunks, scaling, dtype)
    tensors = [x for t in terms for x in (t.rows, t.weight)]
    differentiable = any(x is not None and x.requires_grad for x in tensors)
    if torch.is_grad_enabled() and differentiable:
        total, losses, *stats = _ChunkedLossFunction.apply(plan, *tensors)
        return ChunkedLoss(total, losses, tuple(stats))
    return _run(plan, tensors, [False] * len(tensors))[0]


def chunked_loss_with_grads(
    terms: Sequence[Term],
    loss: RowLoss,
    targets: Callable[[slice], Any],
    weights: Weights,
    needs: Sequence[tuple[bool, bool]],
    *,
    index: torch.Tensor | None = None,
    chunks: int | list[slice] | None = 256,
    scaling: LogitScaling | None = None,
    dtype: torch.dtype | None = None,
    grad_scale: float = 1.0,
    weight_grads_out: Sequence[torch.Tensor | None] = (),
) -> tuple[ChunkedLoss, list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """:func:`chunked_loss` without autograd: the loss, detached, and the gradients of ``grad_scale * total`` with
    respect to each term's rows and weight, for a caller that runs its own backward (the sequential heads of parallel
    multi-token prediction run one head's backward at a time).

    Args:
        terms, loss, targets, weights, index, chunks, scaling, dtype: as :func:`chunked_loss`.
        needs: per term, whether the gradients of its rows and of its weight are wanted.
        grad_scale: the gradients are those of ``grad_scale * total``.
        weight_grads_out: per term, a ``[V, D]`` tensor of the compute dtype the weight's gradient is added to (and
            returned), or None for a new one.

    Returns:
        the loss and, per term, ``(gradient of the rows [N, D] in their dtype, gradient of the weight [V, D] in the
        compute dtype)``, None where not wanted.
    """
    if len(needs) != len(terms):
        raise ValueError(f"needs has {len(needs)} entries for {len(terms)} terms")
    plan = _plan(terms, loss, targets, weights, index, chunks, scaling, dtype, grad_scale)
    tensors = [x for t in terms for x in (t.rows, t.weight)]
    flags = []
    for (need_rows, need_weight), term in zip(needs, terms):
        flags += [bool(need_rows), bool(need_weight) and term.weight is not None]
    result, grads = _run(plan, tensors, flags, weight_grads_out)
    return result, [(grads[2 * k], grads[2 * k + 1]) for k in range(len(terms))]
