"""Lossless speculative decoding: the engine every drafter is evaluated with.

- :mod:`~trainer.decoding.generate`: ``speculative_generate`` (one sequence, HF target with a KV cache) and
  ``verify_round`` (one verification forward over a draft tree);
- :mod:`~trainer.decoding.verify`: greedy verification and speculative sampling, for chains (batched) and trees;
- :mod:`~trainer.decoding.tree`: ``DraftTree`` (ancestor-only mask, per-node positions); a chain is a tree of width 1;
- :mod:`~trainer.decoding.cache`: cropping and compacting HF caches;
- :mod:`~trainer.decoding.proposers`: the ``Proposer`` protocol, ``register_proposer`` and the built-in proposers;
- :mod:`~trainer.decoding.metrics`: tau, acceptance per position, loops, Leviathan's projection;
- :mod:`~trainer.decoding.evaluate`: ``draftsmith eval``; :mod:`~trainer.decoding.callback`: the training callback.
"""

from trainer.decoding.generate import GenerationResult, RoundStats, speculative_generate, verify_round
from trainer.decoding.proposers import (
    NoProposer,
    PromptLookupProposer,
    ProposalContext,
    Proposer,
    build_proposer,
    register_proposer,
)
from trainer.decoding.tree import DraftTree

__all__ = [
    "DraftTree",
    "GenerationResult",
    "NoProposer",
    "PromptLookupProposer",
    "ProposalContext",
    "Proposer",
    "RoundStats",
    "build_proposer",
    "register_proposer",
    "speculative_generate",
    "verify_round",
]
