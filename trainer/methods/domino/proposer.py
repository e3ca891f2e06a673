"""Domino's proposer step: DFlash's chain proposer (trainer/methods/dflash/proposer.py) with the block resolved left
to right through the correction head (module.py).

After the block's one drafter forward, the GRU reads the root, then each draft as it is made: slot ``k``'s logits are
the backbone's plus the head's delta from the GRU's state after the root and the drafts of slots 1..k-1 (slots
1..pure_draft_prefix_len keep the backbone's alone), so a chain's draft at slot k is the argmax, or a sample, of its
corrected logits, and the returned distribution of a sampled draft is the one it was drawn from given the drafts
before it (speculative sampling stays lossless). The cost over DFlash is one GRU step and one ``[e, V]`` projection
per slot, never a drafter forward.

A DDTree (``--tree``) is not implemented for Domino: a node's logits depend on its whole path, not on its parent's
token alone, which the DDTree's per-slot ranking assumes; it is refused by name.

``draftsmith eval --drafter PATH``: PATH is a ``domino`` export or a training checkpoint (drafter kind ``domino``,
kind.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.decoding.proposers import ProposalContext
from trainer.interface.errors import UsageError
from trainer.methods.dflash.proposer import DFlashProposer, DFlashTreeProposer
from trainer.methods.domino.module import DominoDrafter


class DominoProposer(DFlashProposer):
    """Domino chain drafting: one block per round, resolved left to right through the head."""

    drafter: DominoDrafter

    def draft_chain(
        self, ctx: ProposalContext, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The drafts slot after slot, each slot's logits corrected by the GRU's state after the root and the drafts
        before it. Returns ([k] drafts, [k, V] the distributions they were drawn from (None when greedy), [k, V] the
        corrected logits, None: no acceptance prediction)."""
        drafter = self.drafter
        skip = drafter.config.pure_draft_prefix_len
        prev, state = ctx.tokens[-1:], None  # [1]: slot 1 follows the root
        drafted, dists, rows = [], [], []
        for slot in range(logits.shape[0]):
            embeds = F.embedding(prev[None], self.embedding)  # [1, 1, H]
            out, state = drafter.prefix_states(embeds, state)  # [1, 1, G], [1, 1, G]
            row = logits[slot]  # [V]
            if slot >= skip:  # slot k = slot + 1 > pure_draft_prefix_len
                hidden = self.slot_hidden[slot]  # [H]
                row = row + drafter.delta(drafter.features(hidden, out[0, 0])).to(row.dtype)  # [V]
            if ctx.temperature <= 0:
                prev = row.argmax()[None]  # [1]
            else:
                dists.append(torch.softmax(row.float() / ctx.temperature, dim=-1))  # [V]: drawn from, given prev
                prev = torch.multinomial(dists[-1], 1, generator=ctx.generator)  # [1]
            drafted.append(prev)
            rows.append(row)
        return torch.cat(drafted), (torch.stack(dists) if dists else None), torch.stack(rows), None


class DominoTreeProposer(DFlashTreeProposer):
    """Refused: a DDTree over Domino's head is not implemented (a node's logits depend on its whole path)."""

    def __init__(
        self,
        drafter: DominoDrafter,
        embedding: torch.Tensor,
        lm_head: torch.Tensor,
        top_k: int = 4,
        budget: int = 24,
        rank_temperature: float = 0.1,
    ) -> None:
        """
        Args:
            drafter: the trained drafter.
            embedding: the target's input embedding weight [V, H].
            lm_head: the target's output weight [V, H].
            top_k: the best tokens of each slot a node may branch to.
            budget: draft tokens in the tree.
            rank_temperature: temperature of the drafter's log-probabilities that score the paths.
        """
        raise UsageError(
            "--tree: a DDTree over Domino's correction head is not implemented (a node's logits depend on its whole "
            "path, not on its parent's token alone)",
            hint="draft Domino as a chain (drop --tree)",
        )
