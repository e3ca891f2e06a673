"""The output scaling some architectures apply to their logits in their own forward, after the lm_head.

Cohere multiplies the logits by ``config.logit_scale``, Granite divides them by ``config.logits_scaling`` and Gemma-2
soft-caps them, ``cap * tanh(logits / cap)`` with ``cap = config.final_logit_softcapping``. A loss that projects a
model's hidden states with its bare lm_head weight (the chunked losses of trainer/losses/distillation.py) applies the
same scaling to get that model's own distribution; :class:`LogitScaling` is that scaling as a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitScaling:
    """``logits -> softcap * tanh(multiplier * logits / softcap)``, or ``multiplier * logits`` without a soft-cap: the
    scaling a model's forward applies after its lm_head (the multiplication first, then the soft-cap, as each
    architecture's forward and :meth:`trainer.models.target.FrozenTarget.project` do). ``LogitScaling()`` is the
    identity.

    Both operations are strictly increasing, so an argmax (or a ranking) of the logits is the same with or without
    the scaling; a distribution (softmax) is not.

    Attributes:
        multiplier: the factor the logits are multiplied by (Cohere's ``logit_scale``, or ``1 / logits_scaling`` for
            Granite); finite and > 0.
        softcap: Gemma-2's ``final_logit_softcapping`` (> 0), or None for no soft-cap.
    """

    multiplier: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.multiplier) and self.multiplier > 0):
            raise ValueError(f"LogitScaling: multiplier={self.multiplier!r} must be finite and > 0")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"LogitScaling: softcap={self.softcap!r} must be finite and > 0, or None")

    @classmethod
    def from_config(cls, config: object) -> LogitScaling:
        """The scaling a model's forward applies, from its HF config (any architecture's: a key its architecture
        does not have, or one set to None or 0, is absent).

        Args:
            config: the model's HF config (``model.config``).
        """
        multiplier = 1.0
        scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
        if scale:
            multiplier *= float(scale)
        divisor = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
        if divisor:
            multiplier /= float(divisor)
        cap = getattr(config, "final_logit_softcapping", None)  # Gemma-2: cap * tanh(logits / cap)
        return cls(multiplier=multiplier, softcap=float(cap) if cap else None)

    @property
    def is_identity(self) -> bool:
        """True when the scaling leaves the logits as they are (no multiplier other than 1, no soft-cap)."""
        return self.multiplier == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The scaled logits, [..., V] -> [..., V] in the same dtype; differentiable (autograd sees the operations).

        Args:
            logits: ``hidden @ lm_head_weight.T`` (and the head's bias, if any), [..., V].
        """
        if self.multiplier != 1.0:
            logits = logits * self.multiplier  # [..., V]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap  # [..., V]
        return logits
