"""What a fit shows while it runs and when it ends.

:class:`ProgressLog` (the ``progress`` section of every recipe, ``--progress.every_n_steps``,
``--progress.every_seconds``) logs one plain-text line every ``every_n_steps`` optimizer steps, at least every
``every_seconds`` and at the last step, on global rank zero, whenever no live progress bar is shown (off a terminal,
``draftsmith fit`` replaces Lightning's bar by these lines)::

    step 120/600 | loss 2.31 | lr 3.0e-04 | 1,734 tok/s | elapsed 2m10s | eta 8m40s | val loss 2.40 | tau 2.61

The values are what the objective logs (``train/loss``, ``train/lr``, ``train/tokens_per_s``, ``val/loss``;
trainer/training/objective.py) and the latest measurement of :class:`~trainer.decoding.callback.SpeculativeEvalCallback`
(``tau``, ``tau_sampling``, ``acceptance``). A validation run adds a ``step N/M | val loss X`` line when it ends.

:class:`StepProgressBar` is Lightning's live bar on a terminal, with ``Epoch 0`` instead of ``Epoch 0/-2`` in fits
that ``max_steps`` ends; :class:`ModelSummaryWithoutFlops` is Lightning's model summary without its FLOPs column and
``Total Flops`` line (always 0 here: no example input is declared); :func:`fit_summary` is the closing block of a fit.
"""

from __future__ import annotations

import logging
import math
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary, RichProgressBar
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

from trainer.interface.errors import RecipeError
from trainer.interface.output import NO_PROMPTS, PROGRESS_EVERY_SECONDS, block, duration, elapsed_and_eta, eval_command

log = logging.getLogger(__name__)

DEFAULT_EVERY_N_STEPS = 50
DEFAULT_EVERY_SECONDS = PROGRESS_EVERY_SECONDS
_SPEC_EVAL = (("tau", "spec_eval/tau"), ("tau sampling", "spec_eval/tau_sampling"))


def _metric(trainer: pl.Trainer, name: str) -> float | None:
    value = trainer.callback_metrics.get(name)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def spec_eval_values(trainer: pl.Trainer) -> tuple[int, dict[str, float]] | None:
    """(step, values) of the last measurement of the trainer's SpeculativeEvalCallback, or None."""
    for callback in trainer.callbacks:
        values = getattr(callback, "last", None)
        if type(callback).__name__ == "SpeculativeEvalCallback" and values:
            return int(getattr(callback, "_last_step", trainer.global_step)), values
    return None


