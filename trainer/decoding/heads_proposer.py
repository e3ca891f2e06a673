"""Drafting with parallel heads on the target's hidden state of the last committed token (Medusa heads, parallel MTP
heads): the argmax chain (what vLLM does), or a tree of top-k paths verified with tree attention.

The heads read the hidden state the target session computed for the last committed token in the previous
verification (``ProposalContext.hidden_states``), so drafting costs the heads and nothing of the target. Head ``d``
guesses the draft at depth ``d + 1``. Greedy verification of either shape is lossless; at a temperature the chain
samples each head's token from its own distribution (returned for speculative sampling), and a tree's top-k nodes
are deterministic candidates (one-hot distributions), which keeps sampling exact too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.decoding.head_tree import Path, check_choices, top_k_needed, tree_from_choices
from trainer.decoding.proposers import ProposalContext, draw
from trainer.decoding.tree import DraftTree


class ParallelHeadsProposer:
    """Chain or tree drafts from ``num_heads`` heads; subclasses give the heads' logits."""

    def __init__(self, layer: int, num_heads: int, choices: Sequence[Sequence[int]] | None = None) -> None:
        """
        Args:
            layer: the target hidden state the heads read (HF ``hidden_states`` index, or FINAL_PRENORM).
            num_heads: K, the most drafts per round.
            choices: tree paths (``medusa_choices``), or None for the argmax chain.
        """
        self.needs_hidden_states: tuple[int, ...] = (layer,)
        self.max_drafts = num_heads
        self.choices: tuple[Path, ...] | None = None if choices is None else check_choices(choices, num_heads)

    def head_logits(self, ctx: ProposalContext) -> torch.Tensor:
        """``[K, V]`` every head's logits at the last committed token."""
        raise NotImplementedError

    def reset(self) -> None:
        """Stateless by default."""

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """``ctx.k`` drafts in a chain, or the tree of ``choices`` cut at depth ``ctx.k``."""
        if ctx.k <= 0:
            return DraftTree.empty(ctx.tokens.device)
        if ctx.k > self.max_drafts:
            raise ValueError(
                f"{ctx.k} drafts per round asked of {self.max_drafts} heads: use --k {self.max_drafts} or less"
            )
        logits = self.head_logits(ctx)[:, : ctx.vocab_size]  # [K, V]
        if self.choices is not None:
            top = logits.topk(min(top_k_needed(self.choices), logits.shape[-1]), dim=-1).indices  # [K, r]
            return tree_from_choices(self.choices, top, max_depth=ctx.k)
        drafts = [draw(logits[d], ctx) for d in range(ctx.k)]  # ([1] token, [V] or None) per head
        probs = torch.stack([p for _, p in drafts]) if ctx.temperature > 0 else None
        return DraftTree.chain(torch.cat([t for t, _ in drafts]), probs)


class MedusaProposer(ParallelHeadsProposer):
    """Medusa heads on the target's final normed hidden state (HF ``hidden_states[L]``)."""

    def __init__(self, heads, num_layers: int, choices: Sequence[Sequence[int]] | None = None) -> None:
        """
        Args:
            heads: trainer.drafters.medusa.MedusaHeads (eval mode is set here).
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
