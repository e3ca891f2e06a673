"""XPress's proposer step: DFlash's chain and DDTree proposers (trainer/methods/dflash/proposer.py) with the block
resolved through the causal refiner (head.py).

After the block's one drafter forward, slot k's logits gain the refiner's bias, which depends on the tokens before slots
0..k of the block: the token before the root (slot 0's; the root itself at a sequence's start), the root (slot 1's) and
the drafts before slot k. A greedy chain is resolved as speculators' engine resolves it, by K parallel Jacobi passes
(``num_jacobi_passes``): the seed is the drafter's parallel argmax, and every pass recomputes every slot's bias from the
previous pass's drafts at once (one refiner pass over the block, no drafter forward); passes stop early at a fixed
point. The passes are the refiner's own (head.py ``jacobi``), whose first passes are training's free-running rounds: a
pass drafts from the logits a round trains. After pass j the first j drafts equal the left-to-right resolution (each
slot's argmax given the drafts before it), so K >= b - 1 always reaches it; fewer passes may leave later drafts
conditioned on an earlier pass's, which verification makes lossless all the same. A sampled chain is resolved left to
right, exactly: slot k is drawn from its refined distribution given the drafts before it, and that distribution is
returned (speculative sampling stays lossless). A DDTree ranks a node's children by their slot's refined logits given
the node's token, the slots before it taken from the block's greedy Jacobi chain (the tree verifies what it ranks, so
any ranking stays lossless).

``draftsmith eval --drafter PATH [--tree]``: PATH is an ``xpress`` export or a training checkpoint (drafter kind
``xpress``, kind.py).
"""

from __future__ import annotations

import torch

from trainer.decoding.proposers import ProposalContext
from trainer.methods.dflash.proposer import DFlashProposer, DFlashTreeProposer
from trainer.methods.xpress.module import XPressDrafter


class XPressProposer(DFlashProposer):
    """XPress chain drafting: one block per round, resolved by Jacobi passes (greedy) or left to right (sampled)."""

    drafter: XPressDrafter

    passes_run = 0
    """Jacobi passes run by the greedy chains since construction (early stops at a fixed point count less)."""
    _block_cache: tuple[int, torch.Tensor] | None = None

    @property
    def passes(self) -> int:
        """K, the Jacobi passes of a greedy chain: the drafter's ``num_jacobi_passes``."""
        return self.drafter.config.num_jacobi_passes

    @property
    def conditioned(self) -> bool:
        """A slot's logits depend on the drafts before it."""
        return True

    def _first(self, ctx_tokens: torch.Tensor) -> torch.Tensor:
        """[2] the token before the root (the root at a sequence's start) and the root: slots 0's and 1's previous
        tokens."""
        before = ctx_tokens[-2:-1] if ctx_tokens.numel() > 1 else ctx_tokens[-1:]
        return torch.cat([before, ctx_tokens[-1:]])

    def _cache(self) -> torch.Tensor:
        """The refiner's :meth:`~trainer.methods.xpress.head.XPressRefinerHead.hidden_cache` [b, 2r] of the last
        block, computed once per block."""
        if self._block_cache is None or self._block_cache[0] != self.blocks:
            self._block_cache = (self.blocks, self.drafter.refiner_head.hidden_cache(self.block_hidden))
        return self._block_cache[1]

    def refined(self, ctx_tokens: torch.Tensor, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The first k slots' refined logits [k, V] in at least float32 (``logits`` [k, V] the lm_head's) given
        ``drafts`` [>= k - 1] before them (slot k's bias reads the drafts before slot k only)."""
        return self.drafter.refiner_head.refine(logits, self._cache(), self._first(ctx_tokens), drafts)[2]

    def jacobi(self, ctx_tokens: torch.Tensor, logits: torch.Tensor, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy drafts [k] of the first k slots (``logits`` [k, V] the lm_head's) after ``passes`` Jacobi passes
        (the refiner's own, :meth:`~trainer.methods.xpress.head.XPressRefinerHead.jacobi`, which training's
        free-running rounds run; stopping at a fixed point), and the refined logits [k, V] of the last pass (the
        lm_head's with no pass)."""
        drafts, rows = logits.argmax(-1), logits  # [k], [k, V]: the seed, the drafter's parallel argmax
        for _, _, rows in self.drafter.refiner_head.jacobi(logits, self._cache(), self._first(ctx_tokens), passes):
            self.passes_run += 1
            new = rows.argmax(-1)  # [k]
            if torch.equal(new, drafts):
                break
            drafts = new
        return drafts, rows

    def sequential(
        self, ctx: ProposalContext, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The first k slots resolved left to right: each slot's draft the argmax (greedy) or a sample at
        ``ctx.temperature`` of its refined logits given the drafts before it. Returns the drafts [k], the
        distributions they were drawn from [k, V] (None when greedy) and the refined logits [k, V]."""
        k = logits.shape[0]
        drafts = torch.zeros(k, dtype=torch.long, device=logits.device)
        rows, dists = [], []
        for slot in range(k):
            row = self.refined(ctx.tokens, drafts[:slot], logits[: slot + 1])[slot]  # [V]
            if ctx.temperature <= 0:
                drafts[slot] = row.argmax()
            else:
                dists.append(torch.softmax(row.float() / ctx.temperature, dim=-1))  # [V]: drawn from, given before
                drafts[slot] = torch.multinomial(dists[-1], 1, generator=ctx.generator)[0]
            rows.append(row)
        return drafts, (torch.stack(dists) if dists else None), torch.stack(rows)

    def draft_chain(
        self, ctx: ProposalContext, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Greedy: K Jacobi passes; sampled: left to right (module docstring). No acceptance prediction."""
        if ctx.temperature <= 0:
            drafts, rows = self.jacobi(ctx.tokens, logits, self.passes)
            return drafts, None, rows, None
        drafts, dists, rows = self.sequential(ctx, logits)
        return drafts, dists, rows, None


class XPressTreeProposer(XPressProposer, DFlashTreeProposer):
    """DDTree over XPress's refiner: a node's children ranked by their slot's refined logits given the node's token,
    the slots before it from the block's greedy Jacobi chain."""

    _tokens: torch.Tensor | None = None
    _chain: tuple[int, torch.Tensor] | None = None

    @torch.no_grad()
    def propose(self, ctx: ProposalContext):
        self._tokens = ctx.tokens
        return super().propose(ctx)

    def slot_logits(self, slot: int, prev: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Slot ``slot``'s refined logits [V] given the token before it, ``prev`` (a [1] id), the drafts before that
        the block's greedy Jacobi chain's."""
        if self._chain is None or self._chain[0] != self.blocks:  # the chain of this round's block
            self._chain = (self.blocks, self.jacobi(self._tokens, logits, self.passes)[0])
        chain = self._chain[1]
        drafts = torch.cat([chain[: slot - 1], prev]) if slot > 0 else chain[:0]  # slot 0's prev is the root
        return self.refined(self._tokens, drafts, logits[: slot + 1])[slot]
