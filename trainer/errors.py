"""Mistakes a user can fix, as one family of exceptions.

Every check of something the user gave (a recipe, a path, a model folder, a tokenizer, a shard, data rows, a
command-line value, a checkpoint, a training setting that diverges) raises a :class:`UserError` where the check is
made, with a message that names the file, key, value or row, and optionally a ``hint``: one line of what to do.
``draftsmith`` ends such an error with ``error: <message>`` (and the hint) on standard error and exit status 2, without
a traceback (``--debug`` or ``DRAFTSMITH_DEBUG=1`` shows it); any other exception is a bug of ours and keeps its
traceback.

Each class also derives from the built-in exception the check raised before it had a family (``ValueError``,
``FileNotFoundError``, ``FloatingPointError``), so ``except ValueError`` around a check keeps working.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; the message names what is wrong (file, key, value or row)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        """
        Args:
            message: what is wrong, naming the file, key, value or row.
            hint: one line of what to do about it, when useful.
        """
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __reduce__(self):  # survives pickling across processes (dataloader workers, spawned ranks) with its hint
        return (type(self), (self.message, self.hint))


class RecipeError(UserError, ValueError):
    """A recipe or command-line override that the parser or an objective refuses (a key, a value, a combination)."""


class UsageError(UserError, ValueError):
    """A command-line value of a tool (not a recipe key): a flag, a count, a URL."""


class PathError(UserError, FileNotFoundError):
    """A file or folder the user named that does not exist or cannot be read."""


class ModelFolderError(UserError, ValueError):
    """A model folder (target, drafter export) that is not what the command needs, or is broken."""


class TokenizerError(UserError, ValueError):
    """A tokenizer that is missing, or that does not match the model or the data."""


class DataError(UserError, ValueError):
    """Data the user gave: rows, files or shards that are empty, malformed, truncated or of another tokenizer."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, truncated, of another run or target, or not written by draftsmith."""


class TrainingError(UserError, FloatingPointError):
    """A run that cannot go on for a reason the user can change: a non-finite loss, a dead or diverged model."""
