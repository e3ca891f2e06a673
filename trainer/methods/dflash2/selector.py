"""DFlash2's path selector (speculators 0.9 ``models/dflash2`` ``CandidateSelector``), the block refiner of this method.

A DFlash block drafts every slot at once, so slot ``k`` cannot know what slot ``k - 1`` drafted. DFlash2 keeps the
``top_k`` best tokens of each slot by its own (unary) logits and rescores them given the token before: candidate
``c`` of slot k after token ``t`` scores

    s(c | t, h_k) = logits_k[c] + sum_r P[t, r] * (W h_k)[r] * S[c, r]

a low-rank (rank r) bilinear term between the previous token's row of ``predecessor_codebook`` P [V, r], the slot's
normed output projected by ``hidden_projection`` W [r, H], and the candidate's row of ``successor_codebook`` S [V, r].
Drafting resolves the block left to right: slot 1 after the anchor, each next slot after the candidate just chosen
(the greedy path; a token outside the slot's top-k is never drafted). Training is teacher-forced (t the data's token
before the slot's token): a cross entropy over the slot's top-k candidates toward the target's token, the weakest
candidate replaced by it when it is not among them (:func:`training_candidates`).
"""

from __future__ import annotations

import torch
from torch import nn


def check_selector(rank: int, top_k: int, vocab_size: int) -> None:
    """Refuse a selector that does not fit the drafter, naming the value (a ValueError, as ``check_conv``)."""
    for key, value in (("selector_rank", rank), ("selector_top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")
    if top_k > vocab_size:
        raise ValueError(f"selector_top_k={top_k} cannot exceed the vocabulary's {vocab_size} tokens")


class CandidateSelector(nn.Module):
    """The bilinear rescoring of a slot's top-k candidates given the token before it."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        """
        Args:
            vocab_size: V, the target's vocabulary.
            hidden_size: H, the drafter's width.
            rank: r, the bilinear term's rank.
            top_k: the candidates kept per slot.
        """
        super().__init__()
        check_selector(rank, top_k, vocab_size)
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=0.02)  # speculators' initializer_range

    def context(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] slots' normed outputs, prev: [...] the token before each -> [..., r]."""
        predecessor = self.predecessor_codebook[prev.long()]  # [..., r]
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))  # [..., r]
        return predecessor * projected.to(predecessor.dtype)

    def transition(self, hidden: torch.Tensor, prev: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The bilinear term [..., K] of candidates [..., K] after ``prev`` [...] at slots ``hidden`` [..., H]."""
        return (self.context(hidden, prev).unsqueeze(-2) * self.successor_codebook[candidates.long()]).sum(-1)

    def candidates(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [..., V] the slots' unary logits -> [..., K] their top-k ids, best first."""
        return logits.topk(self.top_k, dim=-1).indices

    def scores(
        self, logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """The candidates' scores [..., K]: their unary logits (``logits`` [..., V]) plus the bilinear term."""
        unary = logits.gather(-1, candidates)  # [..., K]
        return unary + self.transition(hidden, prev, candidates).to(unary.dtype)

    def rescored(self, logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The slots' logits given the token before them: ``logits`` [..., V] with the top-k candidates rescored and
        every other token at -inf (never drafted)."""
        candidates = self.candidates(logits)  # [..., K]
        out = torch.full_like(logits, float("-inf"))
        return out.scatter(-1, candidates, self.scores(logits, hidden, prev, candidates))


def training_candidates(
    candidates: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """speculators' ``selector_training_candidates``: the top-k candidates [n, K] with the last replaced by the target
    token [n] where it is missing; returns (candidates [n, K], the target's index among them [n], whether the unary
    top-k held it [n] bool)."""
    matches = candidates.eq(target[:, None])  # [n, K]
    present = matches.any(-1)  # [n]
    K = candidates.shape[-1]
    position = torch.where(present, matches.long().argmax(-1), K - 1)  # [n]
    out = candidates.clone()
    out[:, -1] = torch.where(present, out[:, -1], target)
    return out, position, present
