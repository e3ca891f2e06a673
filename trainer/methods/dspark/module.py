"""The DSpark drafter: the DFlash drafter (trainer/methods/dflash/module.py) with DSpark's Markov and confidence heads
(heads.py) as its block refiner (trainer/methods/dflash/refiner.py), as speculators' ``DSparkDraftModel`` extends
its ``DFlashDraftModel``.

The heads are built after the backbone (they keep speculators' own initialisation) under speculators' names,
``markov_head.*`` and ``confidence_head.*`` beside the backbone's weights, so that the ``dspark`` export is the state
dict itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.dspark.heads import ConfidenceHead, MarkovHead, check_heads

HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
"""The config fields of the heads (:class:`DSparkConfig`), written in the ``dspark`` export under these names."""


@dataclass
class DSparkConfig(DFlashConfig):
    """The DFlash drafter's shape and DSpark's heads. Defaults are speculators' ``DSparkSpeculatorConfig``'s (a
    ``dspark`` file that leaves a field out is read with them).

    Attributes:
        markov_rank: r, the rank of the Markov logit-bias head (heads.py): slot k's logits gain
            ``markov_w2(markov_w1[token at slot k - 1])``; 0: no such head.
        markov_head_type: the Markov head's variant; ``vanilla`` (a first-order bias) is the one implemented.
        enable_confidence_head: a linear head predicting each slot's acceptance probability.
        confidence_head_with_markov: the confidence head also reads the previous token's ``markov_w1`` row.
    """

    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_heads(
            self.markov_rank, self.markov_head_type, self.enable_confidence_head, self.confidence_head_with_markov
        )

    def heads(self) -> dict:
        """The heads' fields (:data:`HEAD_KEYS`) and their values."""
        return {key: getattr(self, key) for key in HEAD_KEYS}


class DSparkDrafter(DFlashDrafter):
    """The DFlash drafter with a Markov head (``markov_rank > 0``) and a confidence head (``enable_confidence_head``),
    each None when the config leaves it out."""

    refiner_modules = ("markov_head", "confidence_head")

    def __init__(self, config: DSparkConfig) -> None:
        """
        Args:
            config: the drafter's shape and heads.
        """
        super().__init__(config)
        c = config
        self.markov_head = MarkovHead(c.vocab_size, c.markov_rank) if c.markov_rank > 0 else None
        if c.enable_confidence_head:
            self.confidence_head = ConfidenceHead(
                c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0)
            )
        else:
            self.confidence_head = None

    def apply_heads(
        self, hidden: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The heads on slots: the Markov-biased logits and the confidence logits.

        hidden: [..., H] the slots' normed outputs; logits: [..., V] their lm_head logits; prev: [...] the token
        before each slot's token (teacher-forced in training, the previous draft when drafting). Returns the logits
        [..., V] (unchanged without a Markov head) and the confidence logits [...] (None without that head).
        """
        prev_emb = None if self.markov_head is None else self.markov_head.prev_embeddings(prev)  # [..., r]
        if prev_emb is not None:
            logits = logits + self.markov_head.bias(prev_emb).to(logits.dtype)  # [..., V]
        return logits, self.confidence(hidden, prev_emb)

    def confidence(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor | None:
        """The confidence head's logits [...] of slots' normed outputs ``hidden`` [..., H] and their previous tokens'
        Markov embeddings ``prev_emb`` [..., r] (None without a Markov head); None without a confidence head."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)  # [..., H + r]
        return self.confidence_head(features.to(self.confidence_head.proj.weight.dtype))
