"""What runs the training: :mod:`~trainer.training.objective` (``DraftObjective``, the base of every method's
LightningModule), :mod:`~trainer.training.optimizers` (AdamW, Muon and the schedule; :mod:`~trainer.training.muon`),
:mod:`~trainer.training.recipe` (a recipe read into a Lightning run), :mod:`~trainer.training.registry` (the drafter
kinds and their records), :mod:`~trainer.training.progress` (the batch log's progress lines and closing summary),
:mod:`~trainer.training.fingerprint` (what identifies a target or drafter in checkpoints and exports), and the
measurements a run takes of itself (:mod:`~trainer.training.throughput`, :mod:`~trainer.training.activation_memory`,
:mod:`~trainer.training.heldout`)."""
