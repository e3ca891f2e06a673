"""One name per concept in recipes: every objective's signature uses the project's vocabulary (``target``,
``drafter``, ``target_dtype``, ``export_dir``, ``num_heads``, ``loss_chunk_size``...), a renamed key or value is
refused with its new name by ``draftsmith fit``, ``parse_recipe`` and ``draftsmith precompute`` (a value a resumed
checkpoint recorded is read in its new spelling), and every precompute recipe parses (every fit recipe parses in
tests/integration/test_recipes.py)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import typing
from pathlib import Path

import pytest
import torch
import yaml

import trainer.methods
from trainer.cli import main as draftsmith
from trainer.data import precompute
from trainer.interface.renamed_keys import RENAMED_KEYS, RENAMED_PRECOMPUTE_KEYS, RENAMED_VALUES, WHY, renamed
from trainer.training.objective import DraftObjective
from trainer.training.recipe import DraftsmithCLI, RecipeError, parse_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
PRECOMPUTE_RECIPES = sorted(RECIPES.glob("quickstart/*precompute*.yaml"))
FIT_RECIPES = sorted(p for p in RECIPES.glob("quickstart/*.yaml") if p.read_text().startswith("# draftsmith fit"))


def objectives() -> dict[str, type[DraftObjective]]:
    """Every objective class of trainer.methods, by class path."""
    for info in pkgutil.walk_packages(trainer.methods.__path__, "trainer.methods."):
        importlib.import_module(info.name)
    found, todo = {}, [DraftObjective]
    while todo:
        for cls in todo.pop().__subclasses__():
            todo.append(cls)
            if cls.__module__.startswith("trainer.methods."):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


OBJECTIVES = objectives()


def parameters(cls: type) -> list[str]:
    return [name for name in inspect.signature(cls.__init__).parameters if name != "self"]


def synonyms(name: str) -> str | None:
    """Why a parameter name is a second name for a concept that has one (None: it is not)."""
    rules = [
        (name in ("teacher", "model") or name.startswith("teacher_"), "the model drafted for is `target`"),
        (name.startswith("student"), "the trained draft model is `drafter`"),
        (name == "model_config" or name == "student_config", "a fresh model's config is `target_config`"),
        (
            name.endswith("_signals") and name != "target_signals",
            "where the target's signals come from is `target_signals`",
        ),
        (
            (name == "dtype" or name.endswith("_dtype")) and name not in ("target_dtype", "drafter_dtype"),
            "a weights dtype is `target_dtype` or `drafter_dtype`",
        ),
        (name.endswith("_dir") and name != "export_dir", "the output folder is `export_dir`"),
        (re.fullmatch(r"n_\w+", name) is not None, "a count is `num_...` (`num_heads`)"),
        (name.endswith("chunk_size") and name != "loss_chunk_size", "positions per loss chunk is `loss_chunk_size`"),
        (name == "aux_layers", "target hidden_states indices are `target_layers`"),
        (name == "decay", "the loss weight of draft step k is `step_decay ** k` (`optim.decay` is the schedule)"),
        ("model_modules" in name, "modules read from the target's checkpoint: `load_target_modules`"),
        (name == "divergence", "the loss toward a distribution is `loss` (kl, tv, nla, lk_hybrid...)"),
        (name == "k", "log-probabilities kept per position are `top_logprobs` (`k` is drafts per round)"),
    ]
    return next((why for bad, why in rules if bad), None)


def recipe_objectives(recipes: list[Path]) -> set[str]:
    """The class paths of the objectives fit ``recipes`` train."""
    return {yaml.safe_load(recipe.read_text())["model"]["class_path"] for recipe in recipes}


def method_packages() -> set[str]:
    """The method packages of trainer.methods, whose kinds the registry imports (trainer.training.registry.kinds)."""
    return {info.name for info in pkgutil.iter_modules(trainer.methods.__path__) if info.ispkg}


def signature_problems(cls: type) -> dict[str, str]:
    """The parameters of ``cls.__init__`` that give a concept a second name, and why."""
    return {name: why for name in parameters(cls) if (why := synonyms(name)) is not None}


def check_objectives_found(found: dict[str, type[DraftObjective]], recipes: list[Path]) -> None:
    """No count to keep up to date: the objectives ``found`` are the ones the fit ``recipes`` train, and every method
    package the registry reads (one drafter kind each) holds one or more, each naming its parameters with the project's
    vocabulary (tests/integration/test_add_a_method_guide.py runs this on the guide's method too)."""
    from trainer.training.registry import kinds

    assert set(RENAMED_KEYS) <= set(found)
    assert recipe_objectives(recipes) == set(found), "an objective without a quickstart recipe, or the reverse"
    packages = method_packages()
    assert len(kinds()) == len(packages), sorted(kinds())
    assert {path.split(".")[2] for path in found} == packages
    bad = {path: problems for path, cls in found.items() if (problems := signature_problems(cls))}
    assert not bad, bad


def test_every_objective_is_found():
    check_objectives_found(OBJECTIVES, FIT_RECIPES)


@pytest.mark.parametrize("path", sorted(OBJECTIVES), ids=lambda p: p.rsplit(".", 1)[-1])
def test_a_signature_uses_one_name_per_concept(path):
    bad = signature_problems(OBJECTIVES[path])
    assert not bad, f"{path}: {bad}"


@pytest.mark.parametrize("path", sorted(RENAMED_KEYS), ids=lambda p: p.rsplit(".", 1)[-1])
def test_every_renamed_key_maps_to_a_parameter(path):
    names = parameters(OBJECTIVES[path])
    for old, new in RENAMED_KEYS[path].items():
        assert new in names, f"{path}: {old} -> {new}, which is no parameter"
        assert old not in names, f"{path}: {old} is still a parameter"
        assert synonyms(old) is not None, f"{path}: {old} is renamed but the vocabulary test does not forbid it"


def test_every_renamed_precompute_key_maps_to_a_parameter():
    names = list(inspect.signature(precompute.precompute).parameters)
    for old, new in RENAMED_PRECOMPUTE_KEYS.items():
        assert new in names and old not in names and synonyms(old) is not None


def write_recipe(tmp_path: Path, path: str, init_args: dict) -> Path:
    """A fit recipe of objective ``path`` (its required arguments set) with ``init_args``, nothing else."""
    required = {
        name: "x"
        for name, p in inspect.signature(OBJECTIVES[path].__init__).parameters.items()
        if name != "self" and p.default is inspect.Parameter.empty
    }
    recipe = {
        "model": {"class_path": path, "init_args": {**required, **init_args}},
        "data": {
            "class_path": "trainer.data.text.TextDataModule",
            "init_args": {"tokenizer": "t", "train_files": ["a"]},
        },
    }
    file = tmp_path / "recipe.yaml"
    file.write_text(yaml.safe_dump(recipe))
    return file


RENAMES = [(path, old, new) for path, table in sorted(RENAMED_KEYS.items()) for old, new in table.items()]


@pytest.mark.parametrize("path, old, new", RENAMES, ids=[f"{p.rsplit('.', 1)[-1]}.{o}" for p, o, _ in RENAMES])
def test_parse_recipe_names_the_new_key_of_an_old_one(path, old, new, tmp_path):
    expected = renamed("model.init_args.", old, new, RENAMED_VALUES.get(path, {}).get(new))
    with pytest.raises(RecipeError) as in_recipe:
        parse_recipe([str(write_recipe(tmp_path, path, {old: 1}))])
    assert str(in_recipe.value) == expected
    if old == next(iter(RENAMED_KEYS[path])):  # and on the command line (once per objective: the same parser path)
        with pytest.raises(RecipeError) as on_command_line:
            parse_recipe([str(write_recipe(tmp_path, path, {}))], [f"--model.init_args.{old}", "1"])
        assert str(on_command_line.value) == expected


VALUES = [
    (path, key, old, new)
    for path, keys in sorted(RENAMED_VALUES.items())
    for key, t in keys.items()
    for old, new in t.items()
]


@pytest.mark.parametrize(
    "path, key, old, new", VALUES, ids=[f"{p.rsplit('.', 1)[-1]}.{k}.{o}" for p, k, o, _ in VALUES]
)
def test_a_renamed_value_is_refused_with_its_new_spelling(path, key, old, new, tmp_path):
    """In a recipe and on the command line; the new spelling is a value the parameter takes."""
    expected = f"model.init_args.{key}: {old} was renamed to {new} ({WHY})"
    with pytest.raises(RecipeError) as in_recipe:
        parse_recipe([str(write_recipe(tmp_path, path, {key: old}))])
    assert str(in_recipe.value) == expected
    with pytest.raises(RecipeError) as on_command_line:
        parse_recipe([str(write_recipe(tmp_path, path, {}))], [f"--model.init_args.{key}", old])
    assert str(on_command_line.value) == expected
    values = typing.get_args(typing.get_type_hints(OBJECTIVES[path].__init__)[key])
    assert new in values and old not in values, values


def test_the_renamed_label_values():
    """``labels`` has one spelling per meaning: the rows' own tokens are ``data``, the target's argmax ``argmax``."""
    assert {path.rsplit(".", 1)[-1]: keys["labels"] for path, keys in RENAMED_VALUES.items() if "labels" in keys} == {
        "Eagle3": {"hard": "argmax"},
        "DFlash": {"hard": "data"},
        "DSpark": {"hard": "data"},  # DFlash's options with DSpark's heads
        "Medusa": {"target": "argmax"},
    }


@pytest.mark.parametrize(
    "path, key, old, new", VALUES, ids=[f"{p.rsplit('.', 1)[-1]}.{k}.{o}" for p, k, o, _ in VALUES]
)
def test_fit_refuses_an_old_value_with_status_2(path, key, old, new, tmp_path, capsys):
    """``draftsmith fit`` names the new spelling, in a recipe and on the command line, before anything is built."""
    expected = f"model.init_args.{key}: {old} was renamed to {new} ({WHY})"
    for init_args, on_command_line in (({key: old}, []), ({}, [f"--model.init_args.{key}={old}"])):
        with pytest.raises(SystemExit) as exited:
            draftsmith(["fit", "--config", str(write_recipe(tmp_path, path, init_args)), *on_command_line])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert expected in err and "usage:" in err


class _Parsed(Exception):
    pass


class _ResumeReader(DraftsmithCLI):
    """``draftsmith fit``'s CLI, stopped once the config (the recipe, then a ``--ckpt_path`` file's hyper-parameters)
    is parsed."""

    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config)


