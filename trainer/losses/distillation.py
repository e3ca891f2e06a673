"""Distillation and next-token losses: pure tensor functions, chunked over positions to bound memory.

Notation: ``p`` is the teacher's distribution, ``q`` the student's, both at temperature ``T`` (``softmax(logits / T)``).

The losses toward the teacher (``loss``, :data:`KD_LOSSES`: the project's one vocabulary, ``model.loss``), per
position, summed over the vocabulary:

- ``"kl"``: ``KL(p || q) = sum_v p_v (log p_v - log q_v)`` (the classic distillation loss).
- ``"reverse_kl"``: ``KL(q || p) = sum_v q_v (log q_v - log p_v)``.
- ``"jsd"``: the generalized Jensen-Shannon divergence exactly as TRL's ``GKDTrainer.generalized_jsd_loss`` (GKD,
  Agarwal et al. 2024, eq. 1): with the mixture ``m = beta * p + (1 - beta) * q`` (computed in log space,
  ``log m = logaddexp(log p + log(beta), log q + log(1 - beta))``), the loss is
  ``beta * KL(p || m) + (1 - beta) * KL(q || m)``. As TRL does, ``beta == 0`` is *defined* as the forward KL and
  ``beta == 1`` as the reverse KL (the mixture formula itself tends to 0 at both ends; near them it behaves like
  ``beta * KL(p || q)`` and ``(1 - beta) * KL(q || p)``, so the endpoints are a switch, not a limit).
  One difference from TRL: TRL applies the temperature but not the ``T^2`` factor; here each of these three is
  multiplied by ``T^2`` (Hinton et al.), so that gradient sizes do not depend on the temperature.
- ``"tv"``, ``"nla"``, ``"lk_hybrid"``: the LK losses of trainer/losses/distribution.py (total variation ``1 - alpha``,
  the negative log-acceptance ``-log alpha``, and ``lambda * KL + (1 - lambda) * TV`` with ``lambda = exp(-lk_eta *
  sg(alpha))``), on the same tempered distributions but *without* the ``T^2`` factor (they are bounded by 1, or by
  ``-log 1e-5`` for ``nla``, at any temperature; the hybrid's KL term is the plain KL at ``T``).

The expected acceptance ``alpha = sum_v min(p_v, q_v)`` (at the loss's temperature; against a top-k teacher, over
its k ids, a lower bound) is computed in the same chunked pass for every loss, detached, and returned as the weighted
mean over the KD positions (:attr:`LossParts.alpha`): the objectives log it as ``alpha_*``.

Reduction and the total loss. ``loss_mask`` (bool, or float weights >= 0) selects the positions; each term is a
weighted mean over them (``sum_i w_i l_i / sum_i w_i``, a plain mean for a bool mask), on this process's batch:

    KD   = T^2 * mean_i divergence_i                         (the LK losses: mean_i loss_i, no T^2)
    CE   = mean_i -log softmax(student_logits_i)[label_i]      (temperature 1; positions with label -100 left out)
    loss = (1 - alpha) * KD + alpha * CE                        (alpha = 0: pure distillation)

The KD functions return :class:`LossParts` (``loss``, and the detached ``kd`` and ``ce`` parts for logging);
:func:`chunked_cross_entropy` returns the scalar loss.

Memory. The full-vocabulary float32 logits of both models for the whole batch never exist at once, in forward or
backward: every loss here runs on the chunked-loss engine (trainer/losses/chunked.py). Only the selected positions are
processed, ``chunk_size`` of them at a time: each chunk is projected (fused variants), upcast to float32 and reduced,
and the gradient with respect to that chunk's logits is taken right away (by autograd on the chunk, or in closed form
for :func:`cross_entropy_with_grads`) and folded into the gradients of the inputs (student logits, or student hidden
states and head weight). Backward then only scales these stored gradients, so nothing is recomputed and only one
chunk's float32 intermediates are alive at a time. The teacher is always a constant: no gradient reaches teacher
logits, hidden states or weights. ``chunk_size=None`` processes all selected positions as one chunk. The gradient is
computed during the forward pass only when grad mode is on and an input requires grad. The fused functions read the
head weight directly: under DeepSpeed ZeRO-3 the caller must gather it first.

Output scaling. Some architectures scale their logits in their own forward after the lm_head (Cohere's ``logit_scale``,
Granite's ``logits_scaling``, Gemma-2's ``final_logit_softcapping``: trainer/models/logit_scaling.py). The fused
variants project with the bare head weight, so a model's own distribution needs its :class:`LogitScaling`:
``fused_kd_loss(..., student_scaling=, teacher_scaling=)`` and ``chunked_cross_entropy(..., scaling=)`` apply it to each
chunk's float32 logits (the teacher's without gradient; the student's gradient is carried through the scaling's
derivative to the raw logits ``hidden @ weight.T``, so the chain rule through the projection is unchanged). None or the
identity costs nothing. The full-logit variants (:func:`kd_loss`, :func:`sparse_kd_loss`) take logits already scaled (a
model's forward output).

Errors: an all-zero ``loss_mask`` raises ``ValueError`` naming ``loss_mask``; NaN checks belong to the caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.losses.chunked import (
    Target,
    Term,
    autograd_rows,
    chunked_loss,
    chunked_loss_with_grads,
    cross_entropy_rows,
    kl_from_log_probs,
)
from trainer.losses.distribution import DEFAULT_ETA, LOSSES, DistributionLoss, distribution_rows, sparse_loss_rows
from trainer.losses.distribution import loss_rows as lk_loss_rows
from trainer.models.logit_scaling import LogitScaling

IGNORE_INDEX = -100
KD_LOSSES = ("kl", "reverse_kl", "jsd", *LOSSES[1:])
"""The ``loss`` values of the KD losses here: trainer/losses/distribution.py's :data:`LOSSES` and two divergences of
their own (the reverse KL and the generalized JSD)."""
SPARSE_LOSSES = LOSSES
"""The losses a top-k teacher (:func:`sparse_kd_loss`) supports: the reverse KL and the JSD need the teacher's whole
distribution."""
KL = DistributionLoss()
"""The forward KL, every objective's default loss toward a distribution."""
SPARSE_TAILS = ("renormalize", "bucket")
# Sparse "bucket" mode floors both tail masses at this value (log space): float32 cannot resolve a smaller tail
# from a sum of top-k probabilities near 1, and a zero tail would make the bucket term 0 * log 0.
_MIN_TAIL = 1e-6
_MAX_LOG_HEAD = math.log1p(-_MIN_TAIL)


