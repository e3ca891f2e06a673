"""One run per checkpoint folder: a fit holds a lock file (``.draftsmith-fit.lock``, an ``fcntl.flock`` taken by global
rank 0, released when the run ends or its process dies) in every checkpoint folder it writes to, and refuses a folder
locked by a running fit. A fresh fit (no ``--ckpt_path``) is refused in a folder that already holds checkpoints, and
so is a resume from a checkpoint outside it: two runs in one folder leave ``last.ckpt`` and ``last-v1.ckpt``, the
config of one beside the checkpoints of the other, and ``--ckpt_path last`` resuming whichever was written last.
``--ckpt_path last`` (or a checkpoint of the folder) resumes into the folder as before, SLURM requeues included.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import IO, Any

from jsonargparse import Namespace
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_only

from trainer.interface.errors import CheckpointError

log = logging.getLogger(__name__)

LOCK_FILE = ".draftsmith-fit.lock"


class CheckpointFolderError(CheckpointError, RuntimeError):
    """A fit refused a checkpoint folder that a running fit holds, or that holds another run's checkpoints."""


class FolderLock:
    """An exclusive ``fcntl.flock`` on ``<folder>/.draftsmith-fit.lock``, which records its holder.

    The operating system drops the lock when the holder's process ends, however it ends, so the lock of a killed run
    never blocks the next one; the file itself stays (removing it could let two processes lock two different files).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> str | None:
        """Takes the lock; returns None when held now, else what the file says of the process holding it.

        On a file system without ``flock`` support it logs a warning and returns None: the fit goes ahead, and a
        concurrent one into the same folder goes undetected.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")  # held open for the run
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                handle.close()
                log.warning("cannot lock %s (%s): a concurrent fit into this folder goes undetected", self.path, err)
                return None
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            return holder or "a process that has not written its name yet"
        handle.seek(0)
        handle.truncate()
        job = os.environ.get("SLURM_JOB_ID")
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}{f' (SLURM job {job})' if job else ''}, {started}\n")
        handle.flush()
        self._file = handle
        return None

    def release(self) -> None:
        """Drops the lock (a no-op when not held)."""
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def checkpoint_dirs(trainer: Trainer) -> list[Path]:
    """The local folders the trainer's checkpoint callbacks write into, each once.

    A ModelCheckpoint without a dirpath is resolved as it resolves it in its own setup (``<logger save_dir>/<name>/
    <version>/checkpoints``, or ``<default_root_dir>/checkpoints`` without a logger); remote folders are left out.
    """
    out: list[Path] = []
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is None and isinstance(callback, ModelCheckpoint):
            dirpath = _default_checkpoint_dir(trainer)
        if dirpath is None or "://" in str(dirpath):
            continue
        folder = Path(dirpath).expanduser().resolve()
        if folder not in out:
            out.append(folder)
    return out


def _default_checkpoint_dir(trainer: Trainer) -> str:
    if trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        return os.path.join(save_dir, str(logger.name), version, "checkpoints")
    return os.path.join(trainer.default_root_dir, "checkpoints")


def _checkpoints_in(folder: Path) -> list[str]:
    """Names of the checkpoints (files, or DeepSpeed and FSDP checkpoint folders) in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".ckpt")) if folder.is_dir() else []


def _names(names: list[str], shown: int = 6) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _last_checkpoints(trainer: Trainer) -> list[Path]:
    """What ``--ckpt_path last`` chooses from: the ``last``/``last-vN`` files of the ModelCheckpoints and the files
    of the other checkpoint callbacks (OnExceptionCheckpoint), those that exist."""
    found: list[Path] = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            dirpath = callback.dirpath if callback.dirpath is not None else _default_checkpoint_dir(trainer)
            if "://" in str(dirpath) or not Path(dirpath).is_dir():
                continue
            name = re.compile(
                rf"{re.escape(callback.CHECKPOINT_NAME_LAST or 'last')}(-\d+)?{re.escape(callback.FILE_EXTENSION)}"
            )
            found += [p for p in Path(dirpath).iterdir() if name.fullmatch(p.name)]
        elif getattr(callback, "ckpt_path", None) and Path(callback.ckpt_path).exists():
            found.append(Path(callback.ckpt_path))
    return found


class SaveConfigBesideCheckpoints(SaveConfigCallback):
    """Claims the checkpoint folders of a fit (see the module docstring), then saves the resolved config to the log
    directory (Lightning's default) and into every checkpoint directory; releases the folders when the fit ends."""

    def __init__(self, parser: LightningArgumentParser, config: Namespace, **kwargs: Any) -> None:
        super().__init__(parser, config, **kwargs)
        self._locks: list[FolderLock] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            problem = None
            if trainer.is_global_zero:
                try:
                    problem = self._claim_folders(trainer)
                except OSError as err:
                    problem = f"cannot use the checkpoint folder: {err}"
            problem = trainer.strategy.broadcast(problem)  # every rank stops, not only rank 0
            if problem:
                self._release()
                raise CheckpointFolderError(problem)
        super().setup(trainer, pl_module, stage)

    def _claim_folders(self, trainer: Trainer) -> str | None:
        """Locks every checkpoint folder; returns why this fit must not write into them, or None."""
        folders = checkpoint_dirs(trainer)
        for folder in folders:
            lock = FolderLock(folder)
            holder = lock.acquire()
            if holder is not None:
                self._release()
                return (
                    f"the checkpoint folder {folder} is in use by a running fit ({holder}; lock file {lock.path}): "
                    "wait until it ends, or write this run into another folder (the ModelCheckpoint dirpath)"
                )
            self._locks.append(lock)
        if "ckpt_path" not in self.config:
            return None  # not run through `fit` (LightningCLI run=False): what is resumed is unknown here
        used = {folder: names for folder in folders if (names := _checkpoints_in(folder))}
        if not used:
            return None
        requested = self.config.get("ckpt_path")
        if requested == "last" and _last_checkpoints(trainer):
            return None  # resumes the run of this folder
        if requested is not None and requested != "last":
            if str(requested) in ("best", "hpc", "registry") or str(requested).startswith("registry:"):
                return None  # Lightning's names for checkpoints of this run
            source = Path(str(requested)).expanduser().resolve()
            if "://" not in str(requested) and any(folder in source.parents for folder in folders):
                return None  # a checkpoint of this folder
        listing = "; ".join(f"{folder}: {_names(names)}" for folder, names in used.items())
        how = "a fresh run" if requested in (None, "last") else f"a run resumed from {requested}"
        return (
            f"the checkpoint folder already holds another run's checkpoints ({listing}), and {how} would write beside "
            "them (a second last.ckpt, its config.yaml, its export): resume that run (--ckpt_path last, or the path "
            "of one of its checkpoints), or write "
            "this one into another folder (the dirpath of the ModelCheckpoint in trainer.callbacks, and the model's "
            "export folder)"
        )

    def _release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    @rank_zero_only
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for folder in checkpoint_dirs(trainer):
            folder.mkdir(parents=True, exist_ok=True)
            self.parser.save(
                self.config, str(folder / self.config_filename), skip_none=False, overwrite=True, multifile=False
            )
