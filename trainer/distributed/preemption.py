"""Checkpoint-and-stop on SIGUSR1 / SIGTERM / SIGINT at a step boundary, and requeue the SLURM job on SIGUSR1.

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

What this callback does ----------------------- Its handlers only record the signal. At the end of the next training
batch (where ModelCheckpoint saves, so the checkpoint is the same as a regular one and resumes exactly: weights,
optimizer, LR schedule, loops, and the data position that ``TextDataModule.state_dict`` stores), the ranks agree (a
signal seen by any rank counts), save ``<ModelCheckpoint dirpath>/last.ckpt`` with ``trainer.save_checkpoint``, and
stop. On SIGUSR1 inside a SLURM job, rank 0 then runs ``scontrol requeue <job>``; the requeued job runs the same ``fit
... --ckpt_path last`` and resumes from that file. Every ``draftsmith fit`` gets one
(:func:`default_preemption_checkpoint`, added by trainer/training/recipe.py unless the recipe names its own), and
``draftsmith slurm submit`` adds one to every job; trainer/cli.py exits with
:func:`exit_status_after_fit`.

Ctrl-C (SIGINT) does the same: the first one saves ``last.ckpt`` at the end of the batch and stops (Lightning alone
saves nothing and exits 1); a second one stops at once without saving (KeyboardInterrupt, as without this callback).

The exit status: a fit that a signal stopped before it finished must not look like a success to a scheduler or a
shell (Lightning ends a SIGTERM with ``SystemExit()``, status 0). :func:`exit_status_after_fit` returns what the
process should exit with after ``trainer.fit`` returns: ``128 + signal number`` (143 for SIGTERM, 130 for SIGINT, 138
for SIGUSR1, as shells report a process a signal ended) when this callback stopped the run before its last step,
else 0 (also after a SLURM requeue: the job goes on).

The handlers replace Lightning's SIGUSR1/SIGTERM handlers (and Python's SIGINT handler) from ``on_train_start`` to the
end of fit (Lightning restores its own, and the original ones, at teardown). A SIGTERM that Lightning's handler
recorded before training started (during the sanity check) is taken over and acted on at the first batch end; before
Lightning registers its handlers (while the model is built or the data tokenized) a signal ends the process as it
would without this callback (SIGTERM: killed, status 143; Ctrl-C: KeyboardInterrupt, status 1), with nothing to save
yet. Under Lightning's own process launcher (``devices: N`` without SLURM or torchrun), a SIGTERM sent to rank 0 is
forwarded to the other ranks, as Lightning does.

DataLoader workers (``data.num_workers > 0``): Ctrl-C in a terminal, and SLURM's scancel or time limit, signal every
process of the job, the workers too. A worker that a SIGINT stops, or that a SIGTERM kills (PyTorch's worker handler),
makes the main process raise "DataLoader worker ... is killed by signal" before it can save. The data modules' loaders
start their workers with :func:`worker_leaves_stop_signals_to_the_main_process`: a worker ignores SIGINT, and a
SIGTERM while its loader still runs; the main process saves, stops and shuts its workers down as at the end of any
fit (a SIGTERM after the loader began its shutdown, as PyTorch sends a worker that did not exit in time, ends the
worker; one whose main process died ends by PyTorch's own watchdog).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from trainer.interface.errors import RecipeError

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """On SIGUSR1, SIGTERM or SIGINT: save last.ckpt at the next batch end and stop; on SIGUSR1 under SLURM also
    requeue. After fit, :func:`exit_status_after_fit` gives the process's exit status."""

    def __init__(
        self,
        requeue_signal: str = "SIGUSR1",
        requeue: bool = True,
        save_on_sigterm: bool = True,
        save_on_sigint: bool = True,
        require_checkpoint: bool = True,
    ) -> None:
        """Create the callback.

        Args:
            requeue_signal: the signal that means "the time limit is near": save, stop and requeue the SLURM job
                (the sbatch script's ``--signal``, USR1 by default).
            requeue: run ``scontrol requeue $SLURM_JOB_ID`` after saving on ``requeue_signal`` (only inside a SLURM
                job; elsewhere the run saves and stops).
            save_on_sigterm: also save and stop on SIGTERM (no requeue), instead of Lightning's exit without saving.
            save_on_sigint: also save and stop on the first Ctrl-C (SIGINT); a second one stops without saving.
            require_checkpoint: refuse a fit without a ModelCheckpoint (whose dirpath receives last.ckpt); False (the
                instance every fit gets by default) leaves such a fit alone, with Lightning's own signal handling.
        """
        try:
            self.requeue_signum = signal.Signals[requeue_signal]
        except KeyError as err:
            raise RecipeError(
                f"PreemptionCheckpoint: unknown requeue_signal {requeue_signal!r}",
                hint="a signal name such as SIGUSR1 or SIGUSR2",
            ) from err
        self.requeue = requeue
        self.save_on_sigterm = save_on_sigterm
        self.save_on_sigint = save_on_sigint
        self.require_checkpoint = require_checkpoint
        self._active = False
        self._received: set[int] = set()
        self._previous: dict[int, Any] = {}
        self._trainer: L.Trainer | None = None
        self.saved_path: str | None = None
        self.stopped_by: int | None = None  # the signal this callback stopped the run on
        self.finished = False  # whether that run had reached its last step anyway
        self.requeued = False  # whether this process requeued its SLURM job (the job goes on: not a failure)

    # ---------------------------------------------------------------------------------------------- signals

    def _signals(self) -> list[int]:
        out = [self.requeue_signum]
        if self.save_on_sigterm and signal.SIGTERM not in out:
            out.append(signal.SIGTERM)
        if self.save_on_sigint and signal.SIGINT not in out:
            out.append(signal.SIGINT)
        return out

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = signum not in self._received
        if signum == signal.SIGINT and not first:
            log.warning("second Ctrl-C: stopping now, without saving")
            raise KeyboardInterrupt
        self._received.add(signum)
        if signum == signal.SIGINT:
            log.warning("Ctrl-C: saving last.ckpt at the end of this batch, then stopping (Ctrl-C again: stop now)")
        else:
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
        self._active = False
        if stage != "fit":
            return
        if self._checkpoint_callback(trainer) is None:
            if not self.require_checkpoint:
                log.info("PreemptionCheckpoint: no ModelCheckpoint in this fit, so no last.ckpt to save on a signal")
                return
            raise RecipeError(
                "PreemptionCheckpoint needs a ModelCheckpoint in trainer.callbacks (its dirpath receives last.ckpt, "
                "which `--ckpt_path last` resumes from)"
            )
        self._active = True
        self._trainer = trainer
        self._received = set()
        self.saved_path = None
        self.stopped_by = None
        self.finished = False
        self.requeued = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._active:
            return
        # after Lightning's signal connector registered its handlers: ours replace them for the training loop
        self._install()
        connector = getattr(trainer, "_signal_connector", None)
        if self.save_on_sigterm and getattr(connector, "received_sigterm", False):
            # a SIGTERM during the sanity check: Lightning would exit with status 0 at the first batch, unsaved
            connector.received_sigterm = False
            self._received.add(signal.SIGTERM)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        local = bool(self._received)
        stop = trainer.strategy.reduce_boolean_decision(local, all=False) if trainer.world_size > 1 else local
        if not stop or self.saved_path is not None:
            return
        requeue = self.requeue_signum in self._received
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        self.saved_path = path
        self.stopped_by = self._stopping_signal()
        self.finished = _at_last_step(trainer)
        log.info("preemption: saved %s at step %d; stopping", path, trainer.global_step)
        if requeue and self.requeue:
            # rank 0 requeues the job; the other ranks of a SLURM job take it as done (their exit is not a failure)
            self.requeued = _requeue_slurm_job() if trainer.is_global_zero else "SLURM_JOB_ID" in os.environ
        trainer.should_stop = True

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._uninstall()
        self._trainer = None

    # ---------------------------------------------------------------------------------------------- helpers

    def _stopping_signal(self) -> int:
        """The signal the run stops on (another rank's when this one received none): SIGTERM before the requeue
        signal before SIGINT."""
        for signum in (signal.SIGTERM, self.requeue_signum, signal.SIGINT):
            if signum in self._received:
                return int(signum)
        return int(signal.SIGTERM)

    @staticmethod
    def _checkpoint_callback(trainer: L.Trainer) -> ModelCheckpoint | None:
        found = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        return found[0] if found else None

    def checkpoint_path(self, trainer: L.Trainer) -> str:
        """``<dirpath>/last.ckpt`` of the first ModelCheckpoint: the file that ``--ckpt_path last`` finds."""
        callback = self._checkpoint_callback(trainer)
        if callback is None or callback.dirpath is None:
            raise RecipeError("PreemptionCheckpoint: the ModelCheckpoint has no dirpath yet")
        return str(Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}")


