"""The per-position loss of EAGLE-3 and P-EAGLE drafters on soft labels over the draft vocabulary.

Soft labels are the target's distribution over the draft vocabulary, renormalised; their cross entropy against the
drafter is the forward KL up to a constant, what sampling verification accepts (the overlap of the two
distributions). Greedy verification accepts a draft only when it is the target's most likely token, so
``argmax_weight`` mixes in the cross entropy on that token: ``(1 - w) * soft + w * CE(argmax)``, the cross entropy
against the labels ``(1 - w) * probs + w * onehot(argmax)`` (:func:`mix_argmax`). w = 0 is the soft labels alone,
w = 1 the argmax alone; the figures of each are in docs/benchmarks/eagle3.md.

``model.loss`` (trainer/losses/distribution.py) picks the per-position loss: ``kl`` is the cross entropy above,
unchanged; ``tv``, ``nla`` and ``lk_hybrid`` train toward the target's own probabilities over the draft vocabulary,
*not* renormalised, so that the mass of target tokens outside the draft vocabulary counts as rejected, as verification
rejects them (the KL part of ``lk_hybrid`` renormalises, as ``kl`` does). ``argmax_weight`` mixes the argmax into the
KL's labels only, so it is refused with a loss other than ``kl`` (:func:`check_loss`).
"""

from __future__ import annotations

import math

import torch

from trainer.interface.errors import RecipeError
from trainer.losses.distribution import DistributionLoss


def check_argmax_weight(argmax_weight: float, labels: str = "soft") -> float:
    """``model.argmax_weight``, refused (naming the key) outside [0, 1] or with labels other than soft."""
    if not (math.isfinite(argmax_weight) and 0.0 <= argmax_weight <= 1.0):
        raise RecipeError(f"model.argmax_weight must be in [0, 1], got {argmax_weight}")
    if argmax_weight > 0.0 and labels != "soft":
        raise RecipeError(
            f"model.argmax_weight={argmax_weight} mixes the argmax into soft labels, but model.labels is {labels!r}",
            hint="set model.labels: soft, or model.argmax_weight: 0 (argmax labels are the argmax alone)",
        )
    return float(argmax_weight)


def mix_argmax(probs: torch.Tensor, argmax_weight: float) -> torch.Tensor:
    """Soft labels ``probs`` [..., Vd] (rows summing to 1, or all zero where a label is missing) with
    ``argmax_weight`` w of their mass moved onto their argmax: ``(1 - w) * probs + w * onehot(argmax)``, [..., Vd].
    The cross entropy against them is ``(1 - w) * soft + w * CE(argmax)`` (linear in the labels), so mixing the labels
    once per batch costs what mixing the losses at every TTT step would not. w = 0 returns ``probs`` itself."""
    if argmax_weight == 0.0:
        return probs
    # the target's most likely token of the draft vocabulary: max's indices are argmax's (the first of ties), and
    # faster than argmax on CPU over the last dimension
    top = probs.max(-1, keepdim=True).indices  # [..., 1]
    mixed = probs * (1.0 - argmax_weight)  # [..., Vd]
    return mixed.scatter_add_(-1, top, torch.full_like(top, argmax_weight, dtype=mixed.dtype))


def check_loss(loss: str, lk_eta: float, argmax_weight: float) -> DistributionLoss:
    """``model.loss`` and ``model.lk_eta`` (:meth:`~trainer.losses.distribution.DistributionLoss.from_options`), refused
    with ``model.argmax_weight > 0`` unless the loss is ``kl``: the mix moves label mass onto the argmax, which only the
    KL's cross entropy reads as a weighted sum of the two losses."""
    spec = DistributionLoss.from_options(loss, lk_eta)
    if argmax_weight > 0.0 and not spec.is_kl:
        raise RecipeError(
            f"model.argmax_weight={argmax_weight} mixes the argmax into the KL's labels, but model.loss is {loss!r}: "
            "set model.argmax_weight: 0 or model.loss: kl"
        )
    return spec
