"""Lossless speculative decoding: the engine every drafter is evaluated with.

- :mod:`~trainer.decoding.generate`: ``speculative_generate`` (one sequence, HF target with a KV cache) and
  ``verify_round`` (one verification forward over a draft tree);
- :mod:`~trainer.decoding.verify`: greedy verification and speculative sampling, for chains (batched) and trees;
- :mod:`~trainer.decoding.tree`: ``DraftTree`` (ancestor-only mask, per-node positions); a chain is a tree of width 1;
- :mod:`~trainer.decoding.cache`: cropping and compacting HF caches;
- :mod:`~trainer.decoding.proposers`: the ``Proposer`` protocol (defaults in ``BaseProposer``), ``register_proposer``
  and the built-in proposers;
- :mod:`~trainer.decoding.metrics`: tau, acceptance per position, loops, Leviathan's projection;
- :mod:`~trainer.decoding.options`: ``ProposerOptions``, the drafting options of eval, the callback and compare;
- :mod:`~trainer.decoding.evaluate`: the measurement (:mod:`~trainer.decoding.eval_cli`: ``draftsmith eval``);
  :mod:`~trainer.decoding.callback`: the training callback.
"""

from trainer.decoding.generate import GenerationResult, RoundStats, speculative_generate, verify_round
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import (
    BaseProposer,
    NoProposer,
    PromptLookupProposer,
    ProposalContext,
    Proposer,
    build_proposer,
    register_proposer,
)
from trainer.decoding.tree import DraftTree

__all__ = [
    "BaseProposer",
    "DraftTree",
    "GenerationResult",
    "NoProposer",
    "PromptLookupProposer",
    "ProposalContext",
    "Proposer",
    "ProposerOptions",
    "RoundStats",
    "build_proposer",
    "register_proposer",
    "speculative_generate",
    "verify_round",
]
