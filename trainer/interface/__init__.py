"""What a user reads and types, below everything else: :mod:`~trainer.interface.errors` (the errors a user's input
gets, one line each, no traceback), :mod:`~trainer.interface.output` (messages, blocks and durations of the batch log),
:mod:`~trainer.interface.flags` (the command-line vocabulary) and :mod:`~trainer.interface.renamed_keys` (old recipe
keys, values and class paths, refused naming the new ones or read as them from a checkpoint)."""
