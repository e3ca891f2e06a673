"""An objective that moved keeps loading (trainer/renamed_keys.py ``RENAMED_CLASS_PATHS``): a recipe naming its old
class path is refused in one line naming the new one, by ``parse_recipe`` and by ``draftsmith fit`` (status 2), and
``draftsmith fit --ckpt_path`` resumes a checkpoint whose hyper-parameters name the old path as the new class, with
the settings it recorded."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import yaml

from trainer.cli import main as draftsmith
from trainer.recipe import DraftsmithCLI, RecipeError, parse_recipe
from trainer.renamed_keys import RENAMED_CLASS_PATHS, WHY_MOVED, checkpoint_names_renamed

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
