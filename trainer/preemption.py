"""Checkpoint-and-stop on SIGUSR1 / SIGTERM at a step boundary, and requeue the SLURM job on SIGUSR1.

Why not Lightning's own SLURM requeue (lightning 2.6.6)
-------------------------------------------------------
With ``SLURMEnvironment(auto_requeue=True, requeue_signal=SIGUSR1)`` (the default under SLURM) Lightning's handler
saves ``<default_root_dir>/hpc_ckpt_<n>.ckpt`` *inside the signal handler*, wherever the step is (between the
backward and the optimizer step, or inside a collective of another rank), then runs ``scontrol requeue``. The next run
picks that file only when ``ckpt_path`` is None (``_parse_ckpt_path``: ``"hpc"`` is chosen for ``ckpt_path=None`` on
SLURM); ``--ckpt_path last`` looks only at the ``last*.ckpt`` files of the ModelCheckpoint callbacks (and
OnExceptionCheckpoint), so it would ignore the hpc file and resume from an older checkpoint, or from scratch. On
SIGTERM Lightning sets ``trainer.received_sigterm`` and raises ``SIGTERMException`` at the next batch boundary without
saving anything.

What this callback does
-----------------------
Its handlers only record the signal. At the end of the next training batch (where ModelCheckpoint saves, so the
checkpoint is the same as a regular one and resumes exactly: weights, optimizer, LR schedule, loops, and the data
position that ``TextDataModule.state_dict`` stores), the ranks agree (a signal seen by any rank counts), save
``<ModelCheckpoint dirpath>/last.ckpt`` with ``trainer.save_checkpoint``, and stop. On SIGUSR1 inside a SLURM job,
rank 0 then runs ``scontrol requeue <job>``; the requeued job runs the same ``fit ... --ckpt_path last`` and resumes
from that file. ``draftsmith slurm submit`` adds this callback to every job; add it to a local run with
``--trainer.callbacks+=trainer.preemption.PreemptionCheckpoint`` so that ``kill -TERM`` saves before the exit.

The handlers replace Lightning's SIGUSR1/SIGTERM handlers from ``on_train_start`` to the end of fit (Lightning
restores its own, and the original ones, at teardown). A signal that arrives before training starts is acted on at the
first batch end. Under Lightning's own process launcher (``devices: N`` without SLURM or torchrun), a SIGTERM sent to
rank 0 is forwarded to the other ranks, as Lightning does.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """On SIGUSR1 or SIGTERM: save last.ckpt at the next batch end and stop; on SIGUSR1 under SLURM also requeue."""

    def __init__(self, requeue_signal: str = "SIGUSR1", requeue: bool = True, save_on_sigterm: bool = True) -> None:
        """Create the callback.

        Args:
            requeue_signal: the signal that means "the time limit is near": save, stop and requeue the SLURM job
                (the sbatch script's ``--signal``, USR1 by default).
            requeue: run ``scontrol requeue $SLURM_JOB_ID`` after saving on ``requeue_signal`` (only inside a SLURM
                job; elsewhere the run saves and stops).
            save_on_sigterm: also save and stop on SIGTERM (no requeue), instead of Lightning's exit without saving.
        """
        try:
            self.requeue_signum = signal.Signals[requeue_signal]
        except KeyError as err:
            raise ValueError(f"PreemptionCheckpoint: unknown requeue_signal {requeue_signal!r}") from err
        self.requeue = requeue
        self.save_on_sigterm = save_on_sigterm
        self._received: set[int] = set()
        self._previous: dict[int, Any] = {}
        self._trainer: L.Trainer | None = None
        self.saved_path: str | None = None

    # ---------------------------------------------------------------------------------------------- signals

    def _signals(self) -> list[int]:
        out = [self.requeue_signum]
        if self.save_on_sigterm and signal.SIGTERM not in out:
            out.append(signal.SIGTERM)
        return out

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = signum not in self._received
        self._received.add(signum)
        log.info("received %s: checkpointing at the end of this batch", signal.Signals(signum).name)
        trainer = self._trainer
        launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
        if first and signum == signal.SIGTERM and launcher is not None and hasattr(launcher, "kill"):
            launcher.kill(signum)  # Lightning's subprocess launcher: pass it on to the other local ranks

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("PreemptionCheckpoint: not on the main thread; signal handlers not installed")
            return
        for signum in self._signals():
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def _uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    # ---------------------------------------------------------------------------------------------- hooks

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._checkpoint_callback(trainer) is None:
            raise ValueError(
                "PreemptionCheckpoint needs a ModelCheckpoint in trainer.callbacks (its dirpath receives last.ckpt, "
                "which `--ckpt_path last` resumes from)"
            )
        self._trainer = trainer
        self._received = set()
        self.saved_path = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after Lightning's signal connector registered its handlers: ours replace them for the training loop
        self._install()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        local = bool(self._received)
        stop = trainer.strategy.reduce_boolean_decision(local, all=False) if trainer.world_size > 1 else local
        if not stop or self.saved_path is not None:
            return
        requeue = self.requeue_signum in self._received
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        self.saved_path = path
        log.info("preemption: saved %s at step %d; stopping", path, trainer.global_step)
        if requeue and self.requeue and trainer.is_global_zero:
            _requeue_slurm_job()
        trainer.should_stop = True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._uninstall()
        self._trainer = None

    # ---------------------------------------------------------------------------------------------- helpers

    @staticmethod
    def _checkpoint_callback(trainer: L.Trainer) -> ModelCheckpoint | None:
        found = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        return found[0] if found else None

    def checkpoint_path(self, trainer: L.Trainer) -> str:
        """``<dirpath>/last.ckpt`` of the first ModelCheckpoint: the file that ``--ckpt_path last`` finds."""
        callback = self._checkpoint_callback(trainer)
        if callback is None or callback.dirpath is None:
            raise ValueError("PreemptionCheckpoint: the ModelCheckpoint has no dirpath yet")
        return str(Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}")


def _requeue_slurm_job() -> None:
    """``scontrol requeue`` this SLURM job (array tasks included); a warning outside SLURM or on failure."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job_id or not re.fullmatch(r"[0-9_]+", job_id):
        log.warning("preemption: not inside a SLURM job (SLURM_JOB_ID=%r); not requeued", job_id)
        return
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("preemption: scontrol requeue %s failed: %s", job_id, err)
        return
    if proc.returncode == 0:
        log.info("preemption: requeued SLURM job %s", job_id)
    else:
        log.warning("preemption: scontrol requeue %s failed (%d): %s", job_id, proc.returncode, proc.stderr.strip())
