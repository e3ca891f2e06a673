"""Recipes: the LightningCLI of ``draftsmith fit`` and ``validate``, and :func:`parse_recipe`, which reads a recipe with
the same parser without building anything (``draftsmith plan``, ``slurm submit`` and ``compare`` use it).

The objective is chosen by ``model.class_path``; every ``__init__`` signature is the config schema; unknown or
misspelled keys are rejected with the key named, a renamed key or a moved class path with its new name
(trainer/interface/renamed_keys.py); the resolved config is saved beside the logs and every checkpoint directory
(trainer/checkpoints/run_folder.py).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import ArgumentError, Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO

from trainer.checkpoints.atomic import default_checkpoint_io
from trainer.checkpoints.run_folder import SaveConfigBesideCheckpoints
from trainer.checkpoints.sharded import complete_last_checkpoints
from trainer.data.sources import check_data_paths
from trainer.distributed.preemption import PreemptionCheckpoint, default_preemption_checkpoint
from trainer.interface.errors import RecipeError
from trainer.interface.output import adopt_library_loggers
from trainer.interface.renamed_keys import checkpoint_names_renamed, renamed_key_message
from trainer.training.progress import ModelSummaryWithoutFlops, ProgressLog, StepProgressBar

__all__ = ["DraftsmithCLI", "RecipeError", "parse_recipe"]

# Expected by design: the resolved config is written into the checkpoint directory before the first checkpoint, and a
# frozen target sits in eval mode inside a training module.
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


def hide_srun_hint(environ=os.environ) -> None:
    """Outside a SLURM allocation (no ``SLURM_JOB_ID``) Lightning's hint to prepend ``srun`` does not apply: hide it."""
    if "SLURM_JOB_ID" not in environ:
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")


hide_srun_hint()


# jsonargparse 4's wording of an unknown init_args key of a subclass: 'Parser key "model": ... Problem with given
# class_path 'CLASS':\n    Option 'KEY' is not accepted ...' (a union's error, a dozen lines)
_UNKNOWN_INIT_ARG = re.compile(
    r"Parser key \"(?P<section>[\w.]+)\":.*?class_path '(?P<cls>[\w.]+)':\s+Option '(?P<key>\w+)' is not accepted", re.S
)


def unknown_key_message(parser_error: str) -> str | None:
    """One line for the parser's error on an unknown ``init_args`` key (``model.init_args.KEY``...): the key, the
    class that has no such parameter and the closest parameter it has; None for another error."""
    found = _UNKNOWN_INIT_ARG.search(parser_error)
    if found is None:
        return None
    section, class_path, key = found["section"], found["cls"], found["key"]
    message = f"{section}.init_args.{key}: not a parameter of {class_path}"
    try:
        module, _, name = class_path.rpartition(".")
        parameters = [p for p in inspect.signature(getattr(importlib.import_module(module), name)).parameters]
    except (ImportError, AttributeError, TypeError, ValueError):
        return message
    close = difflib.get_close_matches(key, [p for p in parameters if p not in ("self", "args", "kwargs")], n=1)
    return message + (f" (did you mean {section}.init_args.{close[0]}?)" if close else "")


