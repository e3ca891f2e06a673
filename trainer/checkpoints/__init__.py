"""Training checkpoints: read safely (:mod:`~trainer.checkpoints.reading`: a ``.ckpt`` file or a DeepSpeed folder,
refused with the file named when it is truncated, empty or holds objects no draftsmith checkpoint holds), written
atomically (:mod:`~trainer.checkpoints.atomic`: a full disk never destroys the previous ``last.ckpt``; and
:mod:`~trainer.checkpoints.sharded`: a folder every rank writes is published only once complete), and the run's
checkpoint folder (:mod:`~trainer.checkpoints.run_folder`: one run writes it at a time, the recipe saved beside)."""
