"""An objective that moved keeps loading (trainer/interface/renamed_keys.py ``RENAMED_CLASS_PATHS``): a recipe naming
its old class path is refused in one line naming the new one, by ``parse_recipe`` and by ``draftsmith fit`` (status 2),
and ``draftsmith fit --ckpt_path`` resumes a checkpoint whose hyper-parameters name the old path as the new class, with
the settings it recorded. So does a class of a module that moved into a package (``MOVED_MODULES``: a recipe's
strategy or callback)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import yaml

from trainer.cli import main as draftsmith
from trainer.interface.renamed_keys import (
    MOVED_MODULES,
    RENAMED_CLASS_PATHS,
    WHY_GROUPED,
    WHY_MOVED,
    checkpoint_names_renamed,
    moved_class_path,
    moved_module_path,
)
from trainer.training.recipe import DraftsmithCLI, RecipeError, parse_recipe

ROOT = Path(__file__).resolve().parents[2]
OLD_PEAGLE = "trainer.methods.eagle3.peagle_objective.PEagle"
NEW_PEAGLE = "trainer.methods.peagle.objective.PEagle"
MOVES = sorted(RENAMED_CLASS_PATHS.items())


def importable(path: str) -> bool:
    module, _, name = path.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def test_the_peagle_move_is_in_the_table():
    assert RENAMED_CLASS_PATHS[OLD_PEAGLE] == NEW_PEAGLE


@pytest.mark.parametrize("old, new", MOVES, ids=[o for o, _ in MOVES])
def test_every_move_names_a_class_that_exists_in_place_of_one_that_does_not(old, new):
    assert importable(new), new
    assert not importable(old), f"{old} still imports: it did not move"


def old_recipe(tmp_path: Path) -> Path:
    """recipes/quickstart/peagle.yaml naming P-EAGLE by its old class path."""
    recipe = yaml.safe_load((ROOT / "recipes" / "quickstart" / "peagle.yaml").read_text())
    assert recipe["model"]["class_path"] == NEW_PEAGLE
    recipe["model"]["class_path"] = OLD_PEAGLE
    file = tmp_path / "old_peagle.yaml"
    file.write_text(yaml.safe_dump(recipe))
    return file


def test_parse_recipe_names_the_new_class_path_in_one_line(tmp_path):
    expected = f"model.class_path {OLD_PEAGLE} was renamed to {NEW_PEAGLE} ({WHY_MOVED})"
    with pytest.raises(RecipeError) as in_recipe:
        parse_recipe([str(old_recipe(tmp_path))])
    assert str(in_recipe.value) == expected
    with pytest.raises(RecipeError) as on_command_line:
        parse_recipe([str(ROOT / "recipes" / "quickstart" / "peagle.yaml")], ["--model", OLD_PEAGLE])
    assert str(on_command_line.value) == expected
    # the recipe as it is now parses
    assert parse_recipe([str(ROOT / "recipes" / "quickstart" / "peagle.yaml")]).model.class_path == NEW_PEAGLE


def test_fit_refuses_the_old_class_path_with_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        draftsmith(["fit", "--config", str(old_recipe(tmp_path))])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"model.class_path {OLD_PEAGLE} was renamed to {NEW_PEAGLE}" in err and "usage:" in err


class _Parsed(Exception):
    pass


class _ResumeReader(DraftsmithCLI):
    """``draftsmith fit``'s CLI, stopped once the recipe and then a ``--ckpt_path`` file's hyper-parameters are
    parsed."""

    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config)


def test_a_checkpoint_naming_the_old_class_path_resumes_as_the_new_class(tmp_path):
    """The hyper-parameters LightningCLI saved with a P-EAGLE run before the move name the old path: they are parsed
    over the (current) recipe as the new class, with the values the run recorded."""
    ckpt = tmp_path / "old.ckpt"
    recorded = {"target": "artifacts/old_target", "num_depths": 3, "cod_ratio": 0.5, "mask_token_id": 2}
    instantiator = {"_class_path": OLD_PEAGLE, "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    torch.save({"hyper_parameters": {**instantiator, **recorded}, "state_dict": {}}, ckpt)
    recipe = str(ROOT / "recipes" / "quickstart" / "peagle.yaml")
    with pytest.raises(_Parsed) as parsed:
        _ResumeReader(["fit", "--config", recipe, "--seed_everything", "0", "--ckpt_path", str(ckpt)])
    model = parsed.value.args[0].fit.model
    assert model.class_path == NEW_PEAGLE
    assert {key: model.init_args[key] for key in recorded} == recorded


def test_checkpoint_names_renamed_leaves_other_class_paths_as_they_are():
    eagle3 = "trainer.methods.eagle3.objective.Eagle3"
    config = {"fit": {"model": {"class_path": eagle3, "dict_kwargs": {"target": "x"}}}}
    assert checkpoint_names_renamed(config) == config
    no_path = {"fit": {"model": {"dict_kwargs": {"target": "x"}}}}
    assert checkpoint_names_renamed(no_path) == no_path


# trainer/'s root modules grouped into packages (0.22.0): a class path under an old module is refused naming its new
# path, and resolves to it for a checkpoint
MODULE_MOVES = sorted(MOVED_MODULES.items())


@pytest.mark.parametrize("old, new", MODULE_MOVES, ids=[o for o, _ in MODULE_MOVES])
def test_every_moved_module_imports_at_its_new_path_only(old, new):
    importlib.import_module(new)
    if new.startswith(old + "."):  # trainer.slurm is the package its module moved into
        assert not hasattr(importlib.import_module(old), "main"), f"{old} still holds what moved to {new}"
    else:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def old_strategy_recipe(tmp_path: Path) -> Path:
    """recipes/_base/deepspeed_zero2.yaml naming its strategy by the class path before the move."""
    base = yaml.safe_load((ROOT / "recipes" / "_base" / "deepspeed_zero2.yaml").read_text())
    assert base["trainer"]["strategy"]["class_path"] == NEW_STRATEGY
    base["trainer"]["strategy"]["class_path"] = OLD_STRATEGY
    file = tmp_path / "old_zero2.yaml"
    file.write_text(yaml.safe_dump(base))
    return file


OLD_STRATEGY = "trainer.strategies.CPUDeepSpeedStrategy"
NEW_STRATEGY = "trainer.distributed.strategies.CPUDeepSpeedStrategy"
KD = str(ROOT / "recipes" / "quickstart" / "kd.yaml")


def test_a_moved_strategy_or_callback_class_path_is_refused_naming_the_new_one(tmp_path):
    with pytest.raises(RecipeError) as strategy:
        parse_recipe([KD, str(old_strategy_recipe(tmp_path))])
    assert str(strategy.value) == f"class_path {OLD_STRATEGY} was renamed to {NEW_STRATEGY} ({WHY_GROUPED})"
    old_callback = "trainer.preemption.PreemptionCheckpoint"
    with pytest.raises(RecipeError) as callback:
        parse_recipe([KD], ["--trainer.callbacks+", old_callback])
    assert str(callback.value) == (
        f"class_path {old_callback} was renamed to trainer.distributed.preemption.PreemptionCheckpoint ({WHY_GROUPED})"
    )
    # the recipes as they are now parse
    parsed = parse_recipe([KD, str(ROOT / "recipes" / "_base" / "deepspeed_zero2.yaml")])
    assert parsed.trainer.strategy.class_path == NEW_STRATEGY


def test_fit_refuses_a_moved_strategy_with_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        draftsmith(["fit", "--config", KD, "--config", str(old_strategy_recipe(tmp_path))])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"class_path {OLD_STRATEGY} was renamed to {NEW_STRATEGY}" in err and "Traceback" not in err


def test_moved_module_path_leaves_the_paths_that_resolve_now():
    assert moved_module_path("trainer.losses.fused_kd_loss") == "trainer.losses.distillation.fused_kd_loss"
    assert moved_module_path("trainer.losses.chunked.chunked_loss") is None  # the package of the same name
    assert moved_module_path("trainer.slurm.requeue") is None
    assert moved_module_path(NEW_STRATEGY) is None
    assert moved_class_path(OLD_STRATEGY, {}) == NEW_STRATEGY