def resumed_model(tmp_path: Path, path: str, hparams: dict):
    """``fit.model`` as ``draftsmith fit --config RECIPE --ckpt_path FILE`` parses it, FILE a checkpoint of ``path``
    that recorded ``hparams`` and RECIPE one that sets none of them."""
    ckpt = tmp_path / "old.ckpt"
    instantiator = {"_class_path": path, "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    torch.save({"hyper_parameters": {**instantiator, **hparams}, "state_dict": {}}, ckpt)
    recipe = str(write_recipe(tmp_path, path, {}))
    with pytest.raises(_Parsed) as parsed:
        _ResumeReader(["fit", "--config", recipe, "--seed_everything", "0", "--ckpt_path", str(ckpt)])
    return parsed.value.args[0].fit.model


@pytest.mark.parametrize(
    "path, key, old, new", VALUES, ids=[f"{p.rsplit('.', 1)[-1]}.{k}.{o}" for p, k, o, _ in VALUES]
)
def test_a_checkpoint_saved_before_a_rename_resumes_with_the_new_spelling(path, key, old, new, tmp_path):
    """LightningCLI parses the hyper-parameters a ``--ckpt_path`` file recorded over the recipe's: an old value there
    is read in its new spelling (the meaning it was trained with), not refused for a value no recipe can change."""
    model = resumed_model(tmp_path, path, {"target": "x", key: old})
    assert model.class_path == path and model.init_args[key] == new


# a value of each renamed key's type, other than its default, and a second one (recorded under the new name too)
RECORDED = {
    "drafter": ("artifacts/old_drafter", "artifacts/new_drafter"),
    "drafter_config": ({"num_hidden_layers": 1}, {"num_hidden_layers": 2}),
    "drafter_dtype": ("bfloat16", "float16"),
    "export_dir": ("artifacts/old_export", "artifacts/new_export"),
    "load_target_modules": (True, False),
    "loss": ("reverse_kl", "jsd"),
    "loss_chunk_size": (77, 5),
    "num_heads": (3, 5),
    "step_decay": (0.5, 0.25),
    "target": ("artifacts/old_target", "artifacts/new_target"),
    "target_config": ({"hidden_size": 64}, {"hidden_size": 32}),
    "target_dtype": ("bfloat16", "float16"),
    "target_layers": ([0, 1], [1, 2]),
    "target_signals": ("shards", "online"),
}


# one old key per objective (the renaming reads the one table; each objective's class path is what differs) and every
# new name once
RESUMED = sorted({new: (path, old, new) for path, old, new in RENAMES}.values())
RESUMED += [
    (path, old, new)
    for path, old, new in RENAMES
    if path not in {p for p, _, _ in RESUMED} and old == next(iter(RENAMED_KEYS[path]))
]


@pytest.mark.parametrize("path, old, new", RESUMED, ids=[f"{p.rsplit('.', 1)[-1]}.{o}" for p, o, _ in RESUMED])
def test_a_checkpoint_saved_before_a_key_was_renamed_resumes_under_the_new_name(path, old, new, tmp_path):
    """An old key among a ``--ckpt_path`` file's hyper-parameters is read under its new name, its value kept (not
    passed on as an unknown argument); a key recorded under both names keeps the new one's value."""
    value, other = RECORDED[new]
    needs_target = new != "target" and "target" in inspect.signature(OBJECTIVES[path]).parameters
    base = {"target": "x"} if needs_target else {}
    for recorded, expected in (({old: value}, value), ({old: value, new: other}, other)):
        init_args = resumed_model(tmp_path, path, {**base, **recorded}).init_args
        assert old not in init_args and init_args[new] == expected


def test_kd_divergence_is_refused_in_one_line_naming_loss_and_its_values(tmp_path, capsys):
    """KD's ``divergence`` is ``loss`` (the vocabulary of every objective), ``forward_kl`` is ``kl`` there."""
    kd = "trainer.methods.draft_model.kd.KnowledgeDistillation"
    expected = (
        "model.init_args.divergence was renamed to model.init_args.loss, forward_kl to kl "
        "(recipes use one name per concept; see docs/methods)"
    )
    with pytest.raises(RecipeError) as refused:
        parse_recipe([str(write_recipe(tmp_path, kd, {"divergence": "forward_kl"}))])
    assert str(refused.value) == expected and "\n" not in str(refused.value)
    with pytest.raises(SystemExit) as exited:
        draftsmith(["fit", "--config", str(write_recipe(tmp_path, kd, {"divergence": "jsd"}))])
    assert exited.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.parametrize("old, new", [("forward_kl", "kl"), ("reverse_kl", "reverse_kl"), ("jsd", "jsd")])
def test_a_kd_checkpoint_that_recorded_divergence_resumes_with_loss(old, new, tmp_path):
    """A checkpoint saved before the rename (``divergence: forward_kl``) resumes with ``loss: kl``, its meaning."""
    kd = "trainer.methods.draft_model.kd.KnowledgeDistillation"
    init_args = resumed_model(tmp_path, kd, {"target": "x", "divergence": old, "beta": 0.3}).init_args
    assert "divergence" not in init_args and init_args["loss"] == new and init_args["beta"] == 0.3


def test_fit_refuses_an_old_key_with_status_2(tmp_path, capsys):
    kd = "trainer.methods.draft_model.kd.KnowledgeDistillation"
    with pytest.raises(SystemExit) as exited:
        draftsmith(["fit", "--config", str(write_recipe(tmp_path, kd, {"teacher": "artifacts/tiny_target"}))])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"model.init_args.teacher was renamed to model.init_args.target ({WHY})" in err
    assert "usage:" in err
    with pytest.raises(SystemExit) as exited:
        draftsmith(["fit", "--config", str(write_recipe(tmp_path, kd, {})), "--model.init_args.chunk_size=64"])
    assert exited.value.code == 2
    assert "model.init_args.chunk_size was renamed to model.init_args.loss_chunk_size" in capsys.readouterr().err


def test_an_unknown_key_is_named_in_one_line_with_its_class(tmp_path):
    kd = "trainer.methods.draft_model.kd.KnowledgeDistillation"
    with pytest.raises(RecipeError, match=rf"^model\.init_args\.teachr: not a parameter of {kd}$"):
        parse_recipe([str(write_recipe(tmp_path, kd, {"teachr": "x"}))])
    typo = rf"^model\.init_args\.loss_chunk_sise: not a parameter of {kd} "
    typo += r"\(did you mean model\.init_args\.loss_chunk_size\?\)$"
    with pytest.raises(RecipeError, match=typo):
        parse_recipe([str(write_recipe(tmp_path, kd, {"loss_chunk_sise": 64}))])
    # an old name of another objective is not this one's rename: Eagle3 never had `teacher`
    eagle3 = "trainer.methods.eagle3.objective.Eagle3"
    with pytest.raises(RecipeError, match=rf"^model\.init_args\.teacher: not a parameter of {eagle3}"):
        parse_recipe([str(write_recipe(tmp_path, eagle3, {"teacher": "x"}))])


@pytest.mark.parametrize("old", sorted(RENAMED_PRECOMPUTE_KEYS))
def test_precompute_refuses_an_old_key_with_status_2(old, tmp_path, capsys):
    recipe = (RECIPES / "quickstart" / "precompute.yaml").read_text()
    new = RENAMED_PRECOMPUTE_KEYS[old]
    old_recipe = tmp_path / "old.yaml"
    old_recipe.write_text(re.sub(rf"^{new}:", f"{old}:", recipe, flags=re.M))
    for argv in (
        ["--config", str(old_recipe)],
        ["--config", str(RECIPES / "quickstart" / "precompute.yaml"), f"--{old}", "x"],
    ):
        with pytest.raises(SystemExit) as exited:
            precompute.main([*argv, "--output_dir", str(tmp_path / "out")])
        assert exited.value.code == 2
        assert f"error: {old} was renamed to {new} ({WHY})" in capsys.readouterr().err


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """Run from an empty folder: the artifacts the recipes name do not exist there."""
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("recipe", PRECOMPUTE_RECIPES, ids=lambda p: p.name)
def test_every_precompute_recipe_parses(recipe, elsewhere):
    config = precompute.build_parser().parse_args(["--config", str(recipe), "--output_dir", "x"])
    assert config.target == "artifacts/tiny_target" and config.target_dtype == "float32"
