"""P-EAGLE proposer: K drafts in one drafter forward (peagle_module.py).

The drafter's cache holds the depth-0 element of every committed position, as EAGLE-3's proposer keeps it
(proposer.py): each round's forward appends the positions whose target hidden states arrived with the context and, in
the same forward, ``k - 1`` placeholders (``mask_hidden``, ``mask_token_id``) of the last one at positions
``T - 1 .. T + k - 3``. The last new entry's logits give draft 1 and placeholder ``d`` gives draft ``d + 1``; the
placeholders see the whole cache, the new entries and the placeholders before them (peagle_module.peagle_mask), and
are dropped after the round. The drafts of one round do not see each other's tokens (that is what makes them parallel):
greedy drafts are each depth's argmax, sampled ones are drawn from each depth's distribution, which speculative
sampling accepts losslessly as it does any draft distribution.
"""

from __future__ import annotations

import torch

from trainer.decoding.proposers import BaseProposer, ProposalContext
from trainer.decoding.tree import DraftTree
from trainer.methods.eagle3.peagle_module import PEagleDrafter


class PEagleProposer(BaseProposer):
    """P-EAGLE chain drafting, the whole chain in one forward."""

    def __init__(self, drafter: PEagleDrafter) -> None:
        """
        Args:
            drafter: the trained drafter (eval mode is set here); it drafts with its own trained embedding.
        """
        self.drafter = drafter.eval()
        self.needs_hidden_states: tuple[int, ...] = tuple(drafter.config.aux_layers)
        self.past: tuple[torch.Tensor, torch.Tensor] | None = None  # each [1, nkv, C, D]

    def reset(self) -> None:
        """A new sequence: drop the cache."""
        self.past = None

    def _cached(self) -> int:
        return 0 if self.past is None else self.past[0].shape[2]

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """``ctx.k`` drafts in a chain, from one forward over the new positions and ``k - 1`` placeholders."""
        drafter, layers = self.drafter, self.needs_hidden_states
        tokens = ctx.tokens  # [T]
        T = tokens.numel()
        if not ctx.hidden_states or any(i not in ctx.hidden_states for i in layers):
            raise ValueError(f"the P-EAGLE proposer needs the target's hidden states of layers {layers}")
        n = ctx.hidden_states[layers[0]].shape[0]
        start = T - 1 - n  # position of the first new entry
        C = self._cached()
        if start != C:
            raise RuntimeError(
                f"P-EAGLE proposer: the target's hidden states start at position {start} but the drafter's cache "
                f"holds {C} positions (a round without drafting lost some; call reset())"
            )
        fused = drafter.fuse([ctx.hidden_states[i][None] for i in layers])  # [1, n, H]
        embeds = drafter.embed_tokens(tokens[start + 1 : T][None]).to(fused.dtype)  # [1, n, H]
        positions = torch.arange(start, T - 1 + max(ctx.k - 1, 0), device=tokens.device)[None]  # [1, n + P]
        P = max(ctx.k - 1, 0)
        if P:
            place_embeds, place_fused = drafter.placeholder(P)  # [1, P, H] each
            embeds, fused = torch.cat([embeds, place_embeds], 1), torch.cat([fused, place_fused], 1)
        N = n + P
        allowed = torch.ones(N, C + N, dtype=torch.bool, device=tokens.device).tril(C)  # [N, C + N]
        _, logits, (k, v) = drafter(embeds, fused, positions, self.past, allowed)  # logits [1, N, Vd]
        k, v = k[:, :, :n], v[:, :, :n]  # the placeholders are not kept
        self.past = (k, v) if self.past is None else (torch.cat([self.past[0], k], 2), torch.cat([self.past[1], v], 2))
        if ctx.k <= 0:
            return DraftTree.empty(tokens.device)
        depth_logits = logits[0, n - 1 :]  # [k, Vd]
        if ctx.temperature <= 0:
            return DraftTree.chain(drafter.to_target_ids(depth_logits.argmax(-1)))
        p_draft = torch.softmax(depth_logits.float() / ctx.temperature, dim=-1)  # [k, Vd]
        drafts = torch.multinomial(p_draft, 1, generator=ctx.generator)[:, 0]  # [k]
        probs = p_draft.new_zeros(ctx.k, ctx.vocab_size)
        probs[:, drafter.draft_ids()] = p_draft  # [k, V]
        return DraftTree.chain(drafter.to_target_ids(drafts), probs)
