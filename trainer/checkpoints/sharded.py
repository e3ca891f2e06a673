"""Checkpoint folders that every rank writes (DeepSpeed ZeRO, FSDP2 distributed checkpoints), published whole or not
at all.

A sharded checkpoint is a folder to which each rank writes its own files. Written in place, a rank that dies during
the save (killed, out of memory, its node lost) leaves a folder with some ranks' files under the checkpoint's own name,
and ``--ckpt_path last`` picks it on resume. Here the ranks write into ``<dirpath>/.<name>.partial``; after a barrier
(every rank finished) rank 0 writes :data:`MARKER` into it (the step and the world size), then publishes it under
``<name>`` by one rename, and the ranks meet at a second barrier. ``last.ckpt`` therefore only ever names a complete
folder. A folder already there under ``<name>`` (the previous ``last.ckpt``) is swapped with the new one by one
``renameat2(RENAME_EXCHANGE)`` on Linux, then removed; where the file system refuses that, by two renames.

On resume (:func:`complete_last_checkpoints`, what ``--ckpt_path last`` chooses from), a ``.<name>.partial`` folder
is a save that did not finish: rank 0 logs one line naming it and removes it. A visible checkpoint folder without the
marker (written before draftsmith wrote markers, or by another tool) is not chosen, with one line naming it; its path
given to ``--ckpt_path`` still loads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only

from trainer.checkpoints.atomic import fsync_path

log = logging.getLogger(__name__)

__all__ = [
    "MARKER",
    "PARTIAL_SUFFIX",
    "complete_last_checkpoints",
    "is_complete",
    "partial_folder",
    "read_marker",
    "save_folder_atomically",
]

MARKER = "draftsmith-complete.json"
"""The file whose presence makes a checkpoint folder complete: ``{"step": N, "world_size": W}``."""

PARTIAL_SUFFIX = ".partial"


def partial_folder(target: Path) -> Path:
    """Where the ranks write the folder that will be published as ``target``: ``<parent>/.<name>.partial``."""
    return target.parent / f".{target.name}{PARTIAL_SUFFIX}"


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a checkpoint folder, or None when it has none (or an unreadable one)."""
    try:
        record = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint folder whose save finished on every rank."""
    return folder.is_dir() and read_marker(folder) is not None


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swaps the paths ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a))


def publish(partial: Path, target: Path, step: int, world_size: int) -> None:
    """Writes the marker into ``partial`` and renames it onto ``target`` (rank 0, after every rank wrote its files).

    Args:
        partial: the folder the ranks wrote.
        target: the checkpoint's name; a previous folder or file there is replaced.
        step: the global step the checkpoint holds (written in the marker).
        world_size: the ranks that wrote it (written in the marker).
    """
    marker = partial / MARKER
    with marker.open("w") as f:
        json.dump({"step": int(step), "world_size": int(world_size)}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(partial)
    if target.is_dir() and not target.is_symlink() and _exchange(partial, target):
        shutil.rmtree(partial)  # now the previous folder
    else:
        if target.is_dir() and not target.is_symlink():
            # no atomic swap here: the previous folder goes aside first; a crash before the next rename leaves the
            # new folder complete under its partial name, which complete_last_checkpoints publishes
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.rename(partial, target)
    fsync_path(target.parent)


def save_folder_atomically(strategy: Any, filepath: Any, step: int, write: Callable[[Path], None]) -> None:
    """Runs ``write(folder)`` on every rank into the partial folder of ``filepath`` and publishes it when all finished.

    Collective: every rank calls it with the same ``filepath`` (rank 0's is broadcast).

    Args:
        strategy: the Lightning strategy (its ``broadcast``, ``barrier``, ``is_global_zero`` and ``world_size``).
        filepath: the checkpoint's path (``<dirpath>/last.ckpt``...).
        step: the global step saved (recorded in the marker).
        write: writes this rank's files of the checkpoint into the folder it is given.
    """
    target = Path(strategy.broadcast(str(filepath)))
    partial = partial_folder(target)
    if strategy.is_global_zero:
        if partial.exists():
            log.info("removing %s, left by a save that did not finish", partial)
            shutil.rmtree(partial)
        partial.parent.mkdir(parents=True, exist_ok=True)
    strategy.barrier("draftsmith_sharded_save_start")
    write(partial)
    strategy.barrier("draftsmith_sharded_save_written")  # every rank's files are in the folder
    if strategy.is_global_zero:
        publish(partial, target, step, strategy.world_size)
    strategy.barrier("draftsmith_sharded_save_published")


def _recover(partial: Path, target: Path) -> None:
    """Rank 0, before resuming: a partial folder is removed, or published when it is complete and its name free (a
    save interrupted between its two renames)."""
    if is_complete(partial) and not target.exists():
        log.warning("publishing %s as %s: its save finished on every rank", partial, target.name)
        os.rename(partial, target)
        return
    if is_complete(partial):
        shutil.rmtree(partial, ignore_errors=True)  # the previous folder, swapped out by a finished save
        return
    log.warning(
        "ignoring %s: a checkpoint folder without %s (a save that did not finish on every rank); removing it",
        partial,
        MARKER,
    )
    shutil.rmtree(partial, ignore_errors=True)


def complete_last_checkpoints(found: set[str], dirpath: Path | None) -> set[str]:
    """The ``last`` checkpoints that ``--ckpt_path last`` may resume: ``found`` without folders lacking the marker.

    On rank 0 it first removes (or, when complete, publishes) the partial folders in ``dirpath`` with one line each.
    Every rank chooses from the same files: a visible folder without the marker is left out with one line, files
    (single-file checkpoints, written atomically) are kept.

    Args:
        found: the paths Lightning's ``ModelCheckpoint._find_last_checkpoints`` found.
        dirpath: the ModelCheckpoint's folder (None: nothing to clean).
    """
    if dirpath is not None and dirpath.is_dir() and rank_zero_only.rank == 0:
        for partial in sorted(dirpath.glob(f".*{PARTIAL_SUFFIX}")):
            if partial.is_dir():
                _recover(partial, dirpath / partial.name[1 : -len(PARTIAL_SUFFIX)])
    kept = set()
    for path in found:
        folder = Path(path)
        if folder.is_dir() and not is_complete(folder):
            if rank_zero_only.rank == 0:
                log.warning(
                    "--ckpt_path last: ignoring %s: a checkpoint folder without %s (not written completely by every "
                    "rank); pass its path to --ckpt_path to load it anyway",
                    folder,
                    MARKER,
                )
            continue
        kept.add(path)
    return kept
