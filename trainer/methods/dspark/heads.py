"""DSpark's two small heads on a DFlash drafter (speculators 0.9 ``models/dspark``), the block refiner of this method.

A DFlash block drafts every slot at once, so slot ``k`` cannot know what slot ``k - 1`` drafted. The Markov head adds
a first-order logit bias: slot ``k``'s logits are ``lm_head(h_k) + markov_w2(markov_w1[t_{k-1}])``, with ``t_{k-1}``
the token before slot k's token (the anchor for slot 1). Training reads ``t_{k-1}`` from the data (teacher forcing,
as speculators does); drafting resolves the block left to right, each slot's bias from the token just drafted, which
costs one embedding row and one ``[r, V]`` projection per slot, never a drafter forward. ``markov_w1`` is an
embedding of the target's vocabulary (rank r), ``markov_w2`` a linear map back to it (no bias): a rank-r bigram table.

The confidence head predicts each slot's acceptance: ``sigmoid(proj([h_k; markov_w1[t_{k-1}]]))`` (the second part
with ``confidence_head_with_markov``), trained as speculators trains it: binary cross entropy against the slot's
analytical acceptance rate under speculative sampling, ``sum_v min(q_v, p_v) = 1 - TV(q, p)`` of the slot's
(Markov-corrected) draft distribution q and the target's distribution p at temperature 1 (detached), each slot
weighted ``exp(-(k - 1) / gamma)`` and averaged over the trained slots, added to the loss times
``confidence_head_alpha``. The proposer exposes the predicted acceptance of the last proposal's slots
(proposer.py ``slot_acceptance``).

Parameter names are speculators' (``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [V, r],
``confidence_head.proj.weight`` [1, H (+ r)], ``confidence_head.proj.bias`` [1]), so that the ``dspark`` export is the
state dict itself. speculators' other head types (``gated``, ``rnn``) are refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

MARKOV_HEAD_TYPES = ("vanilla",)
"""The Markov head variants implemented (speculators also defines ``gated`` and ``rnn``)."""


def check_heads(rank: int, head_type: str, confidence: bool, confidence_with_markov: bool) -> None:
    """Refuse head settings that do not make a drafter, naming the value and the fix (a ValueError: the objective
    turns it into a recipe error naming ``model.<key>``, the loaders into a folder error)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"markov_rank={rank!r} must be an integer >= 0 (0: no Markov head; speculators uses 256)")
    if head_type not in MARKOV_HEAD_TYPES:
        raise ValueError(
            f"markov_head_type={head_type!r} is not implemented: draftsmith implements {list(MARKOV_HEAD_TYPES)} "
            "(speculators' 'gated' and 'rnn' are not); use 'vanilla'"
        )
    if confidence_with_markov and not (confidence and rank > 0):
        raise ValueError(
            f"confidence_head_with_markov=True needs enable_confidence_head=True and markov_rank > 0 (got "
            f"enable_confidence_head={confidence}, markov_rank={rank}); set it to False or enable both"
        )


class MarkovHead(nn.Module):
    """The first-order logit bias of a slot from the token before it: ``markov_w2(markov_w1[prev])``."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        """
        Args:
            vocab_size: V, the target's vocabulary (the previous token's ids and the biased logits).
            rank: r, the factorisation's rank.
        """
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # speculators' initialisation; markov_w2 keeps torch's
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def prev_embeddings(self, prev: torch.Tensor) -> torch.Tensor:
        """prev: [...] token ids -> [..., r]."""
        return self.markov_w1(prev.long())

    def bias(self, prev_emb: torch.Tensor) -> torch.Tensor:
        """prev_emb: [..., r] -> [..., V] the logit bias."""
        return self.markov_w2(prev_emb.to(self.markov_w2.weight.dtype))


class ConfidenceHead(nn.Module):
    """A slot's predicted acceptance, as a logit: ``proj(features)``."""

    def __init__(self, input_dim: int) -> None:
        """
        Args:
            input_dim: H, or H + r when it also reads the previous token's Markov embedding.
        """
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., input_dim] -> [...] logits."""
        return self.proj(features).squeeze(-1)