@dataclass(frozen=True)
class LossParts:
    """A loss and its parts. ``loss`` is differentiable; ``kd`` and ``ce`` are detached, for logging."""

    loss: torch.Tensor  # [] float32: (1 - alpha) * kd + alpha * ce
    kd: torch.Tensor  # [] float32: T^2 * weighted mean divergence (0 for a pure cross entropy)
    # [] float32: weighted mean cross entropy at T = 1; None when no labels were given; NaN when labels were given
    # but all are -100 on the selected positions (allowed only with alpha == 0: alpha > 0 raises ValueError)
    ce: torch.Tensor | None
    # [] float32: weighted mean expected acceptance sum_v min(p_v, q_v) over the KD positions (detached); None for a
    # pure cross entropy
    alpha: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------------------------------
# Per-position divergences on float32 log-probabilities.


def divergence_from_log_probs(
    teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor, loss: str, beta: float = 0.5
) -> torch.Tensor:
    """``kl``, ``reverse_kl`` or ``jsd`` per position, without temperature scaling (see the module docstring).

    teacher_log_probs, student_log_probs: [..., V] (``log p``, ``log q``). Returns [...].
    """
    lp, lq = teacher_log_probs, student_log_probs
    if loss == "kl" or (loss == "jsd" and beta == 0.0):
        return kl_from_log_probs(lp, lq)
    if loss == "reverse_kl" or (loss == "jsd" and beta == 1.0):
        return kl_from_log_probs(lq, lp)
    if loss == "jsd":
        log_m = torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))  # [..., V] log(beta p + (1-beta) q)
        return beta * kl_from_log_probs(lp, log_m) + (1.0 - beta) * kl_from_log_probs(lq, log_m)
    raise ValueError(f"loss={loss!r} is not one of kl, reverse_kl, jsd")


