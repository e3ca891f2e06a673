"""EAGLE-3 proposers: chain drafting and an EAGLE-2 dynamic draft tree, with the drafter's own KV cache.

The drafter's cache holds one entry per committed position ``p`` (the fused target features of token ``p`` with the
embedding of token ``p + 1``), always computed from the target's features: each round appends the positions whose
target hidden states arrived with the context (the root and the accepted drafts of the last round). Drafts of a round
are extra entries at positions ``T - 2 + depth`` that see the cache, their ancestors and themselves (the attention of
training-time test), and are dropped at the end of the round.

:class:`Eagle3Proposer` drafts a chain of ``k`` greedy tokens (or sampled ones, with their distributions, at a
temperature). :class:`Eagle3TreeProposer` grows a tree the EAGLE-2 way: the root's ``top_k`` children, then at
every depth the ``top_k`` most probable (cumulative draft log-probability) new nodes are expanded, ``top_k`` children
each; finally the ``budget`` best nodes of all are kept (an ancestor always scores at least as well as its
descendants). Greedy verification with tree attention keeps it lossless; at a temperature the tree proposer drafts a
sampled chain instead.

The ranking scores use the drafter's log-probabilities at ``rank_temperature`` (default 0.1), not at 1. Greedy
verification accepts a node when it is the target's argmax; the drafter learned the target's distribution, whose
entropy says little about that: a high-entropy target whose argmax is nearly certain gets low top-1 probabilities
and high sibling ones, so at temperature 1 the budget goes to width; a low temperature keeps the likeliest path
inside the budget.

Dynamic draft length (``ctx.accept_threshold``): a node's estimate is the drafter's probability (at temperature 1) of
its token (a sampled draft: the top probability of the distribution it is drawn from), a path's the product of its
nodes'. The chain stops drafting, and the tree stops expanding, where it falls under the threshold, which saves the
drafter's forwards as well as the target's verification of unlikely drafts; the tree keeps its ``budget`` best nodes
among those above it.

``draftsmith eval --drafter PATH [--tree]``: PATH is a native or speculators export, or a training checkpoint (the
drafter kind ``eagle3``, kind.py).
"""

from __future__ import annotations

import torch

from trainer.decoding.proposers import BaseProposer, ChainCut, ProposalContext, draft_confidence
from trainer.decoding.tree import DraftTree, check_tree_search
from trainer.methods.eagle3.module import Eagle3Drafter