_main_exiting = None  # a multiprocessing Event, set when the main process exits (made before its loaders fork workers)


def _set_main_exiting() -> None:
    if _main_exiting is not None:
        _main_exiting.set()


def stop_signal_worker_init() -> Callable[[int], None]:
    """The ``worker_init_fn`` to give a DataLoader, called in the main process where the loader is built: it makes the
    event that tells workers the main process is exiting (inherited by the workers it forks later; set by an atexit
    hook that runs before multiprocessing terminates its daemonic children, so a worker obeys that SIGTERM even when
    the main process ends on an error without shutting its loader down)."""
    global _main_exiting
    if _main_exiting is None:
        _main_exiting = multiprocessing.get_context("fork").Event()
        atexit.register(_set_main_exiting)
    return worker_leaves_stop_signals_to_the_main_process


def worker_leaves_stop_signals_to_the_main_process(worker_id: int) -> None:
    """The ``worker_init_fn`` of the data modules' DataLoaders: in a worker process, ignore SIGINT, and SIGTERM while
    the loader runs (the main process saves, stops and shuts its workers down; see the module's docstring).

    Args:
        worker_id: the worker's index (DataLoader's argument; unused).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _worker_sigterm)


def _worker_sigterm(signum: int, frame: FrameType | None) -> None:
    """A worker's SIGTERM: ignored while its loader runs; once the loader set its ``done_event`` (the shutdown that
    ends with ``terminate()`` for a worker too slow to exit), the worker exits, as PyTorch's own handler does for a
    SIGTERM from its main process."""
    if _main_exiting is not None and _main_exiting.is_set():
        os._exit(0)  # the main process is exiting: multiprocessing's atexit terminates its daemonic workers
    while frame is not None:
        if frame.f_code.co_name == "_worker_loop":  # torch.utils.data._utils.worker
            done = frame.f_locals.get("done_event")
            if done is not None and not done.is_set():
                return
            break
        frame = frame.f_back
    os._exit(0)


def default_preemption_checkpoint() -> PreemptionCheckpoint:
    """The PreemptionCheckpoint every fit gets unless its recipe names one: SIGTERM, SIGINT and SIGUSR1 save last.ckpt
    and stop; a fit without a ModelCheckpoint is left alone."""
    return PreemptionCheckpoint(require_checkpoint=False)


def _at_last_step(trainer: L.Trainer) -> bool:
    """Whether the batch that just ended was the run's last one (max_steps reached, or the last batch of the last
    epoch)."""
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    if max_epochs is None or max_epochs == -1:
        return False
    last_batch = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
    return last_batch and trainer.current_epoch + 1 >= max_epochs


def exit_status_after_fit(trainer: L.Trainer) -> int:
    """The exit status of a process whose ``trainer.fit`` returned: ``128 + signal number`` when a
    :class:`PreemptionCheckpoint` stopped the run on a signal before its last step (143 for SIGTERM, 130 for SIGINT,
    138 for SIGUSR1 outside SLURM), else 0 (also when it requeued its SLURM job, which goes on from ``last.ckpt``).
    The checkpoint it saved is ``last.ckpt``, which ``--ckpt_path last`` resumes from."""
    for callback in trainer.callbacks:
        if not isinstance(callback, PreemptionCheckpoint) or callback.stopped_by is None:
            continue
        if not callback.finished and not callback.requeued:
            return 128 + int(callback.stopped_by)
    return 0


def _requeue_slurm_job() -> bool:
    """``scontrol requeue`` this SLURM job (array tasks included); a warning outside SLURM or on failure.

    Returns:
        Whether the job was requeued.
    """
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job_id or not re.fullmatch(r"[0-9_]+", job_id):
        log.warning("preemption: not inside a SLURM job (SLURM_JOB_ID=%r); not requeued", job_id)
        return False
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("preemption: scontrol requeue %s failed: %s", job_id, err)
        return False
    if proc.returncode == 0:
        log.info("preemption: requeued SLURM job %s", job_id)
        return True
    log.warning("preemption: scontrol requeue %s failed (%d): %s", job_id, proc.returncode, proc.stderr.strip())
    return False
