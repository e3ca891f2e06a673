"""Drafting with sequential MTP modules on the target session's hidden states: a chain, or a tree of per-depth top-k.

Module 0 reads the target's hidden state of the last token the target has seen (``ctx.hidden_states``: its final
normed output, or the pre-norm one, as the modules' ``trunk_hidden`` says) with the embedding of the token after it
(the root), and drafts the first token; draft step ``j`` uses module ``j % D`` on the output of step ``j - 1``, as
engines do (vLLM: ``spec_step_idx % num_mtp_layers``).

The modules keep one KV cache (module.py ``new_cache``), one layer each. Module ``k``'s committed
entries are the indices ``p`` whose inputs are all committed: the hidden state handed over at ``p`` and the token
``p + k + 1``. Each round appends the newly committed ones (module 0 from the target's hidden states, module ``k``
from module ``k - 1``'s outputs), so every committed entry is computed once, from committed inputs only. Steps
``j < D`` then run module ``j`` over its draft-dependent entries (indices ``T - 1 - j .. T - 2``, whose tokens are
drafts ``0 .. j - 1``): exactly the entries it attends to in training, so a chain of ``K <= D`` drafts draws from
the distributions of the training unroll at that position (tested). Steps ``j >= D`` (more drafts than modules)
append one entry to module ``j % D`` at position ``T - 2 + j``, fed the previous step's output and draft. Draft
entries are dropped at the start of the next round.

With a tree (greedy verification), the chain's per-depth top-``tree_top_k`` tokens become the tree of at most
``tree_nodes`` paths that :func:`~trainer.decoding.head_tree.tree_for_budget` builds from the drafter's own
probabilities at ``rank_temperature`` (a node's token is its depth's candidate, computed along the argmax chain, as
for Medusa heads); at a temperature a sampled chain is drafted instead.

Dynamic draft length (``ctx.accept_threshold``): before each step the modules' probability (at temperature 1) of the
step's argmax (the greedy draft; for a sampled one the same top probability, which does not depend on the draw) joins
the chain's running product, and drafting stops, saving the next modules' forwards, once it falls under the threshold.
A tree node's estimate is the probability of its token at its depth; a node's path product is at most the argmax
chain's at the same depth, so the tree is built from the depths the chain reached and then cut by the engine.

Engines refuse a number of speculative tokens that is above the module count and not a multiple of it (vLLM checks
``num_speculative_tokens % n_predict``); :meth:`MTPProposer.check_k` does too.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from trainer.decoding.head_tree import tree_for_budget, tree_from_choices
from trainer.decoding.proposers import BaseProposer, ChainCut, ProposalContext, draft_confidence, draw
from trainer.decoding.session import FINAL_PRENORM
from trainer.decoding.tree import DraftTree
from trainer.methods.mtp.module import MTPModules


def check_draft_count(k: int, depth: int) -> None:
    """Refuse ``k`` drafts per round from ``depth`` modules when ``k > depth`` and ``depth`` does not divide ``k``."""
    if k > depth and k % depth:
        raise ValueError(
            f"{k} speculative tokens per round from {depth} MTP modules: {depth} does not divide {k} (step i uses "
            f"module i % {depth}; engines refuse it): ask for at most {depth} or a multiple of {depth}"
        )


class MTPProposer(BaseProposer):
    """Chain or tree drafts from MTP modules sharing the target's embedding and lm_head."""

    estimates_acceptance = True

    def __init__(
        self,
        modules: MTPModules,
        embedding: nn.Module,
        lm_head: nn.Module,
        num_layers: int,
        tree: bool = False,
        tree_nodes: int = 24,
        tree_top_k: int = 4,
        rank_temperature: float = 0.1,
    ) -> None:
        """
        Args:
            modules: the trained modules (eval mode is set here).
            embedding: the target's input embedding.
            lm_head: the target's output layer.
            num_layers: L, the target's layer count (its final normed hidden state is ``hidden_states[L]``).
            tree: draft a tree of per-depth top-k candidates (greedy verification).
            tree_nodes: the tree's node budget.
            tree_top_k: candidates per depth.
            rank_temperature: temperature of the probabilities that choose the tree's paths.
        """
        if tree_nodes < 1 or tree_top_k < 1 or rank_temperature <= 0:
            raise ValueError(
                f"need tree_nodes >= 1, tree_top_k >= 1, rank_temperature > 0; got {tree_nodes}, {tree_top_k}, "
                f"{rank_temperature}"
            )
        self.modules = modules.eval()
        self.embedding, self.lm_head = embedding, lm_head
        self.depth = modules.depth
        after = modules.config.trunk_hidden == "after_norm"
        self.needs_hidden_states: tuple[int, ...] = (num_layers if after else FINAL_PRENORM,)
        self.tree, self.tree_nodes, self.tree_top_k, self.rank_temperature = (
            tree,
            tree_nodes,
            tree_top_k,
            rank_temperature,
        )
        self.reset()

    def reset(self) -> None:
        """A new sequence: an empty cache."""
        self.cache = self.modules.new_cache()
        self.committed = [0] * self.depth  # committed entries of each module
        self.pending: list[torch.Tensor | None] = [None] * self.depth  # [1, m, H] inputs of module k not yet used
        self._checked = False

    def check_k(self, k: int) -> None:
        """Refuse ``k`` drafts per round that the module count does not divide (engines refuse them too)."""
        try:
            check_draft_count(k, self.depth)
        except ValueError as err:
            raise ValueError(f"--k {k}: {err}") from err

    def _logits(self, k: int, out: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[1, 1, H] block output of module k -> [V] logits through its norm and the target's lm_head."""
        head = self.modules.head_input(k, out)[0, -1]  # [H]
        return self.lm_head(head.to(self.lm_head.weight.dtype))[:vocab_size]  # [V]

    def _crop(self) -> None:
        """Drop the last round's draft entries: every module keeps its committed ones."""
        for k, n in enumerate(self.committed):
            layer = self.cache.layers[self.modules.layers[k].layer_idx]
            extra = layer.get_seq_length() - n
            if extra > 0:
                layer.crop(-extra)

    def _extend(self, ctx: ProposalContext) -> torch.Tensor:
        """Append every module's newly committed entries; module 0's block output at the last committed index
        ``T - 2`` ([1, 1, H])."""
        tokens = ctx.tokens  # [T]
        T = tokens.numel()
        (layer,) = self.needs_hidden_states
        if layer not in ctx.hidden_states:
            raise ValueError(f"the MTP proposer needs the target's hidden states of layer {layer}")
        hidden = ctx.hidden_states[layer]  # [n, H] of tokens T - 1 - n .. T - 2
        start = T - 1 - hidden.shape[0]
        if start != self.committed[0]:
            raise RuntimeError(
                f"MTP proposer: the target's hidden states start at position {start} but module 0 holds "
                f"{self.committed[0]} entries (a round without drafting lost some; call reset())"
            )
        self._crop()
        feats = hidden[None]  # [1, n, H] inputs of module 0 at indices start .. T - 2
        last = None
        for k in range(self.depth):
            if k:
                before = self.pending[k]
                feats = feats if before is None else torch.cat([before, feats], dim=1)
            c = self.committed[k]
            m = max(0, T - 1 - k - c)  # entries whose token k + 1 ahead is committed
            new = feats[:, :0]
            if m:
                ids = tokens[c + k + 1 : c + k + 1 + m][None]  # [1, m]
                positions = torch.arange(c + k, c + k + m, device=tokens.device)[None]  # [1, m]
                out = self.modules.run(k, feats[:, :m], self.embedding(ids), positions, self.cache)  # [1, m, H]
                self.committed[k] = c + m
                new = self.modules.handoff(k, out)
                if k == 0:
                    last = out[:, -1:]
            self.pending[k] = feats[:, m:]
            feats = new
        assert last is not None  # module 0 always gains the entries of the tokens the target just saw
        return last

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """``ctx.k`` drafts in a chain, or a tree of per-depth candidates (greedy), at most ``ctx.k`` deep."""
        if not self._checked:  # the first round drafts the requested number (later ones may be cut by the budget)
            self.check_k(ctx.k)
            self._checked = True
        out = self._extend(ctx)
        if ctx.k <= 0:
            return DraftTree.empty(ctx.tokens.device)
        tree = self.tree and ctx.temperature <= 0
        T = ctx.tokens.numel()
        stream = ctx.tokens  # committed tokens, then the drafts
        drafts, probs, tops, top_p, top_conf = [], [], [], [], []
        cut = ChainCut(ctx.accept_threshold)
        logits = self._logits(0, out, ctx.vocab_size)
        prev = self.pending[1][:, :0] if self.depth > 1 else None  # module j - 1's draft outputs (handed over)
        for j in range(ctx.k):
            if cut.active and not cut.admit(draft_confidence(logits)):  # the argmax's probability
                break
            token, p = draw(logits, ctx)  # [1], [V] or None
            drafts.append(token)
            probs.append(p)
            if tree:
                r = min(self.tree_top_k, logits.numel())
                tops.append(logits.topk(r).indices)
                top_p.append(torch.softmax(logits.float() / self.rank_temperature, -1).topk(r).values)
                if cut.active:
                    top_conf.append(draft_confidence(logits, tops[-1]))  # [r]
            if j + 1 == ctx.k:
                break
            stream = torch.cat([stream, token])
            step = j + 1
            if step < self.depth:  # module `step` over its draft-dependent entries, as in training
                c = self.committed[step]
                feats = torch.cat([self.pending[step], prev], dim=1)  # [1, T - 1 - c, H]
                ids = stream[c + step + 1 : T + step][None]  # [1, T - 1 - c]
                positions = torch.arange(c + step, T - 1 + step, device=stream.device)[None]
                outs = self.modules.run(step, feats, self.embedding(ids), positions, self.cache)
                prev = self.modules.handoff(step, outs)
                out = outs[:, -1:]
                module = step
            else:  # reuse: module step % D, one entry after its own, fed the previous step's output
                module = step % self.depth
                feats = self.modules.handoff((step - 1) % self.depth, out)  # [1, 1, H]
                positions = torch.full((1, 1), T - 2 + step, device=stream.device)
                out = self.modules.run(module, feats, self.embedding(token[None]), positions, self.cache)
            logits = self._logits(module, out, ctx.vocab_size)
        if not drafts:
            return DraftTree.empty(ctx.tokens.device)
        if tree:
            paths = tree_for_budget(torch.stack(top_p), self.tree_nodes)
            built = tree_from_choices(paths, torch.stack(tops), max_depth=ctx.k)
            if not cut.active:
                return built
            ranks = [p[-1] for p in paths if len(p) <= ctx.k]  # the nodes, in the order tree_from_choices adds them
            depths = built.depths() - 1  # [N]
            confidence = torch.stack(top_conf)[depths, torch.tensor(ranks, device=depths.device)]  # [N]
            return replace(built, confidence=confidence)
        probs_ = torch.stack(probs) if ctx.temperature > 0 else None
        return DraftTree.chain(torch.cat(drafts), probs_, confidence=cut.confidence())
