"""P-EAGLE through the real CLI: a short fit of recipes/quickstart/peagle.yaml on a random target with the tiny corpus'
tokenizer, the checkpoint's record, ``draftsmith export`` to ``peagle-speculators`` and back with identical drafts,
lossless decoding with the registry's proposer, and init_from refusing other norm flags or another depth."""

from __future__ import annotations

import pytest
import torch

from tests.recipe_runs import data_overrides, fit, merge, save_random_target, trainer_overrides
from trainer.checkpoints.reading import load_training_checkpoint
from trainer.decoding.generate import speculative_generate
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import NoProposer
from trainer.export.cli import main as export_main
from trainer.interface.errors import RecipeError
from trainer.methods.peagle.objective import PEagle
from trainer.training.registry import get_kind, load_drafter

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_fit_export_and_lossless_decoding(tiny_corpus, tmp_path):
    target = save_random_target(tmp_path / "target", tiny_corpus.tokenizer_dir)
    run = tmp_path / "run"
    override = merge(
        trainer_overrides(run, max_steps=4, every_n=4),
        data_overrides(tiny_corpus),
        {"model": {"init_args": {"target": str(target), "draft_vocab_size": 128, "target_layers": [0, 1, 2]}}},
    )
    cli = fit("quickstart/peagle.yaml", override, run)
    metrics = cli.trainer.callback_metrics
    assert {"train/acc_0", "train/acc_3", "train/loss_1"} <= set(metrics)
    ckpt = run / "checkpoints" / "last.ckpt"
    state, record = load_training_checkpoint(str(ckpt))
    assert record["kind"] == "peagle" and record["draft_tokens"] == 4 and record["config"]["mask_token_id"] == 2
    assert {"drafter.mask_hidden", "drafter.embed_tokens.weight"} <= set(state)
    assert record["config"]["num_layers"] == 2 and "drafter.deep_layers.0.mlp.up_proj.weight" in state  # the recipe's
    assert export_main(
        ["--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "export"), "--format", "peagle-speculators"]
    ) in (
        0,
        None,
    )
    trained, _ = load_drafter(str(ckpt))
    exported, exported_record = load_drafter(str(tmp_path / "export"))
    assert exported_record.kind == "peagle" and exported_record.target == str(target)
    for key, value in trained.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[key], value, rtol=0, atol=0)
    model = cli.model.target.model.eval()
    kind = get_kind("peagle", "test")
    proposer = kind.proposer(exported, exported_record, model, ProposerOptions())
    prompt = torch.tensor(cli.datamodule.train_dataset.ids[0][:24], dtype=torch.long)
    alone = speculative_generate(model, prompt, NoProposer(), k=0, max_new_tokens=12).tokens
    assert speculative_generate(model, prompt, proposer, k=4, max_new_tokens=12).tokens == alone
    with pytest.raises(RecipeError, match="model.fc_norm is true but model.init_from .* fc_norm: false"):
        PEagle(str(target), init_from=str(ckpt), fc_norm=True, num_layers=2)
    with pytest.raises(RecipeError, match="model.num_layers is 1 but model.init_from .* num_layers: 2"):
        PEagle(str(target), init_from=str(ckpt))
