"""Self-speculative decoding by early exit (LayerSkip): the target's first E layers draft, the rest verify.

Drafting runs the round's pending tokens and each draft through layers ``[0, E)`` of the target session, into the
target's own cache, and exits through the model's own final norm and lm_head. The verification then starts at layer
E from the hidden states the drafting produced (``DraftTree.verify_layer``), so layers ``[0, E)`` are never run twice
for a token: a round over K drafts costs ``E * (K + 1) + (L - E) * (K + 1)`` layer-token passes (the last draft
passes through ``[0, E)`` once more, for its hidden state entering E), against ``E * K + L * (K + 1)`` when the
draft keeps a cache of its own and the verification re-runs every layer (transformers' ``assistant_early_exit``).
Greedy output equals the target's; at a temperature the drafts are sampled from the early exit's distribution and
speculative sampling keeps the output distributed as the target's.

Early exits of a model not trained for them are poor drafters; LayerSkip training (layer dropout and an early-exit
loss) makes them good. ``draftsmith eval --drafter early-exit --exit_layer E`` measures any sliceable target.
"""

from __future__ import annotations

import torch

from trainer.decoding.proposers import BaseProposer, ProposalContext, draw, register_proposer
from trainer.decoding.tree import DraftTree


@register_proposer("early-exit")
class EarlyExitProposer(BaseProposer):
    """Drafts with the target session's first ``exit_layer`` layers and its own final norm and lm_head."""

    def __init__(self, exit_layer: int) -> None:
        """
        Args:
            exit_layer: E, the number of target layers that draft (1 <= E < the target's layer count).
        """
        if exit_layer < 1:
            raise ValueError(f"the exit layer must be >= 1, got {exit_layer}")
        self.exit_layer = exit_layer

    @classmethod
    def from_options(cls, target, options=None) -> EarlyExitProposer:
        """Build from the command line: ``--exit_layer E`` is required."""
        if options is None or options.exit_layer is None:
            raise ValueError("the early-exit drafter needs --exit_layer E (the layer the draft exits at)")
        proposer = cls(options.exit_layer)
        if target is not None:
            proposer.check(int(target.config.num_hidden_layers))
        return proposer

    def reset(self) -> None:
        """Stateless: the drafts live in the target session's cache."""

    def check(self, num_layers: int) -> None:
        """Refuse an exit layer the target does not have."""
        if not 1 <= self.exit_layer < num_layers:
            raise ValueError(
                f"exit layer {self.exit_layer} must be in 1..{num_layers - 1} for a {num_layers}-layer target"
            )

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """``ctx.k`` drafts in a chain, verified from layer ``exit_layer``."""
        session = ctx.session
        if session is None:
            raise ValueError("the early-exit proposer drafts through the target session; run it in the engine")
        self.check(session.num_layers)
        if ctx.k <= 0:
            return DraftTree.empty(ctx.tokens.device)
        E = self.exit_layer
        feed = ctx.tokens[session.committed :]  # [m] the round's pending tokens
        states, drafts, probs = [], [], []
        for _ in range(ctx.k):
            h = session.forward(input_ids=feed, stop=E).hidden  # [n, H] entering layer E
            states.append(h)
            feed, p = draw(session.logits(h[-1:])[0, : ctx.vocab_size], ctx)  # [1], [V] or None
            drafts.append(feed)
            probs.append(p)
        states.append(session.forward(input_ids=feed, stop=E).hidden)  # the last draft's state entering layer E
        return DraftTree.chain(
            torch.cat(drafts),
            torch.stack(probs) if ctx.temperature > 0 else None,
            verify_layer=E,
            verify_hidden=torch.cat(states),  # [m + K, H]
        )
