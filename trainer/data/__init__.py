"""The data every method trains on: text and chat rows (:mod:`~trainer.data.text`, :mod:`~trainer.data.chat`,
:mod:`~trainer.data.packing`), resumable sampling (:mod:`~trainer.data.sampler`), the teacher-signal shards
(:mod:`~trainer.data.shards`, :mod:`~trainer.data.shard_datamodule`, written by :mod:`~trainer.data.precompute`), the
target's regenerated replies (:mod:`~trainer.data.generate` and :mod:`~trainer.data.server_client`, ``draftsmith
generate``), the corpus of the demo (:mod:`~trainer.data.corpus`) and the data-tokenizer checks
(:mod:`~trainer.data.vocab`)."""
