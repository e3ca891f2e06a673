"""Drafting with a separate HF causal LM (a distilled draft model): autoregressive drafts with its own KV cache.

Dynamic draft length (``ctx.accept_threshold``): before each draft the model's probability (at temperature 1) of its
argmax (the greedy draft; for a sampled draft the same top probability, which does not depend on the draw) joins the
chain's running product, and drafting stops, saving the model's next forwards, once the product falls under the
threshold (:class:`~trainer.decoding.proposers.ChainCut`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from trainer.decoding.cache import new_cache, truncate_cache
from trainer.decoding.proposers import BaseProposer, ChainCut, ProposalContext, draft_confidence, draw
from trainer.decoding.tree import DraftTree


class DraftModelProposer(BaseProposer):
    """A separate HF causal LM drafting autoregressively, with its own KV cache reused across rounds.

    The proposer remembers which tokens its cache holds; at each round it keeps the longest prefix that agrees with
    the committed tokens, so accepted drafts are not recomputed. Its logits are cut (or padded with -inf) to the
    target's vocabulary.
    """

    estimates_acceptance = True

    def __init__(self, model: PreTrainedModel) -> None:
        """
        Args:
            model: the draft model (eval mode is set here; it shares the target's tokenizer).
        """
        self.model = model.eval()
        self.cache = new_cache(model.config)
        self.cached: list[int] = []

    def reset(self) -> None:
        """Drop the cache."""
        self.cache = new_cache(self.model.config)
        self.cached = []

    def _logits(self, new_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Feed ``[n]`` tokens after the cache; the last position's logits in the target vocabulary: ``[V]``."""
        out = self.model(input_ids=new_tokens[None], cache=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.cache if getattr(out, "cache", None) is not None else self.cache
        self.cached.extend(new_tokens.tolist())
        logits = out.logits[0, -1]  # [V_draft]
        if logits.shape[-1] >= vocab_size:
            return logits[:vocab_size]
        pad = logits.new_full((vocab_size - logits.shape[-1],), float("-inf"))
        return torch.cat([logits, pad])  # [V]

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """``ctx.k`` drafts, greedy or sampled at ``ctx.temperature``."""
        tokens = ctx.tokens  # [T]
        if ctx.k <= 0:
            return DraftTree.empty(tokens.device)
        committed = tokens.tolist()
        common = 0
        for a, b in zip(self.cached, committed):
            if a != b:
                break
            common += 1
        common = min(common, len(committed) - 1)  # at least one token to feed, for fresh logits
        truncate_cache(self.cache, common)
        del self.cached[common:]
        drafts, probs = [], []
        cut = ChainCut(ctx.accept_threshold)
        feed = tokens[common:]  # [T - common]
        for _ in range(ctx.k):
            logits = self._logits(feed, ctx.vocab_size)  # [V]
            if cut.active and not cut.admit(draft_confidence(logits)):
                break
            feed, p = draw(logits, ctx)
            drafts.append(feed)
            probs.append(p)
        if not drafts:
            return DraftTree.empty(tokens.device)
        probs_ = torch.stack(probs) if ctx.temperature > 0 else None
        return DraftTree.chain(torch.cat(drafts), probs_, confidence=cut.confidence())
