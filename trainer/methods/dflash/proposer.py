"""DFlash proposers: a whole block drafted in one drafter forward, verified as a chain, or as a DDTree.

The proposer keeps the drafter's keys and values of every committed position's context (the target's hidden states
of the chosen layers, ``hidden_norm(fc(.))``, projected by each draft layer), extended each round by the positions
whose hidden states arrived with the round (the root and the accepted drafts of the last verification). A round then
runs one drafter forward over the block ``[root, mask x (b - 1)]`` at positions ``T - 1 .. T + b - 2``, every slot
seeing all cached context and the whole block; slot ``k`` drafts the token at ``T - 1 + k``, through the target's
lm_head. Nothing of the block is cached: the next round starts from the target's hidden states again.

:class:`DFlashProposer` verifies the first ``k`` slots as a chain: their argmax, or at a temperature a sample of
each slot's distribution with the distributions returned (the slots are drawn independently: each draft's
distribution is the one it was drawn from, as speculative sampling needs).

:class:`DFlashTreeProposer` builds a DDTree (Ringel and Romano, "Accelerating Speculative Decoding with Block
Diffusion Draft Trees") from the per-slot top-k of the same forward: a node at depth ``d`` is a choice of one of the
``top_k`` best tokens of slot ``d`` after its parent, scored by the sum of its path's log-probabilities (at
``rank_temperature``); a best-first heap takes the ``budget`` best prefixes, so every node's parent is taken before
it. The target verifies the tree with tree attention; at a temperature the tree is verified by speculative sampling
with deterministic (one-hot) candidates, which stays lossless.

A block refiner's proposer (refiner.py) subclasses :class:`DFlashProposer` and overrides its proposer step: with
``conditioned`` a slot's logits depend on the token drafted before it (:meth:`DFlashProposer.slot_logits`), so a
DDTree node's children are ranked by their slot's logits given the node's token, and :meth:`DFlashProposer.draft_chain`
drafts a chain (resolving the block left to right, each sampled draft's distribution the one it was drawn from given
the drafts before it: speculative sampling stays lossless) with the refiner's predicted acceptance of each draft,
:meth:`DFlashProposer.slot_acceptance`. A DFlash slot's logits are its own: the chain's drafts are independent.

Dynamic draft length (``ctx.accept_threshold`` above 0, trainer/decoding/proposers.py): both proposers estimate
acceptance (``estimates_acceptance``) and give every draft a ``confidence``, its predicted acceptance given that its
parent is accepted: a chain's from the refiner's prediction when it makes one, else the drafter's probability at
temperature 1 of its draft (of its top token for a sampled draft); a DDTree node's from the drafter's probability of
its token after its parent.

Drafting cost: ``blocks`` and ``draft_seconds`` count the drafter forwards (context extension included) of every
round since construction, so ``draft_seconds / blocks`` is the measured cost of one block.

``draftsmith eval --drafter PATH [--tree]``: PATH is a z-lab or speculators export, or a training checkpoint (drafter
kind ``dflash``, kind.py).
"""

from __future__ import annotations

import heapq
import time

import torch
import torch.nn.functional as F

from trainer.decoding.proposers import BaseProposer, ProposalContext
from trainer.decoding.tree import DraftTree, check_tree_search
from trainer.methods.dflash.module import KV, DFlashDrafter