class ProgressLog(Callback):
    """Plain-text progress lines for logs that are files (SLURM, nohup, a redirected fit): see the module docstring."""

    def __init__(
        self, every_n_steps: int = DEFAULT_EVERY_N_STEPS, every_seconds: float = DEFAULT_EVERY_SECONDS
    ) -> None:
        """
        Args:
            every_n_steps: a line every this many optimizer steps (0: none by count).
            every_seconds: a line at least this often, at the first step boundary after it elapsed (0: none by
                time). The last step always has its line.
        """
        if every_n_steps < 0:
            raise RecipeError(f"progress.every_n_steps: must be 0 (off) or a positive step count, got {every_n_steps}")
        if not every_seconds >= 0:
            raise RecipeError(f"progress.every_seconds: must be 0 (off) or positive seconds, got {every_seconds}")
        self.every_n_steps, self.every_seconds = every_n_steps, every_seconds
        self.started: float | None = None  # time.monotonic() at the first training batch of this run
        self.ended: float | None = None  # and at the end of training
        self._first_step = 0  # global step this run started from (a resumed run starts past 0)
        self._last_line: float | None = None
        self._last_step = -1

    def _active(self, trainer: pl.Trainer) -> bool:
        return trainer.is_global_zero and trainer.progress_bar_callback is None and not trainer.sanity_checking

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = self._last_line = time.monotonic()
        self._first_step = self._last_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ended = time.monotonic()

    def elapsed(self) -> float:
        """Seconds of training in this run (0 before it started)."""
        if self.started is None:
            return 0.0
        return (self.ended or time.monotonic()) - self.started

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:  # gradient accumulation: no optimizer step yet
            return
        self._last_step = step
        if not self._active(trainer):
            return
        now = time.monotonic()
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        by_count = self.every_n_steps > 0 and step % self.every_n_steps == 0
        by_time = self.every_seconds > 0 and now - (self._last_line or now) >= self.every_seconds
        if last or by_count or by_time or trainer.should_stop:
            self._last_line = now
            log.info(self.line(trainer))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active(trainer) and trainer.state.fn == "fit":
            loss = _metric(trainer, "val/loss")
            if loss is not None:
                log.info(f"{self._step_text(trainer)} | val loss {loss:.4g}")

    def _step_text(self, trainer: pl.Trainer) -> str:
        step = trainer.global_step
        if trainer.max_steps > 0:
            return f"step {step}/{trainer.max_steps}"
        return f"step {step} (epoch {trainer.current_epoch})"

    def line(self, trainer: pl.Trainer) -> str:
        """The progress line at the trainer's current step."""
        parts = [self._step_text(trainer)]
        loss, lr, rate = (_metric(trainer, name) for name in ("train/loss", "train/lr", "train/tokens_per_s"))
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        if lr is not None:
            parts.append(f"lr {lr:.1e}")
        if rate is not None:
            parts.append(f"{rate:,.0f} tok/s")
        left = max(0, trainer.max_steps - trainer.global_step) if trainer.max_steps > 0 else 0
        parts += elapsed_and_eta(self.elapsed(), trainer.global_step - self._first_step, left)
        val = _metric(trainer, "val/loss")
        if val is not None:
            parts.append(f"val loss {val:.4g}")
        measured = spec_eval_values(trainer)
        if measured is not None:
            values = measured[1]
            parts += [f"{label} {values[key]:.2f}" for label, key in _SPEC_EVAL if key in values]
            if "spec_eval/acceptance_rate" in values:
                parts.append(f"acceptance {values['spec_eval/acceptance_rate']:.2f}")
        return " | ".join(parts)


class StepProgressBar(RichProgressBar):
    """Lightning's Rich bar, reading ``Epoch 3`` in fits without an epoch limit (``max_steps``), where Lightning
    writes ``Epoch 3/-2``."""

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs > 0:
            return super()._get_train_description(current_epoch)
        text = f"Epoch {current_epoch}"
        if self.trainer.max_steps > 0:
            text += f" (max_steps {self.trainer.max_steps})"
        return f"{text:{len(self.validation_description)}}"  # as Lightning pads it: no flicker beside "Validation"


class ModelSummaryWithoutFlops(ModelSummary):
    """Lightning's model summary (a plain-text table through the log) without the FLOPs column and the ``Total
    Flops`` line: Lightning counts FLOPs only for a module that declares an example input, and none here does."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs,
    ) -> None:
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, total_flops, *columns
        )
        lines = [line for line in table.split("\n") if not line.rstrip().endswith("Total Flops")]
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info("model summary\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------------------- closing block


def _existing(path) -> str | None:
    """``path`` if it exists on disk, relative to the working folder when it lies inside it; else None."""
    if not path or not Path(path).exists():
        return None
    resolved, here = Path(path).resolve(), Path.cwd().resolve()
    return str(resolved.relative_to(here)) if resolved.is_relative_to(here) else str(path)


def last_checkpoint(trainer: pl.Trainer) -> str | None:
    """The ``last.ckpt`` (file or sharded folder) a ModelCheckpoint of the trainer wrote, if it exists on disk."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            found = _existing(callback.last_model_path) or (
                _existing(Path(callback.dirpath) / "last.ckpt") if callback.dirpath else None
            )
            if found:
                return found
    return None


def _quote(text: str) -> str:
    return shlex.quote(str(text))