class _RecipeParser(LightningArgumentParser):
    """The parser of ``draftsmith fit``: an unknown key that was renamed (trainer/interface/renamed_keys.py) is refused
    with its new name instead of the parser's "not accepted", and another unknown ``init_args`` key in one line naming
    the closest parameter; a resumed checkpoint's hyper-parameters are read with renamed keys and values under their new
    names."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        super().error(renamed_key_message(message) or unknown_key_message(message) or message, ex)

    def parse_object(self, cfg_obj: Any, *args: Any, **kwargs: Any) -> Namespace:
        """As jsonargparse's; the hyper-parameters of a ``--ckpt_path`` checkpoint, which LightningCLI parses over
        the recipe, are read with renamed keys and values under their new names
        (renamed_keys.checkpoint_names_renamed)."""
        return super().parse_object(checkpoint_names_renamed(cfg_obj), *args, **kwargs)


class DraftsmithCLI(LightningCLI):
    """LightningCLI with the project's defaults: any objective, any datamodule, no auto-added optimizer groups; the
    data paths checked before anything is built; every fit saves checkpoints atomically (AtomicCheckpointIO) and
    saves ``last.ckpt`` on SIGTERM, SIGINT and SIGUSR1 (PreemptionCheckpoint), unless its recipe names its own.

    What a fit prints (trainer/training/progress.py): the ``progress`` section
    (:class:`~trainer.training.progress.ProgressLog`, ``--progress.every_n_steps``, ``--progress.every_seconds``) logs
    plain-text progress lines; off a terminal (standard error not a TTY) Lightning's progress bar is off unless the
    recipe sets ``trainer.enable_progress_bar`` or names a bar, on a terminal it is
    :class:`~trainer.training.progress.StepProgressBar`; the model summary has no FLOPs column."""

    running_trainer: Trainer | None = None
    """The trainer of the last DraftsmithCLI built in this process: the error handler of ``draftsmith``
    (trainer/cli.py) stops the other local ranks through its launcher when this rank ends with an error."""

    def __init__(self, args: list[str] | None = None, run: bool = True, exit_on_error: bool = True) -> None:
        """Parse ``args`` (None: ``sys.argv``), build the model, data and trainer, and run the subcommand.

        Args:
            args: the command line after ``draftsmith``, e.g. ``["fit", "--config", "recipe.yaml"]``.
            run: run the subcommand (False: only build, as LightningCLI).
            exit_on_error: a bad config prints usage and the error and exits with code 2 (False: raises jsonargparse's
                ArgumentError instead). A renamed key (trainer/interface/renamed_keys.py) is refused with its new name
                either way.
        """
        adopt_library_loggers()  # Lightning's own handler would print every message a second time
        super().__init__(
            model_class=LightningModule,
            datamodule_class=LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=SaveConfigBesideCheckpoints,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=args,
            run=run,
            parser_kwargs={"default_env": False, "allow_abbrev": False, "exit_on_error": exit_on_error},
            parser_class=_RecipeParser,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """The ``progress`` section: :class:`~trainer.training.progress.ProgressLog`'s ``every_n_steps`` and
        ``every_seconds``, a callback of every fit; ``collective_timeout_s``: the process group's timeout."""
        parser.add_lightning_class_args(ProgressLog, "progress")
        parser.add_argument(
            "--collective_timeout_s",
            type=float,
            default=DEFAULT_COLLECTIVE_TIMEOUT_S,
            help="seconds a rank waits in a collective (all-reduce, barrier) for the others before it fails, so that "
            "a dead rank ends the job in bounded time; set on the process group of the DDP, FSDP and DeepSpeed "
            "strategies in place of their own timeout argument (torch's default is 30 minutes). Default "
            f"{DEFAULT_COLLECTIVE_TIMEOUT_S:g}.",
        )

    def before_instantiate_classes(self) -> None:
        """Checks every local data path of the recipe (``data.train_files``, ``val_files``, ``shards``) before the
        model is built: LightningCLI builds the model (and loads its target) before the datamodule.

        Raises:
            PathError: naming the recipe key and the path.
        """
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        data = config.get("data")
        init_args = data.get("init_args") if isinstance(data, Namespace) else None
        if init_args is not None:
            check_data_paths(init_args)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The recipe's trainer, with :func:`~trainer.checkpoints.atomic.default_checkpoint_io` among its plugins unless
        the recipe names a CheckpointIO, and :func:`~trainer.distributed.preemption.default_preemption_checkpoint` after
        its other callbacks and before its checkpoint callbacks (which Lightning runs last) unless the recipe has a
        PreemptionCheckpoint."""
        trainer_config = self._get(self.config_init, "trainer", default={}) or {}
        extra = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        if "plugins" not in kwargs:
            plugins = trainer_config.get("plugins")
            plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list | tuple) else [plugins]
            if not any(isinstance(p, CheckpointIO) for p in plugins):
                plugins.append(default_checkpoint_io())
            kwargs["plugins"] = plugins
        if "callbacks" not in kwargs:
            callbacks = trainer_config.get("callbacks")
            callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list) else [callbacks]
            if not any(isinstance(c, PreemptionCheckpoint) for c in [*callbacks, *extra]):
                # last of the recipe's callbacks: a signal that arrives while another callback's batch end runs is
                # acted on at this batch end; Lightning moves the checkpoint callbacks after it (_reorder_callbacks)
                callbacks.append(default_preemption_checkpoint())
            kwargs["callbacks"] = callbacks
        bar_given = any(isinstance(c, ProgressBar) for c in [*kwargs.get("callbacks", []), *extra])
        if trainer_config.get("enable_progress_bar") is None and "enable_progress_bar" not in kwargs and not bar_given:
            if not sys.stderr.isatty():  # a log file: ProgressLog's lines instead of a bar that prints at the end
                kwargs["enable_progress_bar"] = False
            else:
                kwargs.setdefault("callbacks", []).append(StepProgressBar())
        adopt_library_loggers()  # the recipe's classes may have imported transformers since __init__
        trainer = super().instantiate_trainer(**kwargs)
        trainer.callbacks = [
            ModelSummaryWithoutFlops(max_depth=c._max_depth, **c._summarize_kwargs) if _default_summary(c) else c
            for c in trainer.callbacks
        ]
        _set_collective_timeout(trainer, self._get(self.config, "collective_timeout_s", DEFAULT_COLLECTIVE_TIMEOUT_S))
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                _resume_complete_folders_only(callback)
                # A resumed run writes its last.ckpt over the one it resumed from. Lightning would write last-v1.ckpt
                # beside a sharded last.ckpt (DeepSpeed, FSDP2: it does not restore the callback's last_model_path
                # from those), and `draftsmith export --ckpt_path .../last.ckpt` would read the stale one. Nothing
                # another run wrote is overwritten: a fresh run into a folder of checkpoints is refused (run_folder.py).
                callback._enable_version_counter = False
        _warn_emulated_bf16(trainer, self._get(self.config_init, "model"))
        DraftsmithCLI.running_trainer = trainer
        return trainer


DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
"""``--collective_timeout_s``: 5 minutes, where torch waits 30 (NCCL and gloo alike) for a rank that died."""


def _set_collective_timeout(trainer: Trainer, seconds: float) -> None:
    """Gives the trainer's strategy (DDP, FSDP, FSDP2, DeepSpeed: those that create a process group with a timeout)
    a collective timeout of ``seconds``, before it creates its process group.

    Raises:
        RecipeError: ``seconds`` is not positive.
    """
    from datetime import timedelta

    if not seconds > 0:
        raise RecipeError(f"collective_timeout_s: must be a positive number of seconds, got {seconds}")
    strategy = trainer.strategy
    if hasattr(strategy, "_timeout"):
        strategy._timeout = timedelta(seconds=seconds)


def _resume_complete_folders_only(callback: ModelCheckpoint) -> None:
    """``--ckpt_path last`` chooses among ``callback``'s last checkpoints only complete ones: a sharded checkpoint
    folder without its marker is left out, and partial folders are cleaned up (trainer/checkpoints/sharded.py)."""
    find = callback._find_last_checkpoints

    def complete_only(trainer: Trainer) -> set[str]:
        resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)  # Lightning's own choice of folder
        dirpath = resolve(trainer) if resolve is not None else callback.dirpath
        return complete_last_checkpoints(find(trainer), Path(dirpath) if dirpath else None)

    callback._find_last_checkpoints = complete_only


def _default_summary(callback: Any) -> bool:
    """Whether ``callback`` is the model summary Lightning adds by default (plain or Rich)."""
    from lightning.pytorch.callbacks import RichModelSummary

    return type(callback) in (ModelSummary, RichModelSummary)


def _warn_emulated_bf16(trainer: Trainer, model: Any) -> None:
    """Logs once when a CPU run asks for bf16 that this CPU only emulates (trainer/models/target.py)."""
    from lightning.pytorch.accelerators import CPUAccelerator

    from trainer.models.target import emulated_bf16_message

    if not isinstance(trainer.accelerator, CPUAccelerator):
        return
    hparams = getattr(model, "hparams", {}) or {}
    dtypes = {f"model.{k}": str(hparams[k]) for k in ("target_dtype", "drafter_dtype") if k in hparams}
    message = emulated_bf16_message(str(trainer.precision_plugin.precision), dtypes)
    if message:
        logging.getLogger(__name__).warning(message)


class _Parsed(Exception):
    """Carries the parsed config out of LightningCLI.__init__, before anything is instantiated."""

    def __init__(self, config: Namespace) -> None:
        super().__init__("parsed")
        self.config = config


class _RecipeReader(DraftsmithCLI):
    """DraftsmithCLI that stops right after parsing: no seed, checkpoint read, instantiation or run."""

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        raise _Parsed(parser.parse_args(args))


def parse_recipe(configs: Sequence[str], overrides: Sequence[str] = ()) -> Namespace:
    """The resolved ``fit`` config of a recipe, parsed by the parser of ``draftsmith fit``; nothing is built.

    The configs compose in order as repeated ``--config`` do for fit, then ``overrides`` (more fit arguments, e.g.
    ``["--trainer.max_steps", "10"]``) apply. Every key is checked against the ``__init__`` signatures and every
    default a recipe leaves out is filled in from them; ``model`` and ``data`` are resolved to ``class_path`` and
    ``init_args``. No model, datamodule, trainer or target is instantiated, and no file the recipe names is read
    (a recipe naming a 70B hub model parses offline in seconds); ``ckpt_path`` is not opened.

    Args:
        configs: recipe YAML paths, in ``--config`` order.
        overrides: more ``draftsmith fit`` arguments.

    Returns:
        The ``fit`` section: ``seed_everything``, ``trainer``, ``model``, ``data``, ``ckpt_path``...

    Raises:
        RecipeError: an unknown or misspelled key (a renamed one names its new name), a value of the wrong type, a
            missing recipe file: the message ``draftsmith fit`` prints for the same recipe.
    """
    if not configs:
        raise RecipeError("no recipe given (--config)")
    args = ["fit", *[a for config in configs for a in ("--config", str(config))], *[str(o) for o in overrides]]
    try:
        _RecipeReader(args=args, exit_on_error=False)
    except _Parsed as parsed:
        return parsed.config.fit
    except ArgumentError as err:
        raise RecipeError(str(err)) from err
    raise AssertionError("unreachable: _RecipeReader always stops after parsing")