class DFlashProposer(BaseProposer):
    """DFlash chain drafting: one block per round."""

    estimates_acceptance = True  # dynamic draft length: the refiner's prediction, else the drafter's probability

    def __init__(self, drafter: DFlashDrafter, embedding: torch.Tensor, lm_head: torch.Tensor) -> None:
        """
        Args:
            drafter: the trained drafter (eval mode is set here).
            embedding: the target's input embedding weight [V, H] (the block's ids are looked up in it).
            lm_head: the target's output weight [V, H].
        """
        self.drafter = drafter.eval()
        self.embedding, self.lm_head = embedding, lm_head
        c = drafter.config
        self.needs_hidden_states: tuple[int, ...] = tuple(c.target_layers)
        self.max_drafts = c.block_size - 1
        self.past: list[KV] | None = None  # per layer (k, v) [1, nkv, C, D] of the committed context
        self.blocks = 0
        self.draft_seconds = 0.0
        self.slot_hidden: torch.Tensor | None = None  # [b - 1, H] the last block's slot outputs (a refiner reads them)
        self.block_hidden: torch.Tensor | None = None  # [b, H] the same with the anchor slot's output first
        self.last_acceptance: torch.Tensor | None = None  # [k] predicted acceptance of the last chain's slots

    def reset(self) -> None:
        """A new sequence: drop the context cache (the cost counters keep counting)."""
        self.past = None
        self.last_acceptance = None

    def slot_acceptance(self) -> torch.Tensor | None:
        """A block refiner's predicted acceptance probability of each draft of the last chain proposed, [k] float32
        in [0, 1] (slot 1 first; each the probability that the target accepts that draft given the drafts before
        it), or None: the drafter predicts none, or no chain proposed yet in this sequence."""
        return self.last_acceptance

    def cached(self) -> int:
        return 0 if self.past is None else self.past[0][0].shape[2]

    def _sync(self) -> None:
        if self.embedding.device.type == "cuda":
            torch.cuda.synchronize(self.embedding.device)

    @torch.no_grad()
    def block_logits(self, ctx: ProposalContext) -> torch.Tensor:
        """Extend the context cache with the round's new positions, then draft the block: [b - 1, V] logits of
        slots 1..b-1 (the tokens at positions T .. T + b - 2)."""
        self._sync()
        started = time.perf_counter()
        tokens = ctx.tokens  # [T]
        T = tokens.numel()
        layers = self.needs_hidden_states
        if not ctx.hidden_states or any(i not in ctx.hidden_states for i in layers):
            raise ValueError(f"the DFlash proposer needs the target's hidden states of layers {layers}")
        n = ctx.hidden_states[layers[0]].shape[0]
        start = T - 1 - n  # position of the first new context entry
        if start != self.cached():
            raise RuntimeError(
                f"DFlash proposer: the target's hidden states start at position {start} but the context cache holds "
                f"{self.cached()} positions (a round without drafting lost some; call reset())"
            )
        drafter, device = self.drafter, tokens.device
        context = drafter.context([ctx.hidden_states[i][None] for i in layers])  # [1, n, H]
        new = drafter.context_kv(context, torch.arange(start, T - 1, device=device)[None])
        if self.past is None:
            self.past = new
        else:
            self.past = [(torch.cat([k, k2], 2), torch.cat([v, v2], 2)) for (k, v), (k2, v2) in zip(self.past, new)]
        b = drafter.config.block_size
        ids = drafter.block_ids(tokens[-1:])[None]  # [1, b]: the root, then mask ids
        embeds = F.embedding(ids, self.embedding).to(drafter.fc.weight.dtype)  # [1, b, H]
        out = drafter.draft(embeds, torch.arange(T - 1, T - 1 + b, device=device)[None], self.past)  # [1, b, H]
        self.block_hidden = out[0]  # [b, H]
        self.slot_hidden = out[0, 1:]  # [b - 1, H]
        logits = out[0, 1:] @ self.lm_head.t().to(out.dtype)  # [b - 1, V]
        self._sync()
        self.blocks += 1
        self.draft_seconds += time.perf_counter() - started
        return logits

    # ---- the block-refiner seam (refiner.py): a refiner's proposer overrides these; DFlash has no refiner -----------
    @property
    def conditioned(self) -> bool:
        """A slot's logits depend on the token drafted before it (:meth:`slot_logits`): not in DFlash."""
        return False

    def slot_logits(self, slot: int, prev: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Slot ``slot``'s logits [V] (0-based among the drafts) of the last block (``logits`` [k, V], from
        :meth:`block_logits`) given the token before it, ``prev`` (a [1] id): its own row in DFlash."""
        return logits[slot]

    def draft_chain(
        self, ctx: ProposalContext, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The chain of the block's first k slots (``logits`` [k, V]): ([k] drafts, [k, V] the distributions they
        were drawn from (None when greedy), [k, V] the logits their probabilities at temperature 1 are read from,
        [k] the predicted acceptance of each draft, or None). DFlash: each slot's argmax, or an independent sample
        of each slot's distribution at ``ctx.temperature``; no prediction."""
        if ctx.temperature <= 0:
            return logits.argmax(-1), None, logits, None  # [k]
        probs = torch.softmax(logits.float() / ctx.temperature, dim=-1)  # [k, V]
        tokens = torch.multinomial(probs, 1, generator=ctx.generator)[:, 0]  # [k]: one independent draw per slot
        return tokens, probs, logits, None

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """The first ``ctx.k`` slots of the block as a chain (:meth:`draft_chain`); with ``ctx.accept_threshold``
        above 0 each draft carries its predicted acceptance (``DraftTree.confidence``)."""
        logits = self.block_logits(ctx)[: ctx.k]  # [k, V]
        tokens, probs, logits, self.last_acceptance = self.draft_chain(ctx, logits)
        if getattr(ctx, "accept_threshold", 0.0) <= 0:
            return DraftTree.chain(tokens, probs)
        confidence = self.last_acceptance
        if confidence is None:  # the drafter's own probability of its draft (of its top token for a sampled one)
            p = torch.softmax(logits.float(), dim=-1)  # [k, V] at temperature 1
            confidence = p.amax(-1) if probs is not None else p.gather(-1, tokens[:, None])[:, 0]  # [k]
        return DraftTree.chain(tokens, probs, confidence=confidence)


