"""Drafting with Medusa heads: the argmax chain, or a tree of top-k paths (the Medusa paper's 63-node tree for 4
heads by default)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.decoding.heads_proposer import ParallelHeadsProposer
from trainer.decoding.proposers import ProposalContext


class MedusaProposer(ParallelHeadsProposer):
    """Medusa heads on the target's final normed hidden state (HF ``hidden_states[L]``)."""

    def __init__(self, heads, num_layers: int, choices: Sequence[Sequence[int]] | None = None) -> None:
        """
        Args:
            heads: trainer.methods.medusa.module.MedusaHeads (eval mode is set here).
            num_layers: L, the target's layer count (its final normed hidden state is ``hidden_states[L]``).
            choices: tree paths, or None for the argmax chain.
        """
        super().__init__(num_layers, heads.config.num_heads, choices)
        self.heads = heads.eval()

    def head_logits(self, ctx: ProposalContext) -> torch.Tensor:
        (layer,) = self.needs_hidden_states
        if layer not in ctx.hidden_states:
            raise ValueError(f"the Medusa proposer needs the target's hidden states of layer {layer}")
        return self.heads(ctx.hidden_states[layer][-1])  # [K, V]
