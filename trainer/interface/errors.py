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

import os

HINT_PREFIX = "hint: "
DEBUG_ENV = "DRAFTSMITH_DEBUG"
USER_ERROR_STATUS = 2
"""The exit status of a command that ended on a :class:`UserError` (the SLURM requeue loop never requeues it)."""


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
        if hint:  # shown under the message in a traceback (--debug), and in the text a DataLoader worker passes on
            self.add_note(f"{HINT_PREFIX}{hint}")

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


def debugging() -> bool:
    """Whether a user error shows its traceback instead of one line: ``draftsmith --debug``, or ``DRAFTSMITH_DEBUG``
    set to anything but ``0`` (a tool that reports its own errors re-raises them then)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def error_report(err: BaseException, prefix: str = "") -> str:
    """The lines ``draftsmith`` ends an error with: ``error: <prefix><message>``, then ``hint: <hint>`` for a
    :class:`UserError` that has one (any other exception: its text)."""
    if isinstance(err, UserError):
        return f"error: {prefix}{err.message}" + (f"\n{HINT_PREFIX}{err.hint}" if err.hint else "")
    return f"error: {prefix}{err}"


def user_error_in(exc: BaseException) -> UserError | None:
    """The :class:`UserError` that ``exc`` is or wraps, else None (a bug of ours).

    Wrapped: found along the ``__cause__`` / ``__context__`` chain (jsonargparse refuses a class whose ``__init__``
    raised with an error of its own, raised from the original). Re-raised by a DataLoader worker: torch rebuilds the
    exception as ``type(err)(text)`` where the text is "Caught <Type> in DataLoader worker process N. Original
    Traceback ...", which ends with the original ``<module>.<Type>: <message>`` line and its ``hint:`` note; the
    message and hint are recovered from it.

    Args:
        exc: the exception that ended a command.

    Returns:
        The UserError to report (for a worker's, a new one of the same type with the original message and hint).
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, UserError):
            return _unwrapped_worker_error(current) or current
        pending += [current.__cause__, current.__context__]
    return None


def _unwrapped_worker_error(err: UserError) -> UserError | None:
    """The original error inside torch's DataLoader worker re-raise of ``err`` (see :func:`user_error_in`), or None
    when ``err`` is not such a re-raise."""
    text = err.message if isinstance(err.message, str) else str(err)
    if not text.startswith("Caught ") or "\nOriginal Traceback" not in text:
        return None
    name = f"{type(err).__module__}.{type(err).__qualname__}"
    lines = text.rstrip("\n").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"{name}: ")]
    if not starts:
        return None
    body = [lines[starts[-1]][len(name) + 2 :], *lines[starts[-1] + 1 :]]
    hint = None
    if len(body) > 1 and body[-1].startswith(HINT_PREFIX):
        hint = body.pop()[len(HINT_PREFIX) :]
    message = "\n".join(body)
    try:
        return type(err)(message, hint)
    except TypeError:  # a subclass with another signature
        return UserError(message, hint)