def new_positions(
    drafter: Eagle3Drafter, embedding: torch.nn.Module, ctx: ProposalContext, cached: int, method: str
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The positions of the context the drafter's cache does not hold yet (those whose target hidden states arrived
    with ``ctx``), as the drafter's inputs; shared by the proposers of EAGLE-3 and of the methods extending it.

    Args:
        drafter: the drafter (its ``fuse`` and its target layers, ``config.aux_layers``).
        embedding: token ids -> input embeddings (the target's, or a drafter's own).
        ctx: the round's context: ``tokens`` [T] and the hidden states of the target layers, [n, Ht] each, of
            positions ``T - 1 - n .. T - 2``.
        cached: the positions the drafter's cache holds, which must be the first new one.
        method: the method named in errors.

    Returns:
        (start, fused [1, n, H], embeds [1, n, H]): the first new position, the fused features of positions
        ``start .. T - 2`` and the embeddings of the tokens one ahead of them.
    """
    tokens = ctx.tokens  # [T]
    T = tokens.numel()
    layers = tuple(drafter.config.aux_layers)
    if not ctx.hidden_states or any(i not in ctx.hidden_states for i in layers):
        raise ValueError(f"the {method} proposer needs the target's hidden states of layers {layers}")
    n = ctx.hidden_states[layers[0]].shape[0]
    start = T - 1 - n  # position of the first new entry
    if start != cached:
        raise RuntimeError(
            f"{method} proposer: the target's hidden states start at position {start} but the drafter's cache "
            f"holds {cached} positions (a round without drafting lost some; call reset())"
        )
    fused = drafter.fuse([ctx.hidden_states[i][None] for i in layers])  # [1, n, H]
    embeds = embedding(tokens[start + 1 : T][None]).to(fused.dtype)  # [1, n, H]
    return start, fused, embeds


class _Eagle3Base(BaseProposer):
    """Shared state: the drafter, the target's embedding and the drafter's cache of committed positions."""

    estimates_acceptance = True

    def __init__(self, drafter: Eagle3Drafter, embedding: torch.nn.Module) -> None:
        """
        Args:
            drafter: the trained drafter (eval mode is set here).
            embedding: the target's input embedding.
        """
        self.drafter = drafter.eval()
        self.embedding = embedding
        self.needs_hidden_states: tuple[int, ...] = tuple(drafter.config.aux_layers)
        self.past: tuple[torch.Tensor, torch.Tensor] | None = None  # each [1, nkv, C, D]

    def reset(self) -> None:
        """A new sequence: drop the cache."""
        self.past = None

    def _cached(self) -> int:
        return 0 if self.past is None else self.past[0].shape[2]

    def _extend(self, ctx: ProposalContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the context's new positions to the cache; the last one's output feature [1, 1, H] and logits
        [Vd]."""
        start, fused, embeds = new_positions(self.drafter, self.embedding, ctx, self._cached(), "EAGLE-3")
        positions = torch.arange(start, ctx.tokens.numel() - 1, device=ctx.tokens.device)[None]  # [1, n]
        out, logits, (k, v) = self.drafter(embeds, fused, positions, self.past)
        self.past = (k, v) if self.past is None else (torch.cat([self.past[0], k], 2), torch.cat([self.past[1], v], 2))
        return out[:, -1:], logits[0, -1]

    def _step(
        self,
        tokens: torch.Tensor,
        feats: torch.Tensor,
        position: int,
        round_kv: tuple[torch.Tensor, torch.Tensor] | None,
        ancestors: torch.Tensor | None,
        round_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Draft entries for N nodes at one depth. tokens: [N] target ids; feats: [1, N, H] their parents' outputs;
        round_kv: earlier draft entries [1, nkv, M, D] each; ancestors: [N, M] bool (which of them each node sees);
        round_positions: [M] the earlier draft entries' rotary positions (which the drafter's window reads; the
        cache's entries sit at 0..C-1). Returns out [1, N, H], logits [N, Vd] and the new entries."""
        assert self.past is not None
        N = tokens.numel()
        C = self._cached()
        M = 0 if round_kv is None else round_kv[0].shape[2]
        embeds = self.embedding(tokens[None]).to(feats.dtype)  # [1, N, H]
        positions = torch.full((1, N), position, dtype=torch.long, device=tokens.device)  # [1, N]
        past_k = self.past[0] if round_kv is None else torch.cat([self.past[0], round_kv[0]], 2)
        past_v = self.past[1] if round_kv is None else torch.cat([self.past[1], round_kv[1]], 2)
        allowed = torch.zeros(N, C + M + N, dtype=torch.bool, device=tokens.device)  # [N, C + M + N]
        allowed[:, :C] = True
        if M:
            allowed[:, C : C + M] = ancestors
        allowed[:, C + M :] = torch.eye(N, dtype=torch.bool, device=tokens.device)
        key_positions = torch.cat(
            [
                torch.arange(C, device=tokens.device),
                *([] if round_positions is None else [round_positions]),
                positions[0],
            ]
        )  # [C + M + N]
        out, logits, kv = self.drafter(embeds, feats, positions, (past_k, past_v), allowed, key_positions)
        return out, logits[0], kv

    def _chain(self, ctx: ProposalContext, feat: torch.Tensor, logits: torch.Tensor) -> DraftTree:
        """``ctx.k`` drafts along the most probable (or sampled) path."""
        T = ctx.tokens.numel()
        drafts, probs = [], []
        round_kv = None
        cut = ChainCut(ctx.accept_threshold)
        for depth in range(1, ctx.k + 1):
            if cut.active and not cut.admit(draft_confidence(logits)):  # the argmax's probability
                break
            if ctx.temperature > 0:
                p_draft = torch.softmax(logits.float() / ctx.temperature, dim=-1)  # [Vd]
                d = torch.multinomial(p_draft, 1, generator=ctx.generator)  # [1]
                p = p_draft.new_zeros(ctx.vocab_size).index_add_(0, self.drafter.draft_ids(), p_draft)  # [V]
                probs.append(p)
            else:
                d = logits.argmax()[None]  # [1]
            token = self.drafter.to_target_ids(d)  # [1]
            drafts.append(token)
            if depth == ctx.k:
                break
            M = 0 if round_kv is None else round_kv[0].shape[2]
            ancestors = torch.ones(1, M, dtype=torch.bool, device=token.device)
            round_positions = torch.arange(T - 1, T - 2 + depth, device=token.device)  # [M]: one entry per depth
            feat, step_logits, kv = self._step(token, feat, T - 2 + depth, round_kv, ancestors, round_positions)
            round_kv = (
                kv if round_kv is None else (torch.cat([round_kv[0], kv[0]], 2), torch.cat([round_kv[1], kv[1]], 2))
            )
            logits = step_logits[0]
        if not drafts:
            return DraftTree.empty(ctx.tokens.device)
        return DraftTree.chain(torch.cat(drafts), torch.stack(probs) if probs else None, confidence=cut.confidence())


class Eagle3Proposer(_Eagle3Base):
    """EAGLE-3 chain drafting."""

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """``ctx.k`` drafts in a chain."""
        feat, logits = self._extend(ctx)
        if ctx.k <= 0:
            return DraftTree.empty(ctx.tokens.device)
        return self._chain(ctx, feat, logits)


class Eagle3TreeProposer(_Eagle3Base):
    """EAGLE-3 with an EAGLE-2 dynamic draft tree (greedy); a sampled chain at a temperature."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        embedding: torch.nn.Module,
        top_k: int = 4,
        budget: int = 24,
        rank_temperature: float = 0.1,
    ) -> None:
        """
        Args:
            drafter: the trained drafter.
            embedding: the target's input embedding.
            top_k: children per expanded node, and nodes expanded per depth.
            budget: draft tokens kept in the tree (verified in one target forward).
            rank_temperature: temperature of the drafter's log-probabilities that rank the nodes (1 is EAGLE-2's
                ranking; lower spends the budget on depth where the drafter's argmax is clear, see the module doc).
        """
        super().__init__(drafter, embedding)
        check_tree_search(top_k, budget, rank_temperature)
        self.top_k, self.budget, self.rank_temperature = top_k, budget, rank_temperature

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """A tree of at most ``budget`` nodes and depth ``ctx.k``."""
        feat, logits = self._extend(ctx)
        if ctx.k <= 0:
            return DraftTree.empty(ctx.tokens.device)
        if ctx.temperature > 0:
            return self._chain(ctx, feat, logits)
        device = ctx.tokens.device
        T = ctx.tokens.numel()
        # every node: target token, parent node (-1 root), cumulative log-probability, depth, draft entry (or -1)
        tok: list[int] = []
        parent: list[int] = []
        score: list[float] = []
        depth: list[int] = []
        entry: list[int] = []
        conf: list[float] = []  # probability of the node's token (the acceptance estimate)
        path: list[float] = []  # product of conf from the root's child down to the node
        threshold = ctx.accept_threshold

        def add_children(par: int, base: float, logits_: torch.Tensor, d: int) -> list[int]:
            log_p = torch.log_softmax(logits_.float() / rank, -1)  # [Vd]
            top = torch.topk(log_p, min(self.top_k, log_p.numel()))
            ids = self.drafter.to_target_ids(top.indices).tolist()
            p1 = draft_confidence(logits_, top.indices).tolist() if threshold > 0 else [1.0] * len(ids)
            new = []
            for t, s, c in zip(ids, top.values.tolist(), p1):
                tok.append(t), parent.append(par), score.append(base + s), depth.append(d), entry.append(-1)
                conf.append(c), path.append(c * (1.0 if par < 0 else path[par]))
                new.append(len(tok) - 1)
            return new

        rank = self.rank_temperature
        candidates = add_children(-1, 0.0, logits, 1)
        feats = {-1: feat}  # node -> [1, 1, H] output feature of its entry (-1: the root's)
        round_kv = None
        round_positions = torch.zeros(0, dtype=torch.long, device=device)  # [M] the round's entries' positions
        for d in range(1, ctx.k):
            # a node under the threshold is cut, and its children would be too: it is not expanded
            alive = [n for n in candidates if path[n] >= threshold]
            frontier = sorted(alive, key=lambda n: -score[n])[: self.top_k]
            if not frontier:
                break
            M = 0 if round_kv is None else round_kv[0].shape[2]
            ancestors = torch.zeros(len(frontier), M, dtype=torch.bool, device=device)  # [N, M]
            for row, node in enumerate(frontier):
                a = parent[node]
                while a >= 0:
                    ancestors[row, entry[a]] = True
                    a = parent[a]
            tokens = torch.tensor([tok[n] for n in frontier], device=device)  # [N]
            parent_feats = torch.cat([feats[parent[n]] for n in frontier], dim=1)  # [1, N, H]
            out, step_logits, kv = self._step(tokens, parent_feats, T - 2 + d, round_kv, ancestors, round_positions)
            round_positions = torch.cat([round_positions, torch.full((len(frontier),), T - 2 + d, device=device)])
            round_kv = (
                kv if round_kv is None else (torch.cat([round_kv[0], kv[0]], 2), torch.cat([round_kv[1], kv[1]], 2))
            )
            candidates = []
            for row, node in enumerate(frontier):
                entry[node] = M + row
                feats[node] = out[:, row : row + 1]
                candidates += add_children(node, score[node], step_logits[row], d + 1)  # step_logits [N, Vd]
        # keep the best `budget` nodes (above the threshold); ties favour shallower nodes, so a parent always precedes
        # its children
        ranked = sorted((n for n in range(len(tok)) if path[n] >= threshold), key=lambda n: (-score[n], depth[n], n))
        chosen: set[int] = set()
        for n in ranked:
            if len(chosen) == self.budget:
                break
            if parent[n] < 0 or parent[n] in chosen:
                chosen.add(n)
        if not chosen:
            return DraftTree.empty(device)
        order = sorted(chosen, key=lambda n: (depth[n], n))
        index = {n: i for i, n in enumerate(order)}
        tokens = torch.tensor([tok[n] for n in order], dtype=torch.long, device=device)
        parents = torch.tensor([index[parent[n]] if parent[n] >= 0 else -1 for n in order], device=device)
        confidence = torch.tensor([conf[n] for n in order], dtype=torch.float64) if threshold > 0 else None
        return DraftTree(tokens=tokens, parents=parents, confidence=confidence)
