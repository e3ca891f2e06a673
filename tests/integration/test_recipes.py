"""Every recipe parses with the real CLI (fit recipes from an empty folder, to one of the objectives); a misspelled
key fails and names the key."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import yaml

from tests.recipe_runs import RECIPES
from trainer.cli import main
from trainer.training.objective import DraftObjective
from trainer.training.recipe import DraftsmithCLI, parse_recipe

RECIPE_FILES = sorted(p for p in RECIPES.rglob("*.yaml") if "_base" not in p.parts)
BASE_PIECES = sorted((RECIPES / "_base").glob("*.yaml"))


def print_config(*configs: Path, capsys) -> str:
    args = ["fit"] + [a for c in configs for a in ("--config", str(c))] + ["--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        DraftsmithCLI(args=args)
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def parse_tool_recipe(tool: str, recipe: Path, tmp_path: Path) -> None:
    """Recipes of tools other than fit parse with that tool's own parser (unknown keys are errors there too)."""
    if tool == "precompute":
        from trainer.data.precompute import build_parser

        cfg = build_parser().parse_args(["--config", str(recipe), "--output_dir", str(tmp_path)])
        assert cfg.top_logprobs > 0 and cfg.data is not None
    elif tool == "compare":
        from trainer.compare.config import read_config

        # every method's fit arguments against fit's own parser: tests/unit/test_compare.py, for each compare recipe
        assert read_config(str(recipe)).methods
    else:
        raise AssertionError(f"{recipe}: no parser known for the tool {tool!r}; add one to this test")


def _plain(config) -> dict:
    """A parsed config as plain YAML data (tuples as lists), without the list of config files."""
    data = json.loads(json.dumps(config.as_dict(), default=str))
    data.pop("config", None)
    return data


def check_parse_recipe_reads_what_fit_prints(*configs: Path, capsys) -> str:
    """`draftsmith plan` and `slurm submit` read recipes with parse_recipe: the config fit resolves, key for key."""
    parsed = _plain(parse_recipe([str(p) for p in configs]))
    capsys.readouterr()  # what a first import printed (DeepSpeed's accelerator warning) is not the config
    printed = print_config(*configs, capsys=capsys)
    assert parsed == yaml.safe_load(printed)
    return printed


@pytest.mark.parametrize("recipe", RECIPE_FILES, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_parses_and_opens_with_its_command(recipe, capsys, tmp_path, monkeypatch):
    """Parsed from an empty folder: the artifacts a recipe names need not exist for it to parse; a fit recipe's
    model is one of the objectives of trainer.methods."""
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# draftsmith "), f"{recipe} must open with the command that runs it"
    tool = first.split()[2]
    if tool != "fit":
        parse_tool_recipe(tool, recipe, tmp_path)
        return
    monkeypatch.chdir(tmp_path)
    class_path = yaml.safe_load(check_parse_recipe_reads_what_fit_prints(recipe, capsys=capsys))["model"]["class_path"]
    module, _, name = class_path.rpartition(".")
    assert module.startswith("trainer.methods.") and issubclass(getattr(importlib.import_module(module), name),
                                                                 DraftObjective), class_path  # fmt: skip


@pytest.mark.parametrize("piece", BASE_PIECES, ids=lambda p: p.name)
def test_base_piece_composes_with_the_kd_recipe(piece, capsys):
    assert piece.read_text().splitlines()[0].startswith("# draftsmith"), f"{piece} must open with its command"
    resolved = check_parse_recipe_reads_what_fit_prints(RECIPES / "quickstart" / "kd.yaml", piece, capsys=capsys)
    assert "strategy:" in resolved


def test_misspelled_key_is_named(tmp_path, capsys):
    text = (RECIPES / "quickstart" / "kd.yaml").read_text().replace("temperature:", "temprature:")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        DraftsmithCLI(args=["fit", "--config", str(bad)])
    assert exit_info.value.code != 0
    assert "temprature" in capsys.readouterr().err


def test_misspelled_command_line_key_is_named(capsys):
    with pytest.raises(SystemExit):
        DraftsmithCLI(args=["fit", "--config", str(RECIPES / "quickstart" / "kd.yaml"), "--trainer.max_step", "3"])
    assert "max_step" in capsys.readouterr().err


def test_unknown_command_is_refused(capsys):
    assert main(["fitt"]) == 2
    assert "fitt" in capsys.readouterr().err
