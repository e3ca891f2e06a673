"""P-EAGLE proposer: K drafts in one drafter forward (module.py), as a chain or a tree.

The drafter's cache holds the depth-0 element of every committed position in each decoder layer, as EAGLE-3's proposer
keeps it (trainer/methods/eagle3/proposer.py): each round's forward appends the positions whose target hidden states
arrived with the context and, in the same forward, ``k - 1`` placeholders (``mask_hidden``, ``mask_token_id``) of the
last one at positions ``T - 1 .. T + k - 3``. The last new entry's logits give draft 1 and placeholder ``d`` gives
draft ``d + 1``; the placeholders see the whole cache, the new entries and the placeholders before them
(module.peagle_mask), and are dropped after the round.

The drafts of one round do not see each other's tokens (that is what makes them parallel), so depth ``d``'s
distribution is that of a parallel head: the round is drafted as Medusa's and the MTP heads' are
(trainer/decoding/heads_proposer.py), from the depths' logits over the target's vocabulary (the draft vocabulary's
logits in place, every other token at minus infinity). Greedy drafts are each depth's argmax, sampled ones are drawn
from each depth's distribution (speculative sampling accepts them losslessly); with ``choices`` the round is the tree
of those top-k paths; with ``ctx.accept_threshold`` every draft carries its depth's probability of it, from which the
engine cuts the round (dynamic draft length; the forward is one either way, so the cut saves verification).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.decoding.heads_proposer import ParallelHeadsProposer
from trainer.decoding.proposers import ProposalContext
from trainer.decoding.tree import DraftTree
from trainer.methods.eagle3.proposer import new_positions
from trainer.methods.peagle.module import PEagleDrafter


class PEagleProposer(ParallelHeadsProposer):
    """P-EAGLE drafting, a round's chain or tree from one drafter forward."""

    drafters_name = "trained depths"

    def __init__(self, drafter: PEagleDrafter, depths: int, choices: Sequence[Sequence[int]] | None = None) -> None:
        """
        Args:
            drafter: the trained drafter (eval mode is set here); it drafts with its own trained embedding.
            depths: K, the drafts per forward it was trained for (the most a round drafts).
            choices: tree paths of per-depth top-k ranks (``medusa_choices``), or None for the chain.
        """
        super().__init__(drafter.config.aux_layers[0], depths, choices)
        self.drafter = drafter.eval()
        self.needs_hidden_states = tuple(drafter.config.aux_layers)
        self.past: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per decoder layer, each [1, nkv, C, D]
        self.depth_logits: torch.Tensor | None = None  # [k, V] of the round being drafted

    def reset(self) -> None:
        """A new sequence: drop the cache."""
        self.past = None

    def _cached(self) -> int:
        return 0 if self.past is None else self.past[0][0].shape[2]

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """``ctx.k`` drafts (a chain, or the tree of ``choices`` cut at depth ``ctx.k``) from one forward over the new
        positions and ``k - 1`` placeholders; a round of ``k = 0`` still brings the cache up to date."""
        self.depth_logits = self._forward(ctx)
        return super().propose(ctx)

    def head_logits(self, ctx: ProposalContext) -> torch.Tensor:
        """``[k, V]`` the round's depth logits over the target's vocabulary (computed by :meth:`propose`)."""
        assert self.depth_logits is not None, "head_logits is read inside propose"
        return self.depth_logits

    def _forward(self, ctx: ProposalContext) -> torch.Tensor | None:
        """Append the new positions to the cache and return the ``[k, V]`` depth logits (None when ``k = 0``)."""
        drafter, tokens = self.drafter, ctx.tokens  # [T]
        T = tokens.numel()
        start, fused, embeds = new_positions(drafter, drafter.embed_tokens, ctx, self._cached(), "P-EAGLE")
        n = fused.shape[1]
        P = max(ctx.k - 1, 0)
        positions = torch.arange(start, T - 1 + P, device=tokens.device)[None]  # [1, n + P]
        if P:
            place_embeds, place_fused = drafter.placeholder(P)  # [1, P, H] each
            embeds, fused = torch.cat([embeds, place_embeds], 1), torch.cat([fused, place_fused], 1)
        _, logits, new = drafter(embeds, fused, positions, self.past)  # causal after the cache; logits [1, n + P, Vd]
        new = [(k[:, :, :n], v[:, :, :n]) for k, v in new]  # the placeholders are not kept
        self.past = (
            new
            if self.past is None
            else [
                (torch.cat([k0, k], 2), torch.cat([v0, v], 2)) for (k0, v0), (k, v) in zip(self.past, new, strict=True)
            ]
        )
        if ctx.k <= 0:
            return None
        depth_logits = logits[0, n - 1 :]  # [k, Vd]
        full = depth_logits.new_full((ctx.k, ctx.vocab_size), float("-inf"))  # [k, V]
        full[:, drafter.draft_ids()] = depth_logits
        return full
