"""Checkpoint files that are whole or absent: a save that fails (a full disk) never destroys the previous one.

Why not Lightning's own (lightning 2.6.6)
-----------------------------------------
``TorchCheckpointIO.save_checkpoint`` calls ``lightning.fabric.utilities.cloud_io._atomic_save``: the checkpoint is
serialised into memory, then written through an fsspec transaction. For a local path fsspec's ``LocalFileOpener``
writes to ``tempfile.mkstemp()`` (the system temporary folder, usually another file system than the run's) and commits
with ``shutil.move``, which across file systems copies the temporary file *over* the existing ``last.ckpt``: the old
file is truncated first, so a disk that fills during the copy leaves neither checkpoint. ``ModelCheckpoint`` rewrites
``last.ckpt`` in place at every save (``_save_last_checkpoint``), so the one file a preempted or crashed run resumes
from is the one at risk.

What :class:`AtomicCheckpointIO` does
-------------------------------------
It writes ``<folder>/.<name>.<random>.tmp`` beside the checkpoint, streaming ``torch.save`` into it (no second copy in
memory), flushes and fsyncs it, then ``os.replace``s it onto the checkpoint's name (atomic on one file system) and
fsyncs the folder. On an ``OSError`` (``ENOSPC``, a quota, an I/O error) the temporary file is removed and a
:class:`~trainer.interface.errors.CheckpointError` names the folder and says that the previous checkpoint there is
intact. Reading a checkpoint that is truncated or not a checkpoint (``--ckpt_path``) is a CheckpointError naming the
file.

Where it applies: every strategy that writes one file through its CheckpointIO (single device, DDP, FSDP with
``state_dict_type="full"``, ModelParallel without distributed checkpoints). DeepSpeed writes its own checkpoint
folders (``deepspeed_engine.save_checkpoint``, which never calls a CheckpointIO), and sharded FSDP / ModelParallel
checkpoints go through ``torch.distributed.checkpoint``: this plugin does not change those; their folders are published
whole by :mod:`trainer.checkpoints.sharded`.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from trainer.interface.errors import CheckpointError

log = logging.getLogger(__name__)


def _is_local(path: str | os.PathLike) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_path(path: Path) -> None:
    """Makes ``path`` durable: a file's bytes, or a rename in a folder (best effort: some file systems refuse to
    open a folder or to sync it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _FirstWriteError:
    """A binary file that keeps the first OSError of its writes: torch.save's zip writer turns a write that failed (a
    full disk) into a RuntimeError of its own ("unexpected pos N vs M"), which would hide the cause."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose saves are atomic on the checkpoint's own file system (see the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Writes ``checkpoint`` to a temporary file beside ``path``, fsyncs it and renames it onto ``path``.

        Raises:
            CheckpointError: the write failed (a full disk...): names the folder; the previous file is intact.
            TypeError: ``storage_options`` was given (as TorchCheckpointIO).
        """
        if not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        target = Path(str(path).removeprefix("file://"))
        folder = target.parent
        existed = target.exists()
        tmp: Path | None = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
            tmp = Path(name)
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide the checkpoint from the group
            with os.fdopen(fd, "wb") as f:
                sink = _FirstWriteError(f)
                try:
                    self.write(checkpoint, sink)
                except Exception as err:
                    if sink.error is None:
                        raise
                    raise sink.error from err  # torch.save reports a failed write as "unexpected pos ..."
                if sink.error is not None:
                    raise sink.error
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            tmp = None
            fsync_path(folder)
        except OSError as err:
            previous = (
                f"the previous {target.name} there is intact" if existed else f"no {target.name} was there before"
            )
            reason = os.strerror(err.errno) if err.errno else str(err)
            hint = (
                f"free space in {folder} (or point the ModelCheckpoint dirpath elsewhere), then resume with "
                "--ckpt_path last"
                if err.errno in (errno.ENOSPC, errno.EDQUOT)
                else f"check that {folder} is writable, then resume with --ckpt_path last"
            )
            raise CheckpointError(
                f"could not write checkpoint {target.name} in {folder}: {reason}; {previous}", hint
            ) from err
        finally:
            if tmp is not None:
                try:
                    tmp.unlink()
                except OSError:
                    log.warning("could not remove the partial checkpoint %s", tmp)

    @staticmethod
    def write(checkpoint: dict[str, Any], f: Any) -> None:
        """Serialises ``checkpoint`` into the open binary file ``f`` (``torch.save``; tests replace it)."""
        torch.save(checkpoint, f)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """TorchCheckpointIO's load; a local file that is truncated, not a checkpoint or holds refused objects is a
        CheckpointError naming it."""
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except Exception as err:
            if not _is_local(path) or not Path(str(path)).is_file():
                raise
            from trainer.checkpoints.reading import explain_load_error

            explained = explain_load_error(Path(str(path)), err)
            if explained is None:
                raise
            raise explained from err


def default_checkpoint_io() -> AtomicCheckpointIO:
    """The CheckpointIO every fit gets unless its recipe sets ``trainer.plugins``: :class:`AtomicCheckpointIO`."""
    return AtomicCheckpointIO()