def next_commands(
    trainer: pl.Trainer, module: pl.LightningModule, checkpoint: str | None, export: str | None
) -> tuple[list[str], str | None, str]:
    """The ``draftsmith export`` and ``draftsmith eval`` lines for this run, its export formats (a row of the block)
    and what to do to measure it when the recipe names no held-out prompts (else ""); ([], None, "") for a module
    without a drafter record."""
    from trainer.training.registry import get_kind

    try:
        record = module.drafter_record()
        kind = get_kind(record.kind, "the fit's module")
    except Exception:  # no drafter (e.g. a module another project wrote): no next step to name
        return [], None, ""
    formats = [f.name for f in kind.formats_for(record)] or [f.name for f in kind.formats]
    commands = []
    drafter = export
    root = Path(trainer.default_root_dir)
    if export is None and checkpoint is not None:
        drafter = str(root / "export")
        commands.append(
            f"draftsmith export --ckpt_path {_quote(checkpoint)} --output_dir {_quote(drafter)} --format {formats[0]}"
        )
    prompts, prompt_tokens = None, 0
    for callback in trainer.callbacks:
        if type(callback).__name__ == "SpeculativeEvalCallback":
            prompts, prompt_tokens = getattr(callback, "source", None), getattr(callback, "prompt_tokens", 0)
    if prompts is None:
        val_files = getattr(trainer.datamodule, "val_files", None) if trainer.datamodule is not None else None
        prompts = val_files[0] if val_files else None
    measure = ""
    if drafter is not None and record.target:
        if prompts is None:
            measure = NO_PROMPTS
        else:
            commands.append(eval_command(record.target, drafter, prompts, prompt_tokens, root / "eval"))
    return commands, ", ".join(formats), measure


def fit_summary(
    trainer: pl.Trainer, module: pl.LightningModule, configs: Sequence[str], wall_s: float, status: int
) -> str:
    """The block ``draftsmith fit`` ends with: what ran (objective, recipe), the steps (and the step a resumed run
    started from), this run's training tokens and tokens/s over its training steps' time (the objective's
    ``training_throughput``, what ``train/tokens_per_s`` measures), the wall-clock time beside it, the final
    losses, tau when measured, where ``last.ckpt``, the export and the logs are (only paths that exist), and the
    exact ``draftsmith export`` and ``draftsmith eval`` commands that come next.

    Args:
        trainer: the fit's trainer, after ``fit`` returned.
        module: its module.
        configs: the recipe files, in ``--config`` order.
        wall_s: seconds the whole command took.
        status: the fit's exit status (0: finished; 128 + signal: stopped by a signal after saving).
    """
    progress = next((c for c in trainer.callbacks if isinstance(c, ProgressLog)), None)
    step, max_steps = trainer.global_step, trainer.max_steps
    title = f"fit done in {duration(wall_s)}" if status == 0 else f"fit stopped (exit status {status})"
    steps = f"{step}/{max_steps}" if max_steps > 0 else f"{step}"
    if progress is not None and progress.started is not None and progress._first_step > 0:
        steps += f", resumed from step {progress._first_step}"
    throughput = getattr(module, "training_throughput", None)
    tokens, train_s = throughput() if callable(throughput) else (0, 0.0)
    counted = ""
    if tokens and train_s > 0:
        counted = f"{tokens:,} in this run, {tokens / train_s:,.0f} tokens/s over {duration(train_s)} of training steps"
    time_row = f"{duration(wall_s)} wall clock" + (f", {duration(train_s)} of it in training steps" if counted else "")
    losses = [(label, _metric(trainer, f"{label}/loss")) for label in ("train", "val")]
    loss = ", ".join(f"{label} {value:.4g}" for label, value in losses if value is not None)
    measured = spec_eval_values(trainer)
    tau = ""
    if measured is not None:
        at, values = measured
        modes = [(values[k], "greedy" if label == "tau" else "sampling") for label, k in _SPEC_EVAL if k in values]
        tau = ", ".join(f"{value:.2f} {mode}" for value, mode in modes) + f" (measured at step {at})"
    checkpoint = last_checkpoint(trainer)
    export = _existing(getattr(module, "export_dir", None))
    logger = trainer.logger
    logs = _existing(getattr(logger, "log_dir", None)) if logger is not None else None
    commands, formats, measure = next_commands(trainer, module, checkpoint, export)
    recipe = " ".join(str(c) for c in configs)
    rows = [
        ("method", f"{type(module).__name__} ({type(module).__module__})"),
        ("recipe", recipe),
        ("steps", steps),
        ("tokens", counted),
        ("time", time_row),
        ("loss", loss),
        ("tau", tau),
        ("checkpoint", checkpoint or ""),
        ("export", export or ""),
        ("formats", formats or ""),
        ("logs", logs or ""),
        ("measure", measure),
    ]
    return block(title, rows, commands)
