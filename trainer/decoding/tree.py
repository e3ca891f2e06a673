"""Draft trees: candidates for one verification forward, their ancestor-only attention mask and positions.

A tree holds N draft tokens. Node ``i`` has a parent ``parents[i]`` that is either ``-1`` (the root: the last
committed token, which the target has not yet seen) or an earlier node (``parents[i] < i``). The target verifies the
root and all nodes in one forward pass over ``[root, node_0, ..., node_{N-1}]``: input index ``i + 1`` is node ``i``.
Each input attends to the cached context and to its own ancestors only, at position ``cache_length + depth``.
A chain (``parents[i] == i - 1``) is the tree of width 1: plain speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """The drafts of one round.

    Attributes:
        tokens: ``[N]`` draft token ids.
        parents: ``[N]`` parent node of every node, ``-1`` for the children of the root; ``parents[i] < i``.
        probs: ``[N, V]`` the distribution each node was drawn from (its siblings before it taken into account), used
            by speculative sampling; ``None`` for deterministic drafts (a one-hot distribution on the token).
        verify_layer: the target layer the verification starts at: 0 (all layers, from the token ids), or E > 0
            for a proposer that ran the round's tokens through the target's layers ``[0, E)`` itself.
        verify_hidden: with ``verify_layer`` E > 0, ``[m + N, H]`` the hidden states entering layer E of the round's
            pending tokens and of every node, in input order.
        confidence: ``[N]`` the proposer's predicted probability that node i is accepted given that its parent is
            (the root's children: unconditionally), or ``None`` (no estimate). The product along a path is the
            path's predicted acceptance, which :meth:`cut` compares with a threshold (dynamic draft length, see
            trainer/decoding/proposers.py). A sampled node's value must not depend on the token drawn for it.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None
    verify_layer: int = 0
    verify_hidden: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = self.tokens.to(torch.long).flatten()
        self.parents = self.parents.to(torch.long).flatten()
        n = self.tokens.numel()
        if self.parents.numel() != n:
            raise ValueError(f"a draft tree needs one parent per token: {n} tokens, {self.parents.numel()} parents")
        index = torch.arange(n, device=self.parents.device)
        if n and bool(((self.parents < -1) | (self.parents >= index)).any()):
            raise ValueError(f"tree parents must satisfy -1 <= parents[i] < i, got {self.parents.tolist()}")
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != n):
            raise ValueError(f"draft probs must be [N={n}, V], got {tuple(self.probs.shape)}")
        if self.verify_layer < 0 or (self.verify_layer > 0) != (self.verify_hidden is not None):
            raise ValueError("verify_hidden is given exactly when verify_layer > 0")
        if self.confidence is not None:
            self.confidence = self.confidence.flatten()
            if self.confidence.numel() != n:
                raise ValueError(f"a draft tree needs one confidence per node: {n} nodes, {self.confidence.numel()}")

    @classmethod
    def chain(
        cls,
        tokens: torch.Tensor,
        probs: torch.Tensor | None = None,
        verify_layer: int = 0,
        verify_hidden: torch.Tensor | None = None,
        confidence: torch.Tensor | None = None,
    ) -> DraftTree:
        """A chain of drafts: node i is the child of node i - 1 (the first one of the root)."""
        tokens = tokens.to(torch.long).flatten()  # [K]
        parents = torch.arange(tokens.numel(), device=tokens.device) - 1  # [K]
        return cls(tokens, parents, probs, verify_layer, verify_hidden, confidence)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> DraftTree:
        """No drafts: the round is a plain decoding step of the target."""
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls(tokens=none, parents=none.clone())

    @property
    def num_nodes(self) -> int:
        """Number of draft tokens N."""
        return self.tokens.numel()

    def is_chain(self) -> bool:
        """True when the tree is a chain (width 1), including the empty tree."""
        expected = torch.arange(self.num_nodes, device=self.parents.device) - 1
        return bool((self.parents == expected).all())

    def depths(self) -> torch.Tensor:
        """``[N]`` depth of every node, 1 for the children of the root."""
        depth = [0] * self.num_nodes
        for i, parent in enumerate(self.parents.tolist()):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        return torch.tensor(depth, dtype=torch.long, device=self.tokens.device)

    def max_depth(self) -> int:
        """Depth of the deepest node (0 for the empty tree): the most drafts one round can accept."""
        return int(self.depths().max()) if self.num_nodes else 0

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to ``node`` (empty for ``node == -1``, the root)."""
        path = []
        parents = self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def children(self) -> list[list[int]]:
        """Children of every input index (0: the root, i + 1: node i), in node order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, parent in enumerate(self.parents.tolist()):
            kids[parent + 1].append(i)
        return kids

    def path_confidence(self) -> torch.Tensor:
        """``[N]`` the predicted acceptance of the path to every node: the product of ``confidence`` from the root's
        child down to it (``confidence`` must be set)."""
        if self.confidence is None:
            raise ValueError("this draft tree has no confidence")
        conf = self.confidence.double().clamp(0.0, 1.0).tolist()
        path = [0.0] * self.num_nodes
        for i, parent in enumerate(self.parents.tolist()):
            path[i] = conf[i] * (1.0 if parent < 0 else path[parent])
        return torch.tensor(path, dtype=torch.float64)

    def cut(self, threshold: float) -> DraftTree:
        """The nodes whose path's predicted acceptance (:meth:`path_confidence`) is at least ``threshold``: a chain
        stops before its first draft below it, a tree loses the subtrees below it. The kept nodes are closed under
        parents (a node never scores above its parent); with sampled nodes (``probs``) a node is also dropped when a
        sibling before it is, since its distribution took that sibling into account. Unchanged without
        ``confidence`` or with ``threshold`` 0. Speculative verification of the result stays lossless: a node's
        presence depends on the drafter's estimates only, never on the token drawn for it."""
        if self.confidence is None or threshold <= 0 or not self.num_nodes:
            return self
        if self.verify_layer > 0:
            raise ValueError("a tree verified from an inner layer wrote its nodes to the target's cache: not cut here")
        path = self.path_confidence().tolist()
        keep = [False] * self.num_nodes
        sibling_cut: set[int] = set()  # parents with a dropped child
        for i, parent in enumerate(self.parents.tolist()):
            keep[i] = (parent < 0 or keep[parent]) and path[i] >= threshold
            if self.probs is not None and parent in sibling_cut:
                keep[i] = False
            if not keep[i]:
                sibling_cut.add(parent)
        kept = [i for i in range(self.num_nodes) if keep[i]]
        if len(kept) == self.num_nodes:
            return self
        index = {n: j for j, n in enumerate(kept)}
        rows = torch.tensor(kept, dtype=torch.long, device=self.tokens.device)  # [N']
        parents = [index[p] if p >= 0 else -1 for p in self.parents[rows].tolist()]
        return DraftTree(
            tokens=self.tokens[rows],
            parents=torch.tensor(parents, dtype=torch.long, device=self.tokens.device),
            probs=None if self.probs is None else self.probs[rows.to(self.probs.device)],
            confidence=self.confidence[rows.to(self.confidence.device)],
        )

    def ancestor_mask(self) -> torch.Tensor:
        """``[N + 1, N + 1]`` boolean, True where input i may attend to input j (j is i or one of its ancestors)."""
        n = self.num_nodes + 1
        mask = torch.eye(n, dtype=torch.bool, device=self.tokens.device)  # [N + 1, N + 1]
        mask[:, 0] = True  # everyone sees the root
        for i, parent in enumerate(self.parents.tolist()):
            mask[i + 1] |= mask[parent + 1]  # parents come first, so their rows are complete
        return mask

    def position_ids(self, cache_len: int, pending: int = 1) -> torch.Tensor:
        """``[1, pending + N]`` positions of the pending tokens (the root last) and of the nodes after the cache."""
        device = self.tokens.device
        before = cache_len + torch.arange(pending, device=device)  # [pending]
        return torch.cat([before, cache_len + pending - 1 + self.depths()])[None]

    def attention_mask(self, cache_len: int, dtype: torch.dtype, pending: int = 1) -> torch.Tensor:
        """``[1, 1, pending + N, cache_len + pending + N]`` additive mask (0 where allowed, the dtype's minimum else).

        The pending tokens (committed but not yet cached, the root last) attend causally; every node attends to the
        cache, to all pending tokens and to its ancestors. An additive float mask works with both the eager and the
        SDPA attention of HF models, which pass a 4D mask through unchanged.
        """
        device = self.tokens.device
        n, m = self.num_nodes, pending
        allowed = torch.zeros(m + n, cache_len + m + n, dtype=torch.bool, device=device)
        allowed[:, :cache_len] = True
        allowed[:m, cache_len : cache_len + m] = torch.ones(m, m, dtype=torch.bool, device=device).tril()
        allowed[m:, cache_len : cache_len + m] = True
        allowed[m:, cache_len + m :] = self.ancestor_mask()[1:, 1:]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]


def check_tree_search(top_k: int, budget: int, rank_temperature: float) -> None:
    """Refuse the settings of a best-first tree search that build no tree (ValueError naming the value): ``top_k``
    children per node and ``budget`` nodes, both at least 1, ranked at a positive ``rank_temperature``."""
    if top_k < 1 or budget < 1:
        raise ValueError(f"top_k and budget must be >= 1, got top_k={top_k}, budget={budget}")
    if rank_temperature <= 0:
        raise ValueError(f"rank_temperature must be > 0, got {rank_temperature}")