def _dense_rows(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, loss: str, beta: float, t: float, eta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the loss (``T^2 *`` the divergence for kl, reverse_kl and jsd; the LK losses as they are) and the
    acceptance ``sum_v min(p_v, q_v)`` (detached). student_logits, teacher_logits: [C, V] float32. Returns [C], [C]."""
    z = student_logits / t if t != 1.0 else student_logits  # [C, V]
    with torch.no_grad():
        lp = F.log_softmax(teacher_logits / t if t != 1.0 else teacher_logits, dim=-1)  # [C, V]
    if loss in LOSSES[1:]:
        rows, alpha = lk_loss_rows(z, lp.exp(), DistributionLoss(loss, eta), want_kl=False)
        return rows, alpha.detach()
    lq = F.log_softmax(z, dim=-1)  # [C, V]
    rows = divergence_from_log_probs(lp, lq, loss, beta) * (t * t)
    with torch.no_grad():
        alpha = torch.minimum(lq.exp(), lp.exp()).sum(-1)  # [C]
    return rows, alpha


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for x < 0, accurate near 0."""
    return torch.log(-torch.expm1(x))


def _sparse_rows(
    student_logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_lp: torch.Tensor,
    tail: str,
    t: float,
    spec: DistributionLoss = KL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the loss against a top-k teacher (see :func:`sparse_kd_loss`: ``T^2 *`` the forward KL with the
    ``tail`` mode, or an LK loss over the k ids) and the acceptance over the k ids (detached).

    student_logits: [C, V] float32; ids: [C, k] int64; teacher_lp: [C, k] float32. Returns [C], [C].
    """
    z = student_logits / t  # [C, V]
    if not spec.is_kl:
        rows, alpha = sparse_loss_rows(z, ids, teacher_lp.exp(), spec)
        return rows, alpha.detach()
    with torch.no_grad():
        alpha = torch.minimum(F.softmax(z, dim=-1).gather(-1, ids), teacher_lp.exp()).sum(-1)  # [C]
    if tail == "renormalize":
        lq_k = F.log_softmax(z.gather(-1, ids), dim=-1)  # [C, k] == full log-softmax at ids, renormalised over ids
        lp_k = teacher_lp - torch.logsumexp(teacher_lp, dim=-1, keepdim=True)  # [C, k]
        return kl_from_log_probs(lp_k, lq_k) * (t * t), alpha
    lq_k = F.log_softmax(z, dim=-1).gather(-1, ids)  # [C, k]
    p_k = teacher_lp.exp()  # [C, k]
    head = (p_k * torch.where(p_k > 0, teacher_lp - lq_k, torch.zeros_like(lq_k))).sum(-1)  # [C]
    lp_tail = _log1mexp(torch.logsumexp(teacher_lp, dim=-1).clamp(max=_MAX_LOG_HEAD))  # [C] log(1 - sum p_k)
    lq_tail = _log1mexp(torch.logsumexp(lq_k, dim=-1).clamp(max=_MAX_LOG_HEAD))  # [C] log(1 - sum q_k)
    return (head + lp_tail.exp() * (lp_tail - lq_tail)) * (t * t), alpha


# ---------------------------------------------------------------------------------------------------------------------
# The objective per row, on the chunked-loss engine (trainer/losses/chunked.py).


@dataclass
class _RowTargets:
    """What a chunk of C selected positions is scored against: the teacher (dense logits [C, V] float32, or top-k ids
    [C, k] and log-probabilities [C, k]) and the labels [C]."""

    teacher: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
    labels: torch.Tensor | None


def _active(scaling: LogitScaling | None) -> LogitScaling | None:
    """``scaling``, or None when it does nothing (so that the identity costs no operation)."""
    return None if scaling is None or scaling.is_identity else scaling


def _objective_rows(kd_rows: Callable | None, alpha: float, kd_den: torch.Tensor, ce_den: torch.Tensor):
    """Per row, ``(1 - alpha) * kd_i / kd_den + alpha * ce_i / ce_den`` (each part only where its factor is not 0) and
    the parts ``(kd_i, ce_i, alpha_i)`` [C] as statistics (``alpha_i`` the acceptance): the weighted sum over the rows
    is the objective of the module docstring. ``kd_rows(logits [C, V] float32, teacher) -> ([C], [C] acceptance)``."""

    def rows(logits: torch.Tensor, target: _RowTargets) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        zero = logits.new_zeros(logits.shape[0])  # [C]
        objective, kd, ce, accept = zero, zero, zero, zero
        if kd_rows is not None:
            with torch.set_grad_enabled(torch.is_grad_enabled() and alpha < 1.0):
                kd, accept = kd_rows(logits, target.teacher)  # [C] each
            if alpha < 1.0:
                objective = objective + kd * ((1.0 - alpha) / kd_den)
        if target.labels is not None:
            with torch.set_grad_enabled(torch.is_grad_enabled() and alpha > 0.0):
                ce = F.cross_entropy(logits, target.labels, ignore_index=IGNORE_INDEX, reduction="none")  # [C]
            if alpha > 0.0:
                objective = objective + ce * (alpha / ce_den)
        return objective, (kd.detach(), ce.detach(), accept.detach())

    return rows


def _reduce(
    term: Term,
    idx: torch.Tensor,
    weights: torch.Tensor,
    labels: torch.Tensor | None,
    teacher: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None,
    kd_rows: Callable | None,
    alpha: float,
    chunk_size: int | None,
    kd_den: torch.Tensor,
    ce_den: torch.Tensor,
    scaling: LogitScaling | None = None,
) -> LossParts:
    """The objective of the selected flat positions ``idx`` [n] (weights [n], labels [n] or None) on the engine, in
    float32; ``teacher(flat ids [C])`` gives a chunk's teacher for ``kd_rows``."""

    def targets(part: slice) -> _RowTargets:
        return _RowTargets(None if teacher is None else teacher(idx[part]), None if labels is None else labels[part])

    out = chunked_loss(
        [term], autograd_rows(_objective_rows(kd_rows, alpha, kd_den, ce_den)), targets, weights,
        index=idx, chunks=chunk_size, scaling=_active(scaling), dtype=torch.float32,
    )  # fmt: skip
    kd_rows_out, ce_rows_out, alpha_rows = out.stats  # [n] each
    kd, ce = (kd_rows_out * weights).sum() / kd_den, (ce_rows_out * weights).sum() / ce_den
    accept = (alpha_rows * weights).sum() / kd_den if kd_rows is not None else None
    return LossParts(loss=out.total, kd=kd, ce=ce if labels is not None else None, alpha=accept)


# ---------------------------------------------------------------------------------------------------------------------
# Argument checks.


def _check_options(
    loss: str,
    beta: float,
    temperature: float,
    alpha: float,
    chunk_size: int | None,
    lk_eta: float = DEFAULT_ETA,
    allowed: tuple[str, ...] = KD_LOSSES,
) -> None:
    if loss not in allowed:
        raise ValueError(f"loss={loss!r} is not one of {allowed}")
    if not (math.isfinite(lk_eta) and lk_eta >= 0):
        raise ValueError(f"lk_eta={lk_eta} must be a finite number >= 0")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must lie in [0, 1]")
    if not temperature > 0.0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must lie in [0, 1]")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int or None")


def _check_3d(x: torch.Tensor, name: str, leading: tuple[int, int] | None = None) -> tuple[int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [B, S, *], got shape {tuple(x.shape)}")
    if leading is not None and tuple(x.shape[:2]) != leading:
        raise ValueError(f"{name} has [B, S] = {tuple(x.shape[:2])}, expected {leading}")
    return tuple(x.shape)


def _check_head(weight: torch.Tensor, hidden: torch.Tensor, name: str) -> int:
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{name} must be [V, {hidden.shape[-1]}], got shape {tuple(weight.shape)}")
    return weight.shape[0]


def _select(loss_mask: torch.Tensor | None, labels: torch.Tensor | None, bs: tuple[int, int], vocab: int, alpha: float):
    """Flat selected positions [n], their weights [n] float32 and labels [n] (or None); with the denominators."""
    if labels is not None:
        if tuple(labels.shape) != bs:
            raise ValueError(f"labels must be [B, S] = {bs}, got shape {tuple(labels.shape)}")
        if labels.is_floating_point() or labels.dtype == torch.bool:
            raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            raise ValueError(
                f"labels hold ids outside [0, {vocab}) other than {IGNORE_INDEX}: {labels[bad][:5].tolist()}"
            )
    elif alpha > 0.0:
        raise ValueError(f"alpha={alpha} > 0 needs labels for the cross-entropy part")
    if loss_mask is None:
        if labels is None:
            raise ValueError("loss_mask is None and there are no labels to select positions")
        weights = (labels != IGNORE_INDEX).float()  # [B, S]
    else:
        if tuple(loss_mask.shape) != bs:
            raise ValueError(f"loss_mask must be [B, S] = {bs}, got shape {tuple(loss_mask.shape)}")
        weights = loss_mask.float()  # [B, S]
        if not bool((weights >= 0).all()):
            raise ValueError("loss_mask has negative or NaN weights")
    weights = weights.reshape(-1)  # [B*S]
    idx = torch.nonzero(weights > 0).squeeze(-1)  # [n]
    if idx.numel() == 0:
        raise ValueError("loss_mask selects no position (all zero): the mean over masked positions is undefined")
    w = weights[idx]  # [n]
    lab = labels.reshape(-1)[idx].long() if labels is not None else None  # [n]
    kd_den = w.sum()
    ce_den = (w * (lab != IGNORE_INDEX)).sum() if lab is not None else kd_den
    if lab is not None and alpha > 0.0 and not bool(ce_den > 0):
        raise ValueError(f"labels are all {IGNORE_INDEX} on the positions loss_mask selects: no cross entropy")
    return idx.to(weights.device), w, lab, kd_den, ce_den


# ---------------------------------------------------------------------------------------------------------------------
# Public losses.


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    loss: str = "kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    alpha: float = 0.0,
    chunk_size: int | None = None,
    lk_eta: float = DEFAULT_ETA,
) -> LossParts:
    """Distillation loss from full logits (any float dtype; upcast to float32 one chunk at a time).

    student_logits: [B, S, V] (gets gradients); teacher_logits: [B, S, V] (constant); loss_mask: [B, S] bool or
    float weights; labels: [B, S] int with -100 to ignore (needed when alpha > 0). See the module docstring for the
    losses (``loss``, one of :data:`KD_LOSSES`; ``lk_eta`` the LK hybrid's), the reduction and ``loss = (1 - alpha) *
    KD + alpha * CE``.
    """
    _check_options(loss, beta, temperature, alpha, chunk_size, lk_eta)
    b, s, v = _check_3d(student_logits, "student_logits")
    if tuple(teacher_logits.shape) != (b, s, v):
        raise ValueError(f"teacher_logits shape {tuple(teacher_logits.shape)} != student_logits shape {(b, s, v)}")
    idx, w, lab, kd_den, ce_den = _select(loss_mask, labels, (b, s), v, alpha)
    teacher = teacher_logits.detach().reshape(b * s, v)  # [N, V]

    def teacher_rows(ids: torch.Tensor) -> torch.Tensor:
        return teacher.index_select(0, ids).float()  # [C, V]

    def kd_rows(logits: torch.Tensor, t_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _dense_rows(logits, t_logits, loss, beta, temperature, lk_eta)

    term = Term(student_logits.reshape(b * s, v))
    return _reduce(term, idx, w, lab, teacher_rows, kd_rows, alpha, chunk_size, kd_den, ce_den)


def fused_kd_loss(
    student_hidden: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    loss_mask: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    loss: str = "kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    alpha: float = 0.0,
    chunk_size: int | None = 256,
    student_scaling: LogitScaling | None = None,
    teacher_scaling: LogitScaling | None = None,
    lk_eta: float = DEFAULT_ETA,
) -> LossParts:
    """:func:`kd_loss` on ``scaling(hidden @ lm_head_weight.T)`` without materialising either model's full logits.

    student_hidden: [B, S, H], student_lm_head_weight: [V, H] (both get gradients when they require them);
    teacher_hidden: [B, S, Ht], teacher_lm_head_weight: [V, Ht] (constants). Each chunk is projected in the inputs'
    dtype (as the model's own head would), then upcast to float32 and scaled. No bias: heads of causal LMs have none.
    student_scaling, teacher_scaling: the output scaling each model's forward applies after its lm_head
    (``LogitScaling.from_config(model.config)``, ``FrozenTarget.logit_scaling``; None: none). The cross-entropy part
    is taken on the student's scaled logits too.
    """
    _check_options(loss, beta, temperature, alpha, chunk_size, lk_eta)
    b, s, h = _check_3d(student_hidden, "student_hidden")
    _check_3d(teacher_hidden, "teacher_hidden", (b, s))
    v = _check_head(student_lm_head_weight, student_hidden, "student_lm_head_weight")
    v_t = _check_head(teacher_lm_head_weight, teacher_hidden, "teacher_lm_head_weight")
    if v != v_t:
        raise ValueError(f"vocabulary sizes differ: student_lm_head_weight has {v} rows, teacher_lm_head_weight {v_t}")
    idx, w, lab, kd_den, ce_den = _select(loss_mask, labels, (b, s), v, alpha)
    t_hidden = teacher_hidden.detach().reshape(b * s, -1)  # [N, Ht]
    t_weight = teacher_lm_head_weight.detach()  # [V, Ht]
    t_scaling = _active(teacher_scaling)

    @torch.no_grad()
    def teacher_rows(ids: torch.Tensor) -> torch.Tensor:
        t_logits = (t_hidden.index_select(0, ids) @ t_weight.t()).float()  # [C, V]
        return t_logits if t_scaling is None else t_scaling(t_logits)  # [C, V] the teacher's own logits

    def kd_rows(logits: torch.Tensor, t_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _dense_rows(logits, t_logits, loss, beta, temperature, lk_eta)

    term = Term(student_hidden.reshape(b * s, h), student_lm_head_weight)
    return _reduce(term, idx, w, lab, teacher_rows, kd_rows, alpha, chunk_size, kd_den, ce_den, student_scaling)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = 256,
    *,
    scaling: LogitScaling | None = None,
) -> torch.Tensor:
    """Mean next-token cross entropy of ``scaling(hidden @ lm_head_weight.T)`` over labels != -100, chunked like
    :func:`fused_kd_loss`. hidden: [B, S, H]; lm_head_weight: [V, H]; labels: [B, S], already aligned with hidden
    (label i is the target of position i: the caller shifts); scaling: the output scaling the model's forward applies
    after its lm_head (``LogitScaling.from_config(model.config)``; None: none). Returns a scalar float32 tensor.
    """
    _check_options("kl", 0.5, 1.0, 1.0, chunk_size)
    b, s, h = _check_3d(hidden, "hidden")
    v = _check_head(lm_head_weight, hidden, "lm_head_weight")
    if tuple(labels.shape) == (b, s) and not bool((labels != IGNORE_INDEX).any()):
        raise ValueError(f"labels are all {IGNORE_INDEX}: no position to compute the cross entropy on")
    idx, w, lab, kd_den, ce_den = _select(None, labels, (b, s), v, 1.0)
    term = Term(hidden.reshape(b * s, h), lm_head_weight)
    return _reduce(term, idx, w, lab, None, None, 1.0, chunk_size, kd_den, ce_den, scaling).loss


def sparse_kd_loss(
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    tail: str = "renormalize",
    temperature: float = 1.0,
    alpha: float = 0.0,
    chunk_size: int | None = None,
    loss: str = "kl",
    lk_eta: float = DEFAULT_ETA,
) -> LossParts:
    """Forward KL (or an LK loss) against a teacher known only through its top-k (ids and log-probabilities, e.g.
    from disk).

    student_logits: [B, S, V]; teacher_topk_ids: [B, S, k] int (distinct ids per position); teacher_topk_logprobs:
    [B, S, k] (any float dtype) = the teacher's full-vocabulary log-softmax at ``temperature``, gathered at the ids.
    The log-probabilities are used as given: they must already be at the temperature passed here (the shard metadata
    records the teacher's temperature and the caller checks it matches); re-tempering them exactly would need the
    tail, which is not stored. The student is taken at ``temperature`` (``log q = log_softmax(student_logits / T)``).

    ``tail="renormalize"``: both sides are restricted to the k ids and renormalised there,
    ``p~ = p_k / sum p_k`` and ``q~ = q_k / sum q_k``, and the divergence is ``KL(p~ || q~)`` over the k ids. The
    student's mass outside the top-k set is not penalised.
    ``tail="bucket"``: one extra outcome holds the rest of the mass on each side, ``p_tail = 1 - sum p_k`` and
    ``q_tail = 1 - sum q_k``, and the divergence is ``sum_k p_k (log p_k - log q_k) + p_tail (log p_tail - log
    q_tail)``, a KL between two distributions over k + 1 outcomes. Both tails are floored at 1e-6 (float32 cannot
    resolve less from a sum near 1). With k == V both modes equal the dense forward KL.
    KD is multiplied by T^2, reduced and combined with the optional cross entropy as in :func:`kd_loss`.

    ``loss`` (:data:`SPARSE_LOSSES`): ``kl`` is the above; ``tv``, ``nla`` and ``lk_hybrid`` are taken over the k ids
    (trainer/losses/distribution.py's :func:`~trainer.losses.distribution.sparse_loss_rows`: the teacher's mass outside
    them counts as rejected, the hybrid's KL is the renormalised one, ``tail`` is not used), without ``T^2``. The
    acceptance (:attr:`LossParts.alpha`) is the overlap over the k ids, a lower bound.
    """
    _check_options(loss, 0.5, temperature, alpha, chunk_size, lk_eta, SPARSE_LOSSES)
    spec = DistributionLoss(loss, lk_eta)
    if tail not in SPARSE_TAILS:
        raise ValueError(f"tail={tail!r} is not one of {SPARSE_TAILS}")
    b, s, v = _check_3d(student_logits, "student_logits")
    _, _, k = _check_3d(teacher_topk_ids, "teacher_topk_ids", (b, s))
    if tuple(teacher_topk_logprobs.shape) != (b, s, k):
        raise ValueError(f"teacher_topk_logprobs shape {tuple(teacher_topk_logprobs.shape)} != ids shape {(b, s, k)}")
    if teacher_topk_ids.is_floating_point() or not teacher_topk_logprobs.is_floating_point():
        raise ValueError("teacher_topk_ids must be integers and teacher_topk_logprobs floats")
    if k > v or bool(((teacher_topk_ids < 0) | (teacher_topk_ids >= v)).any()):
        raise ValueError(f"teacher_topk_ids hold ids outside [0, {v}) or k={k} > V={v}")
    sorted_ids = teacher_topk_ids.sort(dim=-1).values  # [B, S, k]
    if k > 1 and bool((sorted_ids[..., 1:] == sorted_ids[..., :-1]).any()):
        raise ValueError("teacher_topk_ids repeat an id at some position: the top-k ids must be distinct")
    idx, w, lab, kd_den, ce_den = _select(loss_mask, labels, (b, s), v, alpha)
    ids_flat = teacher_topk_ids.reshape(b * s, k)  # [N, k]
    lp_flat = teacher_topk_logprobs.detach().reshape(b * s, k)  # [N, k]

    def teacher_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ids_flat.index_select(0, rows).long(), lp_flat.index_select(0, rows).float()  # [C, k] each

    def kd_rows(logits: torch.Tensor, teacher: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return _sparse_rows(logits, teacher[0], teacher[1], tail, temperature, spec)

    term = Term(student_logits.reshape(b * s, v))
    return _reduce(term, idx, w, lab, teacher_rows, kd_rows, alpha, chunk_size, kd_den, ce_den)


# ---------------------------------------------------------------------------------------------------------------------
# Cross entropy with its gradients taken at once (the heads of parallel multi-token prediction).


@dataclass(frozen=True)
class SoftTargets:
    """A frozen teacher's next-token distribution, projected a chunk of positions at a time from its final normed
    hidden states (never its whole [B, S, V] logits).

    Attributes:
        hidden: ``[B, S, Ht]`` the teacher's final normed hidden states, aligned with the student's positions.
        lm_head_weight: ``[V, Ht]`` its output projection.
        scaling: the output scaling its forward applies after its lm_head (None: none).
    """

    hidden: torch.Tensor
    lm_head_weight: torch.Tensor
    scaling: LogitScaling | None = None

    def later(self, n: int) -> SoftTargets:
        """The same teacher with position t holding its distribution at t + ``n`` (zeros past the row's end, where
        the caller trains nothing): what a head that guesses n tokens further ahead learns."""
        if n == 0:
            return self
        s = self.hidden.shape[1]
        hidden = F.pad(self.hidden[:, n:], (0, 0, 0, min(n, s)))[:, :s]  # [B, S, Ht]
        return SoftTargets(hidden, self.lm_head_weight, self.scaling)

    @torch.no_grad()
    def logits(self, flat_ids: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The teacher's own (scaled) logits: ``[C, V]`` at the flat positions ``flat_ids`` [C] (``b * S + s``), or
        ``[B, S, V]`` at every position when None; in ``dtype`` (default: the hidden states')."""
        rows = self.hidden.detach()  # [B, S, Ht]
        if flat_ids is not None:
            rows = rows.reshape(-1, rows.shape[-1]).index_select(0, flat_ids)  # [C, Ht]
        logits = (rows @ self.lm_head_weight.detach().t()).to(dtype or rows.dtype)  # [..., V]
        scaling = _active(self.scaling)
        return logits if scaling is None else scaling(logits)

    def log_probs(self, flat_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[C, V]`` log-probabilities (in ``dtype``) at the flat positions ``flat_ids`` [C] (``b * S + s``)."""
        return torch.log_softmax(self.logits(flat_ids, dtype), dim=-1)


def cross_entropy_with_grads(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = 256,
    grad_hidden: bool = True,
    grad_weight: bool = True,
    scale: float = 1.0,
    weight_grad_out: torch.Tensor | None = None,
    scaling: LogitScaling | None = None,
    soft_targets: SoftTargets | None = None,
    loss: DistributionLoss = KL,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Mean cross entropy of ``scaling(hidden @ lm_head_weight.T)`` over labels != -100 and, computed at once without
    autograd, the gradients of ``scale * loss`` with respect to ``hidden`` and ``lm_head_weight``.

    One chunk of ``chunk_size`` labelled positions at a time: the chunk's logits are projected in the inputs' dtype,
    widened to float32 (float64 inputs stay float64, so a float64 caller gets float64-exact gradients, where
    :func:`chunked_cross_entropy` computes in float32), turned in place into ``softmax - onehot`` and folded into the
    two gradients, so only one chunk's logits exist at a time. The gradient of the mean is
    ``scale * (softmax(logits) - onehot(label)) / n`` per labelled position, zero elsewhere. Used inside the sequential
    backward of parallel MTP heads (trainer/methods/mtp_heads/module.py), which runs one head's backward at a time.

    hidden: [B, S, H]; lm_head_weight: [V, H]; labels: [B, S], aligned with hidden (label i is the target of position
    i). Returns ``(loss [] in the compute dtype, grad of hidden [B, S, H] or None, grad of the weight [V, H] or
    None, mean acceptance [] or None)``; with no labelled position the loss is 0 and the gradients are zero.
    ``weight_grad_out``: a [V, H] tensor of the compute dtype to add the weight's gradient to (returned as the third
    item), instead of a new one (callers summing several losses' gradients then hold one such tensor, not one per
    loss). ``scaling``: the output scaling
    the model's forward applies after its lm_head (None: none); the gradient with respect to the raw logits is then
    the one above times ``multiplier * (1 - tanh^2)`` of the soft-cap (``multiplier`` alone without one).

    ``soft_targets``: a teacher's distribution per position (:class:`SoftTargets`, aligned with ``hidden``) in place of
    the labels' tokens: the loss is then the mean forward ``KL(p || q)`` over the labelled positions (the labels only
    select them) and ``onehot(label)`` becomes ``p`` in the gradient (the KL and the soft cross entropy differ by the
    teacher's entropy, a constant). The mean acceptance ``sum_v min(p_v, q_v)`` over the labelled positions is then
    the fourth item (detached; None without ``soft_targets``). ``loss``: the loss toward the teacher's distribution
    (trainer/losses/distribution.py: ``kl``, the above, with its closed-form gradient; ``tv``, ``nla``, ``lk_hybrid``
    with the gradient taken by autograd on each chunk); needs ``soft_targets`` unless it is ``kl``.
    """
    _check_options("kl", 0.5, 1.0, 1.0, chunk_size)
    if soft_targets is None and not loss.is_kl:
        raise ValueError(f"loss={loss.name!r} trains toward a distribution: it needs soft_targets")
    b, s, h = _check_3d(hidden, "hidden")
    v = _check_head(lm_head_weight, hidden, "lm_head_weight")
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"labels must be [B, S] = {(b, s)}, got shape {tuple(labels.shape)}")
    if soft_targets is not None:
        _check_3d(soft_targets.hidden, "soft_targets.hidden", (b, s))
        if _check_head(soft_targets.lm_head_weight, soft_targets.hidden, "soft_targets.lm_head_weight") != v:
            raise ValueError(f"soft_targets.lm_head_weight has {soft_targets.lm_head_weight.shape[0]} rows, the "
                             f"student's vocabulary {v}")  # fmt: skip
    compute = torch.promote_types(hidden.dtype, torch.float32)
    lab = labels.reshape(-1)  # [N]
    idx = torch.nonzero(lab != IGNORE_INDEX).squeeze(-1)  # [n]
    n = idx.numel()
    if n and bool(((lab[idx] < 0) | (lab[idx] >= v)).any()):
        raise ValueError(f"labels hold ids outside [0, {v}) other than {IGNORE_INDEX}")
    tokens = lab[idx].long()  # [n]

    def targets(part: slice) -> Target:
        if soft_targets is None:
            return Target(ids=tokens[part])
        return Target(log_probs=soft_targets.log_probs(idx[part], compute))  # [C, V] log p

    term = Term(hidden.reshape(b * s, h), lm_head_weight)
    rows = cross_entropy_rows if soft_targets is None else distribution_rows(loss)
    out, [(g_hidden, g_weight)] = chunked_loss_with_grads(
        [term], rows, targets, torch.ones(n, dtype=compute, device=hidden.device),
        [(grad_hidden, grad_weight)], index=idx, chunks=chunk_size, scaling=_active(scaling), dtype=compute,
        grad_scale=scale / max(1, n), weight_grads_out=[weight_grad_out],
    )  # fmt: skip
    mean = out.total / max(1, n)
    accept = None
    if soft_targets is not None:
        accept = out.stats[0].sum() / max(1, n) if out.stats else mean.new_zeros(())
    g_hidden = g_hidden.view(b, s, h) if g_hidden is not None else None
    if g_weight is not None and weight_grad_out is None:
        g_weight = g_weight.to(lm_head_weight.dtype)
    return mean, g_hidden, g_weight, accept
