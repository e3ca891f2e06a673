"""`parse_recipe`: the recipe as `draftsmith fit` parses it, nothing built; `plan` and `slurm submit` read recipes with
it and refuse what fit refuses, with fit's message."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import pytest

from trainer.training.recipe import DraftsmithCLI, RecipeError, parse_recipe

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart"
KD = str(QUICKSTART / "kd.yaml")
DDP = str(ROOT / "recipes" / "_base" / "ddp.yaml")
FIT_RECIPES = sorted(p for p in QUICKSTART.glob("*.yaml") if p.read_text().startswith("# draftsmith fit"))


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    """Run from an empty folder: the artifacts the recipes name (artifacts/tiny_target...) do not exist there."""
    monkeypatch.chdir(tmp_path)
    assert not Path("artifacts").exists()


def _signature_default(cls: type, name: str):
    return inspect.signature(cls.__init__).parameters[name].default


@pytest.mark.parametrize("recipe", FIT_RECIPES, ids=lambda p: p.name)
def test_quickstart_recipes_parse_without_their_artifacts(recipe):
    config = parse_recipe([str(recipe)])
    assert config.model.class_path.startswith("trainer.methods.")
    assert config.data.class_path.startswith("trainer.data.")
    assert config.trainer.callbacks[0].class_path == "lightning.pytorch.callbacks.ModelCheckpoint"
    assert config.ckpt_path is None


def test_nothing_is_built_or_downloaded(monkeypatch):
    """A recipe naming an 8B hub model parses with every loader and the trainer made to fail."""
    import transformers
    from lightning.pytorch import Trainer

    from trainer.methods.eagle3.objective import Eagle3

    def refusing(function):
        @functools.wraps(function)  # the same signature: the parser reads it
        def refuse(*args, **kwargs):
            raise AssertionError(f"parse_recipe called {function.__qualname__}")

        return refuse

    for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", refusing(lambda *a, **k: None))
    monkeypatch.setattr(Trainer, "__init__", refusing(Trainer.__init__))
    monkeypatch.setattr(Eagle3, "__init__", refusing(Eagle3.__init__))
    config = parse_recipe([str(ROOT / "recipes" / "eagle3_llama31_8b.yaml")])
    assert config.model.init_args.target == "meta-llama/Llama-3.1-8B-Instruct"


def test_defaults_the_recipe_omits_come_from_the_signatures():
    from trainer.data.text import TextDataModule
    from trainer.methods.draft_model.kd import KnowledgeDistillation

    text = Path(KD).read_text()
    assert "beta:" not in text and "num_workers:" not in text and "accumulate_grad_batches" not in text
    config = parse_recipe([KD])
    assert config.model.init_args.beta == _signature_default(KnowledgeDistillation, "beta")
    assert config.model.init_args.target_signals == _signature_default(KnowledgeDistillation, "target_signals")
    assert config.data.init_args.num_workers == _signature_default(TextDataModule, "num_workers")
    assert config.trainer.accumulate_grad_batches == 1
    # and what the recipe sets is kept
    assert config.model.init_args.loss_chunk_size == 512 and config.data.init_args.batch_size == 8


def test_configs_compose_and_overrides_apply_as_for_fit():
    config = parse_recipe([KD, DDP], ["--trainer.max_steps", "7", "--model.init_args.temperature", "2.0"])
    assert config.trainer.strategy == "ddp"  # from the _base piece
    assert config.trainer.precision == "32-true" and config.trainer.max_steps == 7
    assert config.model.init_args.temperature == 2.0
    assert parse_recipe([KD]).trainer.strategy == "auto"


def _fit_error(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        DraftsmithCLI(args=args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_a_misspelled_key_is_fits_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(KD).read_text().replace("    loss: kl", "    losss: kl"))
    fit_err = _fit_error(capsys, ["fit", "--config", str(bad)])
    with pytest.raises(RecipeError, match="losss") as err:
        parse_recipe([str(bad)])
    assert f"error: {err.value}\n" in fit_err  # the very message fit prints

    fit_err = _fit_error(capsys, ["fit", "--config", KD, "--trainer.max_step", "3"])
    with pytest.raises(RecipeError, match="max_step") as err:
        parse_recipe([KD], ["--trainer.max_step", "3"])
    assert f"error: {err.value}\n" in fit_err


def test_plan_and_slurm_refuse_a_misspelled_key_with_fits_message(tmp_path, capsys):
    from trainer.planner import main as plan
    from trainer.slurm.submit import main as slurm

    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(KD).read_text().replace("batch_size:", "batch_sise:"))
    fit_err = _fit_error(capsys, ["fit", "--config", str(bad)])
    message = fit_err[fit_err.index("error: ") :]
    assert "batch_sise" in message
    assert plan(["--config", str(bad), "--gpus", "8", "--target", "llama-3-8b"]) == 2
    assert capsys.readouterr().err == message
    assert slurm(["submit", "--config", str(bad), "--dry_run"]) == 2
    out = capsys.readouterr()
    assert out.err == message and out.out == ""


def test_a_missing_recipe_is_named():
    with pytest.raises(RecipeError, match="no/such.yaml"):
        parse_recipe(["no/such.yaml"])
    with pytest.raises(RecipeError, match="--config"):
        parse_recipe([])
