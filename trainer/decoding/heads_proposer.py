"""Drafting with parallel heads on the target's hidden state of the last committed token (Medusa heads, parallel MTP
heads): the argmax chain (what vLLM does), or a tree of top-k paths verified with tree attention.

The heads read the hidden state the target session computed for the last committed token in the previous
verification (``ProposalContext.hidden_states``), so drafting costs the heads and nothing of the target. Head ``d``
guesses the draft at depth ``d + 1``. Greedy verification of either shape is lossless; at a temperature the chain
samples each head's token from its own distribution (returned for speculative sampling), and a tree's top-k nodes
are deterministic candidates (one-hot distributions), which keeps sampling exact too.

Dynamic draft length (``ctx.accept_threshold``): every node gets its head's probability of its token (at temperature
1) as ``confidence`` (a sampled chain draft: its head's top probability), and the engine keeps the nodes whose path
product is at least the threshold; the heads run once per round, so the cut saves verification, not drafting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path as FilePath

import torch

from trainer.decoding.head_tree import (
    Path,
    check_choices,
    head_accuracy,
    top_k_needed,
    tree_for_budget,
    tree_from_choices,
)
from trainer.decoding.options import write_tree
from trainer.decoding.proposers import BaseProposer, ProposalContext, draft_confidence, draw
from trainer.decoding.tree import DraftTree

TREE_TOP_K = 10  # ranks of every head measured for a written tree


class ParallelHeadsProposer(BaseProposer):
    """Chain or tree drafts from ``num_heads`` heads; subclasses give the heads' logits. ``max_drafts`` is the head
    count; :meth:`write_tree` writes the best tree for a node budget from the heads' accuracy measured on prompts."""

    estimates_acceptance = True
    drafters_name = "heads"  # what drafts a depth each, in messages

    def __init__(self, layer: int, num_heads: int, choices: Sequence[Sequence[int]] | None = None) -> None:
        """
        Args:
            layer: the target hidden state the heads read (HF ``hidden_states`` index, or FINAL_PRENORM).
            num_heads: K, the most drafts per round.
            choices: tree paths (``medusa_choices``), or None for the argmax chain.
        """
        self.needs_hidden_states: tuple[int, ...] = (layer,)
        self.max_drafts = num_heads
        self.choices: tuple[Path, ...] | None = None if choices is None else check_choices(choices, num_heads)
        self.recorded: list[tuple[int, torch.Tensor]] | None = None  # (committed tokens, [K, V] logits) per round

    def head_logits(self, ctx: ProposalContext) -> torch.Tensor:
        """``[K, V]`` every head's logits at the last committed token."""
        raise NotImplementedError

    def write_tree(
        self, path: FilePath, target, prompts: Sequence[Sequence[int]], max_new_tokens: int, nodes: int
    ) -> tuple[Path, ...]:
        """Measure the heads' top-10 accuracy on ``prompts`` (:func:`measure_head_accuracy`) and write the best tree
        of ``nodes`` paths, with the accuracy it was built from, to ``path``; returns its paths."""
        accuracy = measure_head_accuracy(target, self, prompts, max_new_tokens, top_k=TREE_TOP_K)
        paths = tree_for_budget(accuracy, nodes)
        write_tree(path, paths, accuracy=accuracy.tolist())
        return paths

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """``ctx.k`` drafts in a chain, or the tree of ``choices`` cut at depth ``ctx.k``."""
        if ctx.k <= 0:
            return DraftTree.empty(ctx.tokens.device)
        if ctx.k > self.max_drafts:
            raise ValueError(
                f"{ctx.k} drafts per round asked of {self.max_drafts} {self.drafters_name}: use --k {self.max_drafts} "
                "or less"
            )
        logits = self.head_logits(ctx)[:, : ctx.vocab_size]  # [K, V]
        if self.recorded is not None:
            self.recorded.append((ctx.tokens.numel(), logits.detach().float().cpu()))
        estimate = ctx.accept_threshold > 0
        if self.choices is not None:
            top = logits.topk(min(top_k_needed(self.choices), logits.shape[-1]), dim=-1).indices  # [K, r]
            tree = tree_from_choices(self.choices, top, max_depth=ctx.k)
            if not estimate or not tree.num_nodes:
                return tree
            heads = tree.depths() - 1  # [N]: the head of every node
            confidence = draft_confidence(logits[heads], tree.tokens[:, None])[:, 0]  # [N]
            return replace(tree, confidence=confidence)
        drafts = [draw(logits[d], ctx) for d in range(ctx.k)]  # ([1] token, [V] or None) per head
        probs = torch.stack([p for _, p in drafts]) if ctx.temperature > 0 else None
        tokens = torch.cat([t for t, _ in drafts])  # [k]
        if not estimate:
            return DraftTree.chain(tokens, probs)
        sampled = ctx.temperature > 0  # a sampled draft's estimate is its head's top probability, not its token's
        drafted = logits[: ctx.k]  # [k, V]
        confidence = draft_confidence(drafted) if sampled else draft_confidence(drafted, tokens[:, None])[:, 0]
        return DraftTree.chain(tokens, probs, confidence=confidence)


def measure_head_accuracy(
    target, proposer: ParallelHeadsProposer, prompts: Sequence[Sequence[int]], max_new_tokens: int, top_k: int
) -> torch.Tensor:
    """Per-head top-k accuracy ``[K, top_k]`` at the positions the heads really draft from: the prompts are decoded
    greedily with the heads' chain, and each round's head logits are compared with the tokens that followed."""
    from trainer.decoding.generate import speculative_generate

    K = proposer.max_drafts
    choices, proposer.choices = proposer.choices, None
    ranks = []
    try:
        for prompt in prompts:
            proposer.recorded = []
            ids = torch.tensor(list(prompt), dtype=torch.long, device=target.device)  # [S]
            result = speculative_generate(target, ids, proposer, K, max_new_tokens)
            sequence = list(prompt) + result.tokens
            for committed, logits in proposer.recorded:  # logits [k, V]: draft d guesses token committed + d
                truth = sequence[committed : committed + K]
                if len(truth) == K and logits.shape[0] == K:  # not a round of fewer drafts (at the output's end)
                    right = logits.gather(1, torch.tensor(truth)[:, None])  # [K, 1]
                    ranks.append((logits > right).sum(1))  # [K]
    finally:
        proposer.recorded, proposer.choices = None, choices
    if not ranks:
        raise ValueError("no drafting round to measure the heads on: longer outputs or more prompts are needed")
    return head_accuracy(torch.stack(ranks), top_k)
