"""Medusa end to end through the real CLI: the quickstart Medusa-1 recipe online and from hidden-state shards (the
same losses), both exports through ``draftsmith export``, ``draftsmith eval`` with the paper's tree and with a tree
it builds for a node budget, and Medusa-2 exporting its trained target beside the heads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.integration.test_eagle3_offline import run_precompute
from tests.integration.test_shards import losses, record, text_data
from tests.recipe_runs import fit, merge, trainer_overrides
from trainer.cli import main as draftsmith
from trainer.decoding.eval_cli import main as eval_main
from trainer.export.cli import main as export_main
from trainer.training.registry import load_drafter

pytestmark = pytest.mark.slow
MODEL = {"num_heads": 3, "loss_chunk_size": 64}


def medusa_override(run: Path, corpus, target: Path, steps: int, callbacks=(), **model) -> dict:
    override = merge(
        trainer_overrides(run, max_steps=steps, every_n=steps),
        {"data": text_data(corpus, max_documents=1)},
        {"model": {"init_args": {"target": str(target), **MODEL, **model}}},
    )
    override["trainer"]["callbacks"] += list(callbacks)
    return override


@pytest.fixture(scope="module")
def medusa1(tiny_corpus, tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("medusa1")
    fit("quickstart/medusa1.yaml", medusa_override(run, tiny_corpus, tiny_target, 6, [record(run)]), run)
    return run


def test_offline_heads_follow_the_online_loss(medusa1, tiny_corpus, tiny_target, tmp_path) -> None:
    """Shards of the final normed hidden states (float32) and the target's top-k: the same heads, the same losses;
    data reading another layer of the shards is refused."""
    shards = tmp_path / "shards"
    args = (
        "--top_logprobs",
        "4",
        "--hidden_layers",
        "[1, 2]",
        "--hidden_dtype",
        "float32",
        "--samples_per_shard",
        "48",
    )
    assert run_precompute(tiny_corpus, tiny_target, shards, *args) == 0
    offline = tmp_path / "offline"
    data = {"shards": str(shards), "tokenizer": str(tiny_corpus.tokenizer_dir), "batch_size": 4, "num_workers": 0}
    data.update({"shuffle_shards": False, "shuffle_buffer": 0, "hidden_layers": [2]})
    override = medusa_override(offline, tiny_corpus, tiny_target, 6, [record(offline)], target_signals="shards")
    override["data"] = {"class_path": "trainer.data.shard_datamodule.ShardDataModule", "init_args": data}
    fit("quickstart/medusa1.yaml", override, offline)
    for a, b in zip(losses(medusa1), losses(offline), strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    bad = medusa_override(tmp_path / "bad", tiny_corpus, tiny_target, 2, target_signals="shards")
    bad["data"] = {
        "class_path": "trainer.data.shard_datamodule.ShardDataModule",
        "init_args": {**data, "hidden_layers": [1]},
    }
    with pytest.raises(ValueError, match=r"hidden_states\[2\]"):
        fit("quickstart/medusa1.yaml", bad, tmp_path / "bad")


def test_exports_and_eval_with_the_papers_tree_and_a_built_one(
    medusa1, tiny_target, tiny_corpus, tmp_path, capsys
) -> None:
    ckpt = str(medusa1 / "checkpoints" / "last.ckpt")
    trained, record_ = load_drafter(ckpt)
    serve = {
        "medusa": f"vLLM 0.32 (0.33 removed Medusa): vllm serve {tiny_target} --speculative-config "
        f'\'{{"method": "medusa", "model": "{tmp_path / "medusa"}", "num_speculative_tokens": 3}}\'',
        "medusa-tgi": f"TGI 3.3: text-generation-launcher --model-id {tmp_path / 'medusa-tgi'}",
    }
    for fmt in ("medusa", "medusa-tgi"):
        capsys.readouterr()
        assert export_main(["--ckpt_path", ckpt, "--output_dir", str(tmp_path / fmt), "--format", fmt]) == 0
        block = capsys.readouterr().out
        assert re.search(rf"^serve\s+{re.escape(serve[fmt])}$", block, flags=re.MULTILINE), block
        reloaded, _ = load_drafter(str(tmp_path / fmt))
        hidden = torch.randn(4, 64)
        torch.testing.assert_close(reloaded.heads(hidden), trained.heads(hidden), rtol=0, atol=0)
    assert record_.draft_tokens == 3 and record_.target_layers == [2]
    prompts = tmp_path / "prompts.jsonl"
    lines = Path(tiny_corpus.heldout_file).read_text().splitlines()[:2]
    prompts.write_text("".join(json.dumps({"prompt": json.loads(x)["text"][:120]}) + "\n" for x in lines))
    common = [
        "--target",
        str(tiny_target),
        "--prompts",
        str(prompts),
        "--max_new_tokens",
        "16",
        "--target_dtype",
        "float64",
    ]
    tree = tmp_path / "tree.json"
    argv = [*common, "--drafter", str(tmp_path / "medusa"), "--k", "3", "--temperature", "0"]
    assert (
        eval_main([*argv, "--write_tree", str(tree), "--tree_nodes", "10", "--output_dir", str(tmp_path / "e1")]) == 0
    )
    written = json.loads(tree.read_text())
    assert written["nodes"] == 10 and len(written["accuracy"]) == 3
    assert eval_main([*argv, "--tree", "--tree_choices", str(tree), "--output_dir", str(tmp_path / "e2")]) == 0
    report = json.loads((tmp_path / "e2" / "report.json").read_text())
    assert report["greedy"][0]["identical"] and 1.0 <= report["greedy"][0]["tau"] <= 4.0
    # three heads: the paper's 4-head tree does not apply, and more drafts than heads are refused
    assert draftsmith(["eval", *argv, "--tree", "--output_dir", str(tmp_path / "e3")]) == 2
    assert draftsmith(["eval", *common, "--drafter", ckpt, "--k", "4", "--output_dir", str(tmp_path / "e4")]) == 2


def test_medusa2_exports_its_trained_target_beside_the_heads(tiny_corpus, tiny_target, tmp_path) -> None:
    run = tmp_path / "run"
    override = medusa_override(run, tiny_corpus, tiny_target, 3, trained_target_layers=1, heads_warmup_steps=2)
    cli = fit("quickstart/medusa2.yaml", override, run)
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert not any(k.startswith("original.") for k in saved["state_dict"])  # the frozen original is not saved
    assert cli.model.labels == "original"  # the recipe's heads learn the frozen original's distribution
    out = tmp_path / "medusa2"
    assert export_main(["--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--output_dir", str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out / "target")
    trained = cli.model.drafter.model
    ids = torch.randint(0, 512, (1, 12))
    torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=0, atol=0)
    original = AutoModelForCausalLM.from_pretrained(tiny_target)
    assert not torch.equal(exported.model.layers[1].mlp.up_proj.weight, original.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(exported.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight)
    assert (out / "target" / "tokenizer.json").is_file()
