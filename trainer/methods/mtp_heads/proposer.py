"""Self-speculative decoding with parallel MTP heads (module.py): the model drafts for itself.

The heads read the trunk output ``z`` (HF ``hidden_states[L - 1]``, the input of the last layer) that the target
session computed for the committed tokens. At a round start the committed tokens are ``tokens[0 .. T - 1]``, the
last one (the root) not yet in the target's cache, and ``z`` is known up to position ``T - 2``. There head 0 (the
model itself) predicted the root; extra head ``d`` predicts the token ``d`` positions after the root: the draft at
depth ``d``. So ``n`` heads give ``K = n - 1`` drafts per round, as a chain (argmax per head, or a sample at a
temperature) or as a tree of per-head top-k paths (trainer/decoding/head_tree.py), both verified losslessly by the
engine (the tree's nodes are deterministic candidates, which speculative sampling handles exactly).

The extra heads are attention blocks: each keeps its own KV cache over ``z`` of the committed positions, extended
every round with the entries that entered the target's cache in the last verification (``ProposalContext
.hidden_states``: the pending tokens and the accepted path), so drafting costs one block per head over the new
positions and the shared norm and lm_head at one position per head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.decoding.heads_proposer import ParallelHeadsProposer
from trainer.decoding.proposers import ProposalContext
from trainer.methods.mtp_heads.module import MTPHeads


class MTPHeadsProposer(ParallelHeadsProposer):
    """Chain or tree drafts from the extra heads of an :class:`MTPHeads` at the last position with a known ``z``."""

    def __init__(self, heads: MTPHeads, choices: Sequence[Sequence[int]] | None = None) -> None:
        """
        Args:
            heads: the model with its heads (eval mode is set here); its model must be the target being decoded.
            choices: tree paths of per-head top-k ranks (checked against the ``num_heads - 1`` drafting heads), or
                None for the chain.
        """
        if heads.num_heads < 2:
            raise ValueError(f"a model with {heads.num_heads} head drafts nothing: parallel MTP drafting needs n >= 2")
        super().__init__(heads.hidden_layer, heads.num_heads - 1, choices)
        self.heads = heads.eval()
        self.caches = heads.new_caches()
        self.cached = 0

    def reset(self) -> None:
        """A new sequence: empty caches."""
        self.caches = self.heads.new_caches()
        self.cached = 0

    def head_logits(self, ctx: ProposalContext) -> torch.Tensor:
        """Extend the heads' caches with the new committed positions; ``[K, V]`` the heads' logits at the last one."""
        (layer,) = self.needs_hidden_states
        if layer not in ctx.hidden_states:
            raise ValueError(f"the MTP heads proposer needs the target's hidden states of layer {layer}")
        z = ctx.hidden_states[layer]  # [n, H]
        start = ctx.tokens.numel() - 1 - z.shape[0]  # position of the first new entry
        if start != self.cached:
            raise RuntimeError(
                f"MTP heads proposer: the target's hidden states start at position {start} but the heads' caches hold "
                f"{self.cached} positions (a round without drafting lost some; call reset())"
            )
        logits = self.heads.draft_logits(z, start, self.caches)  # [K, V]
        self.cached += z.shape[0]
        return logits
