"""DSpark's proposer step: DFlash's chain and DDTree proposers (trainer/methods/dflash/proposer.py) with the block
resolved left to right through the heads (heads.py).

After the block's one drafter forward, slot ``k``'s logits gain the Markov bias of the token drafted at slot ``k - 1``
(the root for slot 1), so a chain's draft at slot k is the argmax, or a sample, of its biased logits, and the
returned distribution of a sampled draft is the one it was drawn from given the drafts before it (speculative
sampling stays lossless); a DDTree node's children are ranked by the biased logits of their slot given the node's
token. The confidence head's predicted acceptance of each drafted slot of the last chain is
:meth:`~trainer.methods.dflash.proposer.DFlashProposer.slot_acceptance`; with dynamic draft length it is each
draft's ``confidence`` (it reads the slot's output and the token before it, never the draft itself).

``draftsmith eval --drafter PATH [--tree]``: PATH is a ``dspark`` export or a training checkpoint (drafter kind
``dspark``, kind.py).
"""

from __future__ import annotations

import torch

from trainer.decoding.proposers import ProposalContext
from trainer.methods.dflash.proposer import DFlashProposer, DFlashTreeProposer
from trainer.methods.dspark.module import DSparkDrafter


class DSparkProposer(DFlashProposer):
    """DSpark chain drafting: one block per round, resolved left to right."""

    drafter: DSparkDrafter

    @property
    def conditioned(self) -> bool:
        """A slot's logits depend on the draft before it when the drafter has a Markov head."""
        return self.drafter.markov_head is not None

    def slot_logits(self, slot: int, prev: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Slot ``slot``'s Markov-biased logits [V] given the token before it, ``prev`` (a [1] id)."""
        if self.drafter.markov_head is None:
            return logits[slot]
        hidden = self.slot_hidden[slot : slot + 1]  # [1, H]
        return self.drafter.apply_heads(hidden, logits[slot : slot + 1].to(hidden.dtype), prev)[0][0]

    def draft_chain(
        self, ctx: ProposalContext, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The heads on the block: the drafts slot after slot (each Markov bias from the draft before), then the
        confidence head on all slots at once. Returns ([k] drafts, [k, V] the distributions they were drawn from (None
        when greedy), [k, V] the Markov-biased logits, [k] the predicted acceptance of each draft (None without a
        confidence head))."""
        markov = self.drafter.markov_head
        prev = ctx.tokens[-1:]  # [1]: slot 1 follows the root
        drafted, dists = [], []
        for slot in range(logits.shape[0]):
            row = logits[slot]  # [V]
            if markov is not None:
                row = row + markov.bias(markov.prev_embeddings(prev))[0].to(row.dtype)  # [V]
            if ctx.temperature <= 0:
                prev = row.argmax()[None]  # [1]
            else:
                dists.append(torch.softmax(row.float() / ctx.temperature, dim=-1))  # [V]: drawn from, given prev
                prev = torch.multinomial(dists[-1], 1, generator=ctx.generator)  # [1]
            drafted.append(prev)
        tokens = torch.cat(drafted)  # [k]
        prevs = torch.cat([ctx.tokens[-1:], tokens[:-1]])  # [k]: the token before each draft
        hidden = self.slot_hidden[: tokens.numel()]  # [k, H]
        rows, heads = self.drafter.apply_heads(hidden, logits.to(hidden.dtype), prevs)  # [k, V], [k] or None
        acceptance = None if heads is None else torch.sigmoid(heads.float())  # [k]
        return tokens, (torch.stack(dists) if dists else None), rows, acceptance


class DSparkTreeProposer(DSparkProposer, DFlashTreeProposer):
    """DDTree over DSpark's heads: a node's children ranked by their slot's logits given the node's token."""
