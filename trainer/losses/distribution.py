"""The losses toward a target distribution, one vocabulary for every objective (``model.loss``), and the expected
acceptance every drafter reports beside its loss.

Notation, per position: ``p`` the target's distribution, ``q = softmax(logits)`` the drafter's. Under speculative
sampling a draft from ``q`` is accepted with probability ``alpha = sum_v min(p_v, q_v) = 1 - TV(p, q)`` (Leviathan et
al. 2023); that is the quantity the LK losses (Samarin et al., arXiv 2602.23881) optimise directly:

- ``"kl"``: ``KL(p || q) = sum_v p_v (log p_v - log q_v)``, the classic loss (what every objective used before);
- ``"tv"``: ``TV(p, q) = 1 - alpha``;
- ``"nla"``: the negative log-acceptance ``-log(max(alpha, 1e-5))``; its gradient is TV's divided by ``alpha``, so it
  keeps a usable gradient while the overlap is small (with a one-hot ``p`` it is the cross entropy);
- ``"lk_hybrid"``: ``lambda * KL + (1 - lambda) * TV`` with ``lambda = exp(-eta * sg(alpha))`` (``sg``: no gradient
  through the weight): KL's strong gradient while the overlap is small, TV's acceptance-optimal one as it grows; eta 3
  is the paper's (and speculators') default.

The reduced draft vocabulary. ``p`` may be *sub-normalised*: its mass over the drafter's vocabulary, with the mass of
target tokens the drafter cannot emit left out. ``alpha`` then counts that mass as rejected (a draft never equals such
a token), which is what verification does; the KL term is taken against ``p`` renormalised over the drafter's
vocabulary (what the objectives trained before, unchanged), so that ``kl`` is the loss it always was. With a target
known by its top-k only (shards), the overlap is taken over the stored ids, a lower bound.

Everything here is a plain differentiable function of the logits (:func:`loss_rows`, :func:`sparse_loss_rows`) for an
objective that holds its logits (EAGLE-3's reduced vocabulary), and a per-row loss of the chunked-loss engine
(:func:`distribution_rows`: no full ``[N, V]`` tensor, in forward or backward) for one that projects them a chunk at a
time. The KL keeps the engine's closed-form gradient; the others take theirs by autograd on the chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.interface.errors import RecipeError
from trainer.losses.chunked import RowLoss, RowLosses, Target, autograd_rows, cross_entropy_rows

LOSSES = ("kl", "tv", "nla", "lk_hybrid")
"""The ``model.loss`` values every objective that trains toward a distribution accepts."""
NLA_EPS = 1e-5
"""``nla`` floors the acceptance at this value (speculators' ``_NLA_EPS``): ``-log`` of it bounds the loss."""
DEFAULT_ETA = 3.0


@dataclass(frozen=True)
class DistributionLoss:
    """One of :data:`LOSSES` with its parameter.

    Attributes:
        name: ``kl``, ``tv``, ``nla`` or ``lk_hybrid`` (the module docstring).
        eta: ``lk_hybrid``'s blend temperature, ``lambda = exp(-eta * sg(alpha))``.
    """

    name: str = "kl"
    eta: float = DEFAULT_ETA

    @staticmethod
    def from_options(loss: str, lk_eta: float = DEFAULT_ETA, allowed: tuple[str, ...] = LOSSES) -> DistributionLoss:
        """The recipe's ``model.loss`` and ``model.lk_eta``, refused in one line naming the key when invalid."""
        if loss not in allowed:
            raise RecipeError(f"model.loss={loss!r} is not one of {', '.join(allowed)}")
        if not (isinstance(lk_eta, (int, float)) and math.isfinite(lk_eta) and lk_eta >= 0):
            raise RecipeError(f"model.lk_eta={lk_eta!r} must be a finite number >= 0")
        return DistributionLoss(loss, float(lk_eta))

    @property
    def is_kl(self) -> bool:
        return self.name == "kl"


def acceptance(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``alpha = sum_v min(p_v, q_v)`` over the last dim: q, p [..., V] -> [...]."""
    return torch.minimum(q, p.to(q.dtype)).sum(-1)


def _combine(kl: torch.Tensor, alpha: torch.Tensor, spec: DistributionLoss) -> torch.Tensor:
    """The loss [...] from the KL [...] and the acceptance [...] (both differentiable)."""
    if spec.name == "kl":
        return kl
    if spec.name == "tv":
        return 1.0 - alpha
    if spec.name == "nla":
        return -torch.log(alpha.clamp(min=NLA_EPS))
    if spec.name == "lk_hybrid":
        weight = torch.exp(-spec.eta * alpha.detach())  # [...] lambda, no gradient
        return weight * kl + (1.0 - weight) * (1.0 - alpha)
    raise ValueError(f"loss {spec.name!r} is not one of {LOSSES}")


def _renormalised_kl(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p / sum p || q)`` over the last dim (0 where ``p`` has no mass): p, log_q [..., V] -> [...]."""
    mass = p.sum(-1, keepdim=True)  # [..., 1]
    p_n = p / mass.clamp(min=torch.finfo(p.dtype).tiny)  # [..., V]
    return (torch.xlogy(p_n, p_n) - p_n * log_q).sum(-1)


def loss_rows(
    logits: torch.Tensor, p: torch.Tensor, spec: DistributionLoss, want_kl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the acceptance of every position, differentiable in ``logits``.

    Args:
        logits: [..., V] the drafter's logits (widened to at least float32).
        p: [..., V] the target's distribution over the same vocabulary, possibly sub-normalised (the module
            docstring); no gradient.
        spec: the loss.
        want_kl: compute the KL term even when the loss does not use it (False skips it for ``tv`` and ``nla``).

    Returns:
        the losses [...] and the acceptance rates ``alpha`` [...] (differentiable; detach to log).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    p = p.detach().to(logits.dtype)
    log_q = torch.log_softmax(logits, dim=-1)  # [..., V]
    alpha = acceptance(log_q.exp(), p)  # [...]
    kl = _renormalised_kl(p, log_q) if (want_kl or spec.name in ("kl", "lk_hybrid")) else alpha.new_zeros(())
    return _combine(kl, alpha, spec), alpha


def sparse_loss_rows(
    logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, spec: DistributionLoss
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`loss_rows` against a target known by its top-k: logits [C, V]; ids [C, k] distinct ids; p [C, k] their
    probabilities (possibly sub-normalised). The KL is ``sum_k p~ (log p~ - log q)`` with ``p~`` renormalised over the
    k ids and ``q`` the drafter's full distribution at them; the acceptance is the overlap over the k ids.
    Returns the losses [C] and acceptance rates [C]."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    p = p.detach().to(logits.dtype)
    log_q = torch.log_softmax(logits, dim=-1).gather(-1, ids)  # [C, k]
    alpha = acceptance(log_q.exp(), p)  # [C]
    return _combine(_renormalised_kl(p, log_q), alpha, spec), alpha


def _target_rows(logits: torch.Tensor, target: Target, spec: DistributionLoss) -> tuple[torch.Tensor, tuple]:
    """Per row of a chunk, the loss and ``(alpha,)`` against a :class:`~trainer.losses.chunked.Target`: token ids (a
    one-hot ``p``), else a dense distribution (``probs`` or ``log_probs``) or a top-k one (``sparse``). With ids and a
    distribution both, the loss is the ids' and ``alpha`` the distribution's (what sampling verification accepts)."""
    dense = target.probs if target.probs is not None else None
    if dense is None and target.log_probs is not None:
        dense = target.log_probs.exp()  # [C, V]
    if target.ids is not None:
        p = torch.zeros_like(logits, dtype=torch.promote_types(logits.dtype, torch.float32))  # [C, V] one-hot
        p.scatter_(-1, target.ids[:, None], 1.0)
        loss, alpha = loss_rows(logits, p, spec, want_kl=False)
        if dense is not None:
            alpha = acceptance(torch.softmax(logits.detach().to(p.dtype), dim=-1), dense)  # [C]
        elif target.sparse is not None:
            q = torch.softmax(logits.detach().to(p.dtype), dim=-1).gather(-1, target.sparse[0])  # [C, k]
            alpha = acceptance(q, target.sparse[1])  # [C]
        return loss, (alpha,)
    if target.sparse is not None:
        loss, alpha = sparse_loss_rows(logits, target.sparse[0], target.sparse[1], spec)
        return loss, (alpha,)
    if dense is None:
        raise ValueError("a Target needs ids, probs, log_probs or sparse")
    loss, alpha = loss_rows(logits, dense, spec, want_kl=False)
    return loss, (alpha,)


def distribution_rows(spec: DistributionLoss) -> RowLoss:
    """The per-row loss ``spec`` on the chunked-loss engine (trainer/losses/chunked.py) against a
    :class:`~trainer.losses.chunked.Target`, with the rows' acceptance rates ``alpha`` [C] as its one statistic.

    ``kl`` is :func:`~trainer.losses.chunked.cross_entropy_rows` (its closed-form gradient ``q - p``; the target's
    distribution must then be normalised, as the objectives give it) with the acceptance asked for whenever the target
    holds a distribution (token ids alone: ``q`` at the id); the others take their gradient by autograd on the chunk.
    """
    if spec.is_kl:

        def kl_rows(logits: torch.Tensor, target: Target, need_grad: bool) -> RowLosses:
            dense = target.probs is not None or target.log_probs is not None or target.sparse is not None
            hits = None
            if not dense:  # token ids: the acceptance of a one-hot target is q at the id
                lse = torch.logsumexp(logits, dim=-1)  # [C]
                hits = (logits.gather(-1, target.ids[:, None])[:, 0] - lse).exp()  # [C]
            out = cross_entropy_rows(logits, Target(target.ids, target.probs, target.log_probs, target.sparse,
                                                    acceptance=dense), need_grad)  # fmt: skip
            return RowLosses(out.loss, out.grad, out.stats if dense else (hits,))

        return kl_rows
    return autograd_rows(lambda logits, target: _target_rows(logits, target, spec))