class DFlashTreeProposer(DFlashProposer):
    """DDTree: a draft tree from the per-slot top-k of one DFlash forward."""

    def __init__(
        self,
        drafter: DFlashDrafter,
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
            budget: draft tokens in the tree (verified in one target forward).
            rank_temperature: temperature of the drafter's log-probabilities that score the paths.
        """
        super().__init__(drafter, embedding, lm_head)
        check_tree_search(top_k, budget, rank_temperature)
        self.top_k, self.budget, self.rank_temperature = top_k, budget, rank_temperature

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """The ``budget`` most probable prefixes of depth at most ``ctx.k``, best first."""
        logits = self.block_logits(ctx)[: ctx.k]  # [k, V]
        self.last_acceptance = None
        conditioned = self.conditioned
        width = min(self.top_k, logits.shape[-1])
        ranked: dict[tuple[int, int], tuple[list[float], list[int], list[float]]] = {}

        def children(d: int, prev: int) -> tuple[list[float], list[int], list[float]]:
            """The best ``width`` tokens of slot ``d`` after token ``prev`` (any token unless :attr:`conditioned`):
            their scores at ``rank_temperature``, ids, and probabilities at temperature 1 (their acceptance
            estimates)."""
            key = (d, prev if conditioned else -1)
            if key not in ranked:
                row = self.slot_logits(d, torch.tensor([prev], device=logits.device), logits)
                top = torch.topk(torch.log_softmax(row.float() / self.rank_temperature, dim=-1), width)
                p = torch.softmax(row.float(), dim=-1)[top.indices]  # [width]
                ranked[key] = (top.values.tolist(), top.indices.tolist(), p.tolist())
            return ranked[key]

        depth, root = logits.shape[0], int(ctx.tokens[-1])
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        # heap entries: (-score, tie-break, depth (0-based slot), rank, parent node, parent's score, parent's token)
        heap = [(-children(0, root)[0][0], 0, 0, 0, -1, 0.0, root)]
        counter = 1
        while heap and len(tokens) < self.budget:
            neg, _, d, r, parent, base, prev = heapq.heappop(heap)
            scores, ids, probs = children(d, prev)
            tokens.append(ids[r])
            parents.append(parent)
            confidence.append(probs[r])
            node, score = len(tokens) - 1, -neg
            if r + 1 < width:  # the next sibling
                heapq.heappush(heap, (-(base + scores[r + 1]), counter, d, r + 1, parent, base, prev))
                counter += 1
            if d + 1 < depth:  # the first child
                heapq.heappush(heap, (-(score + children(d + 1, ids[r])[0][0]), counter, d + 1, 0, node, score, ids[r]))
                counter += 1
        device = ctx.tokens.device
        tokens_t, parents_t = torch.tensor(tokens, device=device), torch.tensor(parents, device=device)
        if getattr(ctx, "accept_threshold", 0.0) <= 0:
            return DraftTree(tokens_t, parents_t)
        estimate = torch.tensor(confidence, dtype=torch.float32, device=device)  # [N]: the drafter's probabilities
        return DraftTree(tokens_t, parents_t, confidence=estimate)
