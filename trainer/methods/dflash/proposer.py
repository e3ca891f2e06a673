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
from trainer.decoding.tree import DraftTree
from trainer.methods.dflash.module import KV, DFlashDrafter


class DFlashProposer(BaseProposer):
    """DFlash chain drafting: one block per round."""

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

    def reset(self) -> None:
        """A new sequence: drop the context cache (the cost counters keep counting)."""
        self.past = None

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
        logits = out[0, 1:] @ self.lm_head.t().to(out.dtype)  # [b - 1, V]
        self._sync()
        self.blocks += 1
        self.draft_seconds += time.perf_counter() - started
        return logits

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """The first ``ctx.k`` slots of the block as a chain."""
        logits = self.block_logits(ctx)[: ctx.k]  # [k, V]
        if ctx.temperature <= 0:
            return DraftTree.chain(logits.argmax(-1))
        probs = torch.softmax(logits.float() / ctx.temperature, dim=-1)  # [k, V]
        tokens = torch.multinomial(probs, 1, generator=ctx.generator)[:, 0]  # [k]: one independent draw per slot
        return DraftTree.chain(tokens, probs)


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
        if top_k < 1 or budget < 1:
            raise ValueError(f"top_k and budget must be >= 1, got top_k={top_k}, budget={budget}")
        if rank_temperature <= 0:
            raise ValueError(f"rank_temperature must be > 0, got {rank_temperature}")
        self.top_k, self.budget, self.rank_temperature = top_k, budget, rank_temperature

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """The ``budget`` most probable prefixes of depth at most ``ctx.k``, best first."""
        logits = self.block_logits(ctx)[: ctx.k]  # [k, V]
        log_p = torch.log_softmax(logits.float() / self.rank_temperature, dim=-1)  # [k, V]
        top = torch.topk(log_p, min(self.top_k, log_p.shape[-1]), dim=-1)
        scores, ids = top.values.tolist(), top.indices.tolist()  # [k][top_k]
        depth, width = len(scores), len(scores[0])
        tokens: list[int] = []
        parents: list[int] = []
        # heap entries: (-score, tie-break, depth (0-based slot), rank, parent node, parent's score)
        heap = [(-scores[0][0], 0, 0, 0, -1, 0.0)]
        counter = 1
        while heap and len(tokens) < self.budget:
            neg, _, d, r, parent, base = heapq.heappop(heap)
            tokens.append(ids[d][r])
            parents.append(parent)
            node, score = len(tokens) - 1, -neg
            if r + 1 < width:  # the next sibling
                heapq.heappush(heap, (-(base + scores[d][r + 1]), counter, d, r + 1, parent, base))
                counter += 1
            if d + 1 < depth:  # the first child
                heapq.heappush(heap, (-(score + scores[d + 1][0]), counter, d + 1, 0, node, score))
                counter += 1
        device = ctx.tokens.device
        return DraftTree(torch.tensor(tokens, device=device), torch.tensor(parents, device=device))
