"""DFlash2 end to end through the real CLI: a short fit of recipes/quickstart/dflash2.yaml on the tiny target (every
part of the drafter moves, the selector's metrics logged, the drafter recorded as kind dflash2), its ``dflash2``
export through ``draftsmith export`` read back with the checkpoint's logits, and lossless chain and DDTree decoding
from both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.recipe_runs import data_overrides, fit, merge, trainer_overrides
from trainer.checkpoints.reading import load_training_checkpoint
from trainer.decoding.evaluate import resolve_drafter
from trainer.decoding.generate import speculative_generate
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import NoProposer
from trainer.export.cli import main as export_main
from trainer.methods.dflash2.export import load_dflash2

pytestmark = pytest.mark.slow

# the test target has 2 layers and width 64: the one layer output every engine reads, groups of 16 channels
MODEL = {"num_draft_layers": 1, "block_size": 8, "mask_token_id": 2, "max_anchors": 8, "loss_chunk_size": 256,
         "selector_rank": 8, "selector_top_k": 4}  # fmt: skip


def test_fit_export_and_lossless_decoding(tiny_corpus, tiny_target, tmp_path):
    override = merge(
        trainer_overrides(tmp_path, max_steps=3, every_n=3),
        data_overrides(tiny_corpus),
        {"model": {"init_args": {"target": str(tiny_target), **MODEL}}},
    )
    cli = fit("quickstart/dflash2.yaml", override, tmp_path)
    metrics = cli.trainer.callback_metrics
    assert {"train/selector_loss", "train/candidate_recall", "train/acc_1", "train/block_tau"} <= set(metrics)
    assert torch.isfinite(metrics["train/loss"])
    args = {k: v for k, v in cli.model.hparams.items() if not k.startswith("_")}
    fresh = type(cli.model)(**args).drafter.state_dict()  # the same seeded initialisation
    trained = cli.model.drafter.state_dict()
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "layers.0.attention_conv.kernel_projection.weight", "layers.0.mlp_conv.base_kernel",
                 "layers.0.mlp.down_proj.weight", "fc.weight"):  # fmt: skip
        assert torch.isfinite(trained[name]).all() and not torch.equal(trained[name], fresh[name]), name
    ckpt = str(tmp_path / "checkpoints" / "last.ckpt")
    _, record = load_training_checkpoint(ckpt)
    assert record["kind"] == "dflash2" and record["config"]["selector_rank"] == 8

    out = tmp_path / "export"
    assert export_main(["--ckpt_path", ckpt, "--output_dir", str(out), "--format", "dflash2"]) == 0
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "dflash2"
    drafter, again = cli.model.drafter.eval(), load_dflash2(str(out)).eval()
    g = torch.Generator().manual_seed(0)
    hidden, block = [torch.randn(1, 9, 64, generator=g)], torch.randn(1, 8, 64, generator=g)
    with torch.no_grad():
        outs = [d.draft(block, torch.arange(9, 17)[None], d.context_kv(d.context(hidden), torch.arange(9)[None]))
                for d in (drafter, again)]  # fmt: skip
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)

    target = AutoModelForCausalLM.from_pretrained(tiny_target).to(torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    text = json.loads(Path(tiny_corpus.heldout_file).read_text().splitlines()[0])["text"]
    prompt = torch.tensor(tok(text[:300]).input_ids[:32])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=20).tokens
        for spec in (ckpt, str(out)):
            for tree in (False, True):
                proposer = resolve_drafter(spec, target, ProposerOptions(tree=tree, tree_nodes=10, tree_top_k=3), tok)
                assert speculative_generate(target, prompt, proposer, k=7, max_new_tokens=20).tokens == alone
    finally:
        torch.set_num_threads(threads)
