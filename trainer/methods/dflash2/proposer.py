"""DFlash2's proposer step: DFlash's chain and DDTree proposers (trainer/methods/dflash/proposer.py) with the block
resolved left to right through the path selector (selector.py).

After the block's one drafter forward (its layers' convolutions inside it), slot ``k``'s logits are its top-k unary
candidates rescored given the token drafted at slot ``k - 1`` (the root for slot 1), every other token at -inf: a
greedy chain's draft at slot k is the best candidate given the draft before it (speculators' greedy selector path), a
sampled draft is drawn from the softmax of those scores and returned with that distribution (speculative sampling
stays lossless), and a DDTree node's children are ranked by their slot's scores given the node's token. The selector
costs one [K, r] product per slot, never a drafter forward.

``draftsmith eval --drafter PATH [--tree]``: PATH is a ``dflash2`` export or a training checkpoint (drafter kind
``dflash2``, kind.py).
"""

from __future__ import annotations

import torch

from trainer.decoding.proposers import ProposalContext
from trainer.methods.dflash.proposer import DFlashProposer, DFlashTreeProposer
from trainer.methods.dflash2.module import DFlash2Drafter


class DFlash2Proposer(DFlashProposer):
    """DFlash2 chain drafting: one block per round, resolved left to right through the selector."""

    drafter: DFlash2Drafter

    @property
    def conditioned(self) -> bool:
        """A slot's logits depend on the draft before it."""
        return True

    def slot_logits(self, slot: int, prev: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Slot ``slot``'s logits [V] given the token before it, ``prev`` (a [1] id): its top-k candidates rescored,
        the rest -inf."""
        hidden = self.slot_hidden[slot : slot + 1]  # [1, H]
        return self.drafter.candidate_selector.rescored(logits[slot : slot + 1], hidden, prev)[0]

    def draft_chain(
        self, ctx: ProposalContext, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, None]:
        """The drafts slot after slot, each from its slot's candidates given the draft before. Returns ([k] drafts,
        [k, V] the distributions they were drawn from (None when greedy), [k, V] the rescored logits, None: no
        predicted acceptance)."""
        prev = ctx.tokens[-1:]  # [1]: slot 1 follows the root
        drafted, dists, rows = [], [], []
        for slot in range(logits.shape[0]):
            row = self.slot_logits(slot, prev, logits)  # [V]
            if ctx.temperature <= 0:
                prev = row.argmax()[None]  # [1]
            else:
                dists.append(torch.softmax(row.float() / ctx.temperature, dim=-1))  # [V]: drawn from, given prev
                prev = torch.multinomial(dists[-1], 1, generator=ctx.generator)  # [1]
            drafted.append(prev)
            rows.append(row)
        return torch.cat(drafted), (torch.stack(dists) if dists else None), torch.stack(rows), None


class DFlash2TreeProposer(DFlash2Proposer, DFlashTreeProposer):
    """DDTree over DFlash2's selector: a node's children ranked by their slot's candidates given the node's token."""
