"""Acceptance rules: greedy verification and speculative sampling, for chains (batched) and trees.

Greedy: a draft is accepted while it equals the target's argmax; the first mismatch is replaced by the target's
argmax, and when every draft is accepted the target's argmax after the last one is the bonus token. The output is the
target's greedy output.

Speculative sampling (Leviathan et al., Chen et al.): a draft x drawn from p is accepted with probability
min(1, q(x) / p(x)); at the first rejection a token is drawn from the normalised residual max(0, q - p); when every
draft is accepted, the bonus token is drawn from q after the last one. The committed tokens are distributed as q for
any p, provided p is the distribution the draft was really drawn from; a greedy (deterministic) draft has a one-hot
p, so the rule becomes "accept with probability q(x), else sample from q with x removed".

On a tree, the children of a node are tried in order with the same rule, the residual of one rejection becoming the
target distribution of the next sibling (SpecInfer's multi-step rejection); a child's p must be the distribution it
was drawn from given the siblings before it (one-hot for deterministic candidates such as a top-k expansion).
"""

from __future__ import annotations

import torch

from trainer.decoding.tree import DraftTree


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax of ``logits / temperature`` in at least float32; ``[..., V]`` in, ``[..., V]`` out."""
    if temperature <= 0:
        raise ValueError(f"sampling needs a temperature > 0, got {temperature}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.softmax(logits.to(dtype) / temperature, dim=-1)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``[B, V]`` (unnormalised) probabilities: ``[B]``."""
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator).squeeze(-1)


def greedy_verify_chain(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a batch of chains.

    Args:
        draft_tokens: ``[B, K]`` drafts.
        target_logits: ``[B, K + 1, V]`` target logits at the root and at every draft.

    Returns:
        ``(num_accepted [B], next_token [B])``: the accepted prefix length and the target's token after it.
    """
    batch, k = draft_tokens.shape
    target_tokens = target_logits.argmax(dim=-1)  # [B, K + 1]
    matches = (draft_tokens == target_tokens[:, :k]).long()  # [B, K]
    num_accepted = matches.cumprod(dim=-1).sum(dim=-1)  # [B]
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return num_accepted, next_token


def sampling_verify_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling on a batch of chains.

    Args:
        draft_tokens: ``[B, K]`` drafts.
        draft_probs: ``[B, K, V]`` the distributions the drafts were drawn from, or ``None`` for deterministic
            (one-hot) drafts.
        target_probs: ``[B, K + 1, V]`` target distributions at the root and at every draft (temperature applied).
        generator: random generator on the probabilities' device.

    Returns:
        ``(num_accepted [B], next_token [B])``: the accepted prefix length, and the residual sample at the first
        rejection or the bonus token drawn from the last distribution.
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)  # [B]
    q_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    if draft_probs is None:
        p_draft = torch.ones_like(q_draft)  # [B, K]
    else:
        p_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).to(q_draft.dtype)  # [B, K]
    u = torch.rand(q_draft.shape, generator=generator, device=q_draft.device, dtype=q_draft.dtype)  # [B, K]
    accept = (u * p_draft < q_draft).long()  # [B, K]: u < min(1, q / p), u in [0, 1)
    num_accepted = accept.cumprod(dim=-1).sum(dim=-1)  # [B]
    q_next = target_probs[rows, num_accepted]  # [B, V]
    if k == 0:
        return num_accepted, _sample(q_next, generator)
    rejected_at = num_accepted.clamp(max=k - 1)  # [B]
    if draft_probs is None:
        p_next = torch.zeros_like(q_next)  # [B, V]
        p_next[rows, draft_tokens[rows, rejected_at]] = 1.0
    else:
        p_next = draft_probs[rows, rejected_at].to(q_next.dtype)  # [B, V]
    residual = (q_next - p_next).clamp(min=0)  # [B, V]
    # all accepted: the bonus from q; a residual without mass (only from rounding, as q == p never rejects): q
    use_q = (num_accepted == k) | (residual.sum(-1) <= 0)  # [B]
    residual = torch.where(use_q[:, None], q_next, residual)  # [B, V]
    return num_accepted, _sample(residual, generator)


def greedy_verify_tree(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification of a tree: the longest path of nodes that each equal the target's argmax at their parent.

    Args:
        tree: the drafts, N nodes.
        target_logits: ``[N + 1, V]`` target logits at the root (index 0) and at every node (index i + 1).

    Returns:
        ``(path, next_token)``: the accepted nodes from the root down, and the target's argmax after the last one.
        Among accepted paths of equal length the first in node order wins.
    """
    target_tokens = target_logits.argmax(dim=-1).tolist()  # [N + 1]
    accepted = [False] * tree.num_nodes
    depth = [0] * tree.num_nodes
    best, best_depth = -1, 0
    for i, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        parent_ok = parent < 0 or accepted[parent]
        if parent_ok and token == target_tokens[parent + 1]:
            accepted[i] = True
            depth[i] = 1 if parent < 0 else depth[parent] + 1
            if depth[i] > best_depth:
                best, best_depth = i, depth[i]
    return tree.path_to(best), int(target_tokens[best + 1])


def sampling_verify_tree(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Speculative sampling on a tree (multi-step rejection over the children of each accepted node).

    Args:
        tree: the drafts, N nodes, with ``probs`` the distribution every node was drawn from (``None``: one-hot).
        target_probs: ``[N + 1, V]`` target distributions at the root (index 0) and at every node (index i + 1).
        generator: random generator on the probabilities' device.

    Returns:
        ``(path, next_token)``: the accepted nodes from the root down, and the token drawn after the last one.
    """
    children = tree.children()
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = -1
    while True:
        q = target_probs[node + 1].clone()  # [V]
        chosen = -1
        for child in children[node + 1]:
            x = tokens[child]
            if tree.probs is None:
                p = torch.zeros_like(q)  # [V]
                p[x] = 1.0
            else:
                p = tree.probs[child].to(q.dtype)  # [V]
            u = torch.rand((), generator=generator, device=q.device, dtype=q.dtype)
            if bool(u * p[x] < q[x]):
                chosen = child
                break
            residual = (q - p).clamp(min=0)  # [V]
            if float(residual.sum()) <= 0:  # only from rounding: q == p never rejects
                break
            q = residual / residual.sum()
        if chosen < 0:
            return path, int(_sample(q[None], generator)[0])
        path.append(chosen)
        node = chosen
