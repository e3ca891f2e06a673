"""The losses every method shares.

:mod:`~trainer.losses.chunked` is the engine that projects rows onto the vocabulary a chunk at a time (no full
``[n, V]`` logits); :mod:`~trainer.losses.distillation` holds the distillation and next-token losses built on it;
:mod:`~trainer.losses.distribution` the losses toward a target distribution (``model.loss``: kl, tv, nla, lk_hybrid)
and the expected acceptance every drafter reports."""
