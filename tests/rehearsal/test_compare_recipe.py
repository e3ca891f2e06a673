"""recipes/compare/llama31_8b.yaml against the cut Llama-3.1-8B: the compare recipe reads, and every method's fit
(its recipe and its ``fit_args``, placeholders filled as ``draftsmith compare`` fills them) parses with the cut target
and its tokenizer, the target the fit would load being the cut one. The methods' recipes themselves run in
test_rehearsal.py; nothing is trained here (config and tokenizer only, no weights)."""

from __future__ import annotations

import json

import pytest

from tests.real_shapes import build_tokenizer, cut_config
from tests.rehearsal.cases import REPO
from trainer.compare.config import fill_placeholders, read_config
from trainer.training.recipe import parse_recipe

pytestmark = pytest.mark.slow  # the tokenizer's BPE and six recipe parses: tens of seconds on two shared cores

RECIPE = "recipes/compare/llama31_8b.yaml"


@pytest.fixture(scope="module")
def cut_llama(tmp_path_factory):
    """config.json and tokenizer of Llama-3.1-8B cut to 4 layers (what the compare recipe's methods read)."""
    out = tmp_path_factory.mktemp("llama31_8b_L4")
    build_tokenizer("llama31_8b", out)
    (out / "config.json").write_text(json.dumps(cut_config("llama31_8b", 4)))
    return out


def test_compare_recipe_methods_parse_against_the_cut_target(cut_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipe names its methods' recipes relative to the repository
    config = read_config(RECIPE, {"target": str(cut_llama), "output_dir": str(tmp_path / "out")})
    trained = [m for m in config.methods if m.trains]
    assert {m.name for m in trained} >= {"medusa-1", "eagle3", "dflash", "layerskip"}
    for method in trained:
        run = tmp_path / "methods" / method.name
        values = {"target": str(cut_llama), "data": str(tmp_path / "data.jsonl"), "run": str(run)}
        values.update(ckpt=str(run / "last.ckpt"), export=str(run / "export"))
        args = [fill_placeholders(a, values) for a in method.fit_args]
        args += ["--trainer.accelerator=cpu", "--trainer.devices=1", f"--data.init_args.tokenizer={cut_llama}"]
        fit = parse_recipe([method.recipe], args)
        assert fit.model.init_args.target == str(cut_llama), method.name
        assert fit.data.init_args.tokenizer == str(cut_llama), method.name
