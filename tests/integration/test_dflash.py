"""DFlash end to end through the real CLI: a short fit of recipes/quickstart/dflash.yaml, both exports through
``draftsmith export`` read back by the engines' rules, lossless chain and DDTree decoding on the tiny target, and the
offline recipe from ``draftsmith precompute`` shards with its refusals of shards that do not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.test_eagle3_offline import run_precompute, shard_data
from tests.recipe_runs import data_overrides, fit, merge, trainer_overrides
from trainer.checkpoints.reading import load_training_checkpoint
from trainer.compare.fit_logs import read_scalars
from trainer.decoding.evaluate import resolve_drafter
from trainer.decoding.generate import speculative_generate
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import NoProposer
from trainer.export.cli import main as export_main
from trainer.methods.dflash.export import load_speculators, load_zlab

pytestmark = pytest.mark.slow

# the test target has 2 layers: the only layer output every engine reads is hidden_states[1] (z-lab id 0)
MODEL = {"num_draft_layers": 1, "block_size": 8, "mask_token_id": 2, "max_anchors": 8, "loss_chunk_size": 256}


def dflash_override(run: Path, corpus, target: Path, max_steps: int, every_n: int, **model) -> dict:
    return merge(
        trainer_overrides(run, max_steps=max_steps, every_n=every_n, log_every_n_steps=every_n),
        data_overrides(corpus),
        {"model": {"init_args": {"target": str(target), **MODEL, **model}}},
    )


@pytest.fixture(scope="module")
def dflash_run(tiny_corpus, tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("dflash")
    return run, fit("quickstart/dflash.yaml", dflash_override(run, tiny_corpus, tiny_target, 6, 3), run)


def test_fit_logs_block_metrics_and_records_the_drafter(dflash_run):
    run, cli = dflash_run
    metrics = cli.trainer.callback_metrics
    assert {"train/acc_1", "train/acc_7", "train/block_tau", "val/acc_1"} <= set(metrics)
    # alpha_k (with token labels the target's distribution is taken for it alone, only on the steps whose metrics
    # Lightning writes: DraftObjective.metrics_due) reaches TensorBoard at exactly the steps the others do
    scalars = read_scalars(run / "tensorboard", ("train/acc_1", "train/alpha_1", "train/alpha_7"))
    assert len(scalars["train/acc_1"]) >= 2
    assert set(scalars["train/alpha_1"]) == set(scalars["train/alpha_7"]) == set(scalars["train/acc_1"])
    assert all(0.0 < value < 1.0 for value in scalars["train/alpha_1"].values())
    state, record = load_training_checkpoint(str(run / "checkpoints" / "last.ckpt"))
    assert all(k.startswith("drafter.") for k in state)  # neither the target nor its embedding
    assert record["kind"] == "dflash" and record["target_layers"] == [1] and record["draft_tokens"] == 7
    assert record["config"]["mask_token_id"] == 2 and record["config"]["block_size"] == 8


def test_exports_reload_and_decode_losslessly(dflash_run, tiny_target, tiny_corpus, tmp_path):
    run, cli = dflash_run
    drafter = cli.model.drafter.eval()
    ckpt = str(run / "checkpoints" / "last.ckpt")
    g = torch.Generator().manual_seed(0)
    hidden, block = [torch.randn(1, 9, 64, generator=g)], torch.randn(1, 8, 64, generator=g)

    def logits(module) -> torch.Tensor:
        with torch.no_grad():
            past = module.context_kv(module.context(hidden), torch.arange(9)[None])
            return module.draft(block, torch.arange(9, 17)[None], past)

    for fmt, loader in (("dflash", load_zlab), ("dflash-speculators", load_speculators)):
        out = tmp_path / fmt
        assert export_main(["--ckpt_path", ckpt, "--output_dir", str(out), "--format", fmt]) == 0
        torch.testing.assert_close(logits(loader(str(out)).eval()), logits(drafter), rtol=0, atol=0)
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": 2, "target_layer_ids": [0], "block_size": 8}
    assert config["num_target_layers"] == 2

    target = AutoModelForCausalLM.from_pretrained(tiny_target).to(torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    texts = [json.loads(line)["text"] for line in Path(tiny_corpus.heldout_file).read_text().splitlines()[:2]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for text in texts:
            prompt = torch.tensor(tok(text[:300]).input_ids[:32])
            alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=20).tokens
            for spec in (ckpt, str(tmp_path / "dflash")):
                for tree in (False, True):
                    options = ProposerOptions(tree=tree, tree_nodes=10, tree_top_k=3)
                    proposer = resolve_drafter(spec, target, options, tok)
                    result = speculative_generate(target, prompt, proposer, k=7, max_new_tokens=20)
                    assert result.tokens == alone, (spec, tree)
    finally:
        torch.set_num_threads(threads)


def offline_override(run: Path, corpus, target: Path, shards: Path, steps: int, **data) -> dict:
    return merge(
        trainer_overrides(run, max_steps=steps, every_n=steps),
        shard_data(corpus, shards, **{"hidden_layers": [1], **data}),
        {"model": {"init_args": {"target": str(target), "target_layers": [1], **MODEL}}},
    )


def test_offline_recipe_trains_from_shards_and_refuses_shards_that_do_not_fit(tiny_corpus, tiny_target, tmp_path):
    shards = tmp_path / "shards"
    args = ("--top_logprobs", "8", "--hidden_layers", "[0, 1]", "--samples_per_shard", "48", "--batch_size", "8")
    assert run_precompute(tiny_corpus, tiny_target, shards, *args) == 0
    run = tmp_path / "offline"
    for labels in ("data", "soft"):
        override = offline_override(run / labels, tiny_corpus, tiny_target, shards, 2)
        override["model"]["init_args"]["labels"] = labels
        if labels == "soft":  # the recipe's D-PACE weights need token labels
            override["model"]["init_args"]["position_weights"] = "decay"
        cli = fit("quickstart/dflash_offline.yaml", override, run / labels)
        assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    state, record = load_training_checkpoint(str(run / "soft" / "checkpoints" / "last.ckpt"))
    assert all(k.startswith("drafter.") for k in state) and record["target_layers"] == [1]

    # the shards hold layers [0, 1], the drafter reads [1]: data.hidden_layers must be the drafter's layers
    with pytest.raises(ValueError, match=r"data.hidden_layers=\[0, 1\] must equal the drafter's target_layers \[1\]"):
        fit("quickstart/dflash_offline.yaml", offline_override(run / "order", tiny_corpus, tiny_target, shards, 1,
            hidden_layers=[0, 1]), run / "order")  # fmt: skip
    # shards that lack the drafter's layer
    partial = tmp_path / "shards_0"
    assert run_precompute(tiny_corpus, tiny_target, partial, "--top_logprobs", "8", "--hidden_layers", "[0]") == 0
    with pytest.raises(ValueError, match=r"hidden_layers \[1\] not stored \(the shards hold \[0\]\)"):
        fit("quickstart/dflash_offline.yaml", offline_override(run / "partial", tiny_corpus, tiny_target, partial, 1),
            run / "partial")  # fmt: skip
    # shards without hidden states (and data.hidden_layers left out: the datamodule itself asks for none)
    bare = tmp_path / "shards_bare"
    assert run_precompute(tiny_corpus, tiny_target, bare, "--top_logprobs", "8") == 0
    with pytest.raises(ValueError, match=r"shards_bare: the shards hold no hidden states; DFlash reads target layers"):
        fit("quickstart/dflash_offline.yaml", offline_override(run / "bare", tiny_corpus, tiny_target, bare, 1,
            hidden_layers=[]), run / "bare")  # fmt: skip


@pytest.mark.parametrize(
    ("precision", "optimizer"), [("bf16-mixed", "adamw"), ("32-true", "adamw"), ("bf16-mixed", "muon")]
)
def test_fits_with_gradient_clipping_in_each_precision_and_every_part_learns(
    precision, optimizer, tiny_corpus, tiny_target, tmp_path
):
    """Two steps of the recipe (its gradient_clip_val 1.0, D-PACE) with the DSpark heads, in bf16-mixed (where
    Lightning clips only an unfused optimizer's gradients: AdamW is unfused in mixed precision) and float32 (fused),
    and with the recipe's Muon: the slot loss's gradients, taken in forward, move the draft layers and both heads away
    from their seeded initialisation."""
    heads = {"markov_rank": 8, "enable_confidence_head": True, "confidence_head_with_markov": True}
    override = dflash_override(tmp_path, tiny_corpus, tiny_target, 2, 2, **heads)
    override["model"]["class_path"] = "trainer.methods.dspark.objective.DSpark"  # DFlash's recipe, DSpark's heads
    override["trainer"]["precision"] = precision
    override["model"]["init_args"]["optim"] = {"name": optimizer, "lr": 0.001, "warmup_steps": 20}
    cli = fit("quickstart/dflash.yaml", override, tmp_path)
    assert cli.trainer.global_step == 2 and cli.trainer.gradient_clip_val == 1.0
    assert cli.model.optim.name == optimizer and cli.model.position_weights == "dpace"
    if optimizer == "adamw":
        assert cli.model.optimizers().optimizer.defaults["fused"] is (precision == "32-true")
    args = {k: v for k, v in cli.model.hparams.items() if not k.startswith("_")}
    fresh = type(cli.model)(**args).drafter.state_dict()  # the same seeded initialisation
    trained = cli.model.drafter.state_dict()
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                 "layers.0.mlp.down_proj.weight", "fc.weight"):  # fmt: skip
        assert torch.isfinite(trained[name]).all() and not torch.equal(trained[name], fresh[name]), name
