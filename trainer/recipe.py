"""Recipes: the LightningCLI of ``draftsmith fit`` and ``validate``, and :func:`parse_recipe`, which reads a recipe with
the same parser without building anything (``draftsmith plan``, ``slurm submit`` and ``compare`` use it).

The objective is chosen by ``model.class_path``; every ``__init__`` signature is the config schema; unknown or
misspelled keys are rejected with the key named, and a renamed key with its new name (trainer/renamed_keys.py); the
resolved config is saved beside the logs and every checkpoint directory (trainer/run_folder.py).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from jsonargparse import ArgumentError, Namespace
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from trainer.renamed_keys import renamed_key_message
from trainer.run_folder import SaveConfigBesideCheckpoints

# Expected by design: the resolved config is written into the checkpoint directory before the first checkpoint, and a
# frozen target sits in eval mode inside a training module.
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
if "SLURM_JOB_ID" not in os.environ:  # outside a SLURM allocation Lightning's hint to prepend srun does not apply
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")


class _RecipeParser(LightningArgumentParser):
    """The parser of ``draftsmith fit``: an unknown key that was renamed (trainer/renamed_keys.py) is refused with its
    new name instead of the parser's "not accepted"."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        super().error(renamed_key_message(message) or message, ex)


class DraftsmithCLI(LightningCLI):
    """LightningCLI with the project's defaults: any objective, any datamodule, no auto-added optimizer groups."""

    def __init__(self, args: list[str] | None = None, run: bool = True, exit_on_error: bool = True) -> None:
        """Parse ``args`` (None: ``sys.argv``), build the model, data and trainer, and run the subcommand.

        Args:
            args: the command line after ``draftsmith``, e.g. ``["fit", "--config", "recipe.yaml"]``.
            run: run the subcommand (False: only build, as LightningCLI).
            exit_on_error: a bad config prints usage and the error and exits with code 2 (False: raises
                jsonargparse's ArgumentError instead). A renamed key (trainer/renamed_keys.py) is refused with its new
                name either way.
        """
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


class RecipeError(ValueError):
    """A recipe that ``draftsmith fit`` would refuse; the message is the parser's, the one fit prints."""


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
