"""Candidate trees from the top-k of parallel draft heads (Medusa heads, parallel MTP heads).

Head ``d`` (0-based) guesses the draft at depth ``d + 1``, without seeing the guesses of the heads before it. A tree
is a list of paths (``medusa_choices``): a path ``(r_1, ..., r_d)`` is the node whose token is the ``r_d``-th most
likely token of head ``d - 1``, under the node ``(r_1, ..., r_{d-1})``; every prefix of a path must be in the list.
The chain of argmaxes is ``(0,), (0, 0), ...``.

:data:`MEDUSA_SPARSE_TREE` is the 63-node sparse tree the Medusa paper ships for 4 heads (``mc_sim_7b_63``);
:func:`tree_for_budget` builds a tree for a node budget from measured per-head top-k accuracies, the paper's greedy
rule: a path's expected contribution is the product of the accuracies of its ranks, and the best paths whose prefix
is already in the tree are added until the budget is spent (accuracies at most 1, so a path never scores above its
prefix, and the greedy choice is the best tree of that size under the independence assumption).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from trainer.decoding.tree import DraftTree

Path = tuple[int, ...]


# The Medusa paper's sparse tree for 4 heads (mc_sim_7b_63): 63 paths of top-k ranks, found on Vicuna-7B; the default
# tree of 4 parallel heads (Medusa, MTP heads) or P-EAGLE depths
MEDUSA_SPARSE_TREE: tuple[Path, ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,),
    (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1),
    (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0),
    (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip


def tree_or_default(choices: Sequence[Sequence[int]] | None, count: int, drafters: str) -> Sequence[Sequence[int]]:
    """The tree ``--tree`` drafts with ``count`` parallel ``drafters`` (heads, depths): ``choices`` (``--tree_choices``)
    when given, else :data:`MEDUSA_SPARSE_TREE` for 4 of them; a ValueError naming the flags to use otherwise."""
    if choices is not None:
        return choices
    if count != 4:
        raise ValueError(
            f"--tree for {count} {drafters} needs --tree_choices FILE (the Medusa paper's tree is for 4 {drafters}; "
            f"draftsmith eval --write_tree FILE builds one from the {drafters}' measured accuracy)"
        )
    return MEDUSA_SPARSE_TREE


def chain(depth: int) -> tuple[Path, ...]:
    """The argmax chain of ``depth`` heads: ``(0,), (0, 0), ...``."""
    return tuple((0,) * d for d in range(1, depth + 1))


def check_choices(choices: Sequence[Sequence[int]], num_heads: int, where: str = "medusa_choices") -> tuple[Path, ...]:
    """The paths as tuples, sorted so that every parent precedes its children; an error naming ``where`` and the
    path when one is empty, repeated, has a negative rank, is deeper than the heads, or misses a prefix."""
    paths = [tuple(int(r) for r in p) for p in choices]
    if not paths:
        raise ValueError(f"{where}: no paths")
    seen = set()
    for path in paths:
        if not path:
            raise ValueError(f"{where}: an empty path")
        if path in seen:
            raise ValueError(f"{where}: path {list(path)} appears twice")
        if min(path) < 0:
            raise ValueError(f"{where}: path {list(path)} has a negative rank")
        if len(path) > num_heads:
            raise ValueError(f"{where}: path {list(path)} is {len(path)} deep, more than the {num_heads} heads")
        seen.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(
                f"{where}: path {list(path)} has no parent {list(path[:-1])} (every prefix must be a path)"
            )
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def tree_from_choices(paths: Sequence[Path], topk_ids: torch.Tensor, max_depth: int | None = None) -> DraftTree:
    """The draft tree of ``paths`` (checked, parents first) over the heads' top-k token ids ``[K, k]`` (row d: head
    d's tokens, best first); paths deeper than ``max_depth`` are left out (a round near the end of the budget)."""
    index: dict[Path, int] = {}
    tokens, parents = [], []
    for path in paths:
        if max_depth is not None and len(path) > max_depth:
            continue
        index[path] = len(tokens)
        tokens.append(topk_ids[len(path) - 1, path[-1]])
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
    device = topk_ids.device
    if not tokens:
        return DraftTree.empty(device)
    return DraftTree(tokens=torch.stack(tokens), parents=torch.tensor(parents, device=device))


def top_k_needed(paths: Sequence[Path]) -> int:
    """The largest rank a tree uses, plus one: how many of each head's best tokens it needs."""
    return 1 + max(r for path in paths for r in path)


def tree_for_budget(accuracy: torch.Tensor, nodes: int) -> tuple[Path, ...]:
    """The best tree of ``nodes`` paths for per-head top-k accuracies ``[K, k]`` (entry ``[d, r]``: how often the
    ``r``-th token of head ``d`` was the right one), by the greedy rule of the module docstring."""
    if accuracy.dim() != 2 or nodes < 1:
        raise ValueError(f"need [heads, top_k] accuracies and nodes >= 1, got {tuple(accuracy.shape)} and {nodes}")
    heads, k = accuracy.shape
    acc = accuracy.double().clamp(0.0, 1.0).tolist()
    frontier = [(-acc[0][r], (r,)) for r in range(k)]
    heapq.heapify(frontier)
    chosen: list[Path] = []
    while frontier and len(chosen) < nodes:
        score, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < heads:
            for r in range(k):
                heapq.heappush(frontier, (score * acc[len(path)][r], (*path, r)))
    return check_choices(chosen, heads, "the built tree")


def head_accuracy(ranks: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per-head top-k accuracy ``[K, top_k]`` from ``[N, K]`` ranks of the right token in each head's logits."""
    return torch.stack([(ranks == r).double().mean(0) for r in range(top_k)], dim=1)
