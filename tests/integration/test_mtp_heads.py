"""The MTP heads recipes through the real ``draftsmith fit``: fine-tuning the test target with new heads (the
training callback measures self-speculative decoding; the end-of-fit export is a plain HF model that transformers
loads, with the heads beside it; ``draftsmith export`` and ``draftsmith eval`` work from the checkpoint through the
drafter-kind registry), and pre-training a fresh model with heads, initialised as the plain pre-training is."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.recipe_runs import TINY_MODEL, data_overrides, fit, merge, trainer_overrides
from trainer.cli import main as draftsmith
from trainer.decoding.eval_cli import main as eval_main
from trainer.export.cli import main as export_main
from trainer.methods.draft_model.pretrain import CausalLMPretraining
from trainer.methods.mtp_heads.export import load as load_export
from trainer.methods.mtp_heads.objective import ParallelMTPHeads

STEPS = 6


@pytest.fixture(scope="module")
def finetuned(tiny_corpus, tiny_target, tmp_path_factory):
    """The fine-tune recipe on the test target: 3 heads, 6 steps, validation and tau every 3 steps."""
    run = tmp_path_factory.mktemp("mtp_finetune")
    override = merge(
        trainer_overrides(run, max_steps=STEPS, every_n=3),
        data_overrides(tiny_corpus),
        {"model": {"init_args": {"target": str(tiny_target), "num_heads": 3, "head_weights": [0.0, 1.0, 1.0],
                                 "export_dir": str(run / "model"), "loss_chunk_size": 64}}},
    )  # fmt: skip
    spec_eval = {
        "class_path": "trainer.decoding.callback.SpeculativeEvalCallback",
        "init_args": {"prompts": str(tiny_corpus.heldout_file), "prompt_tokens": 16, "k": 2, "max_new_tokens": 12,
                      "every_n_steps": 3, "max_prompts": 2, "temperature": 1.0},
    }  # fmt: skip
    override["trainer"]["callbacks"].append(spec_eval)
    cli = fit("quickstart/mtp_heads_finetune.yaml", override, run)
    return run, cli


def test_finetuning_logs_tau_and_exports_a_plain_model_with_heads(finetuned, tiny_target, tmp_path, capsys) -> None:
    run, cli = finetuned
    objective = cli.model
    callback = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SpeculativeEvalCallback")
    assert callback.last["spec_eval/tau"] >= 1.0 and "spec_eval/acceptance_2" in callback.last
    assert objective.mtp.measured_agreement() is not None  # validation measured the heads against head 0
    # the end-of-fit export: transformers loads the model alone, the heads reload beside it
    model_dir = run / "model"
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.randint(0, plain.config.vocab_size, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, objective.mtp.model.cpu()(ids).logits, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(model_dir).vocab_size > 0
    original = load_file(tiny_target / "model.safetensors")
    assert not torch.equal(load_file(model_dir / "model.safetensors")["lm_head.weight"], original["lm_head.weight"])
    # draftsmith export of the last checkpoint through the registry: the same files
    out = tmp_path / "exported"
    assert export_main(["--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--output_dir", str(out)]) == 0
    for name in ("model.safetensors", "mtp_heads.safetensors"):
        a, b = load_file(model_dir / name), load_file(out / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    settings = json.loads((out / "mtp_heads.json").read_text())
    assert settings["agreement"] is not None
    # the recipe keeps the model close to the target it started from: recorded, with the original's fingerprint
    assert settings["fine_tuned_from"] == str(tiny_target) and settings["target_kl_weight"] == 4.0
    assert settings["labels"] == "original"  # every head learned the original's distribution
    assert set(torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["frozen_models"]) == {"original"}
    assert load_export(out).num_heads == 3
    # draftsmith eval of the checkpoint against the exported model: greedy identical to the model alone (eval
    # refuses any difference), then sampling; the tree is tested in tests/unit/test_mtp_heads_drafting.py
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": list(range(5 + i, 25 + i))}) + "\n" for i in range(2)))
    args = ["--target", str(model_dir), "--drafter", str(run / "checkpoints" / "last.ckpt"), "--prompts", str(prompts),
            "--max_new_tokens", "16", "--output_dir", str(tmp_path / "eval")]  # fmt: skip
    assert eval_main([*args, "--k", "2", "--original_target", str(tiny_target)]) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["greedy"][0]["identical"] and report["sampling"][0]["tau"] >= 1.0
    drift = report["original_target"]  # the changed model beside the one it was fine-tuned from
    assert drift["original_path"] == str(tiny_target) and drift["target"]["loop_share"] == report["loops"]["share"]
    assert drift["tokens"] == 38 and drift["original"]["heldout_loss"] != drift["target"]["heldout_loss"]
    assert "changed target against its original" in (tmp_path / "eval" / "report.md").read_text()
    # on held-out documents cut to their first 6 tokens: each model's mean next-token cross entropy over those
    heldout = tmp_path / "heldout.jsonl"
    documents = [list(range(30, 50)), list(range(60, 69)), [7, 8, 9]]
    heldout.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in documents))
    cut = ["--original_target", str(tiny_target), "--heldout", str(heldout), "--heldout_tokens", "6"]
    assert eval_main([*args, "--k", "2", *cut]) == 0, capsys.readouterr().err
    drift = json.loads((tmp_path / "eval" / "report.json").read_text())["original_target"]
    assert drift["tokens"] == 5 + 5 + 2 and drift["heldout"] == f"the first 6 tokens of each document of {heldout}"
    for name, folder in (("target", model_dir), ("original", tiny_target)):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        losses = []
        for ids in documents:
            row = torch.tensor(ids[:6])
            with torch.no_grad():
                logits = model(input_ids=row[None]).logits[0]  # [S, V]
            losses += [-torch.log_softmax(logits[i], -1)[row[i + 1]] for i in range(len(row) - 1)]
        assert drift[name]["heldout_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5), name
    assert draftsmith(["eval", *args, *cut[:-1], "1"]) == 2
    assert "--heldout_tokens must be 0 (the target's context) or at least 2, got 1" in capsys.readouterr().err
    assert draftsmith(["eval", *args, "--k", "3"]) == 2
    assert "drafts at most 2 tokens per round" in capsys.readouterr().err


def test_a_fresh_model_with_heads_starts_as_the_plain_pretraining_would(tiny_corpus, tmp_path) -> None:
    """The held-out comparison with and without heads is fair: same initial model (the heads come after), same
    data; and the pre-training recipe runs with the sequential backward."""
    shape = {k: v for k, v in TINY_MODEL.items()}
    plain = CausalLMPretraining(tokenizer=tiny_corpus.tokenizer_dir, seed=3, **shape)
    with_heads = ParallelMTPHeads(tokenizer=tiny_corpus.tokenizer_dir, target_config=shape, num_heads=4, seed=3)
    a, b = plain.model.state_dict(), with_heads.mtp.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"\['num_hiden_layers'\] are not keys of a Llama config"):
        ParallelMTPHeads(tokenizer=tiny_corpus.tokenizer_dir, target_config={"num_hiden_layers": 2})
    run = tmp_path / "run"
    override = merge(
        trainer_overrides(run, max_steps=1, every_n=1),
        data_overrides(tiny_corpus),
        {"model": {"init_args": {"tokenizer": tiny_corpus.tokenizer_dir, "target_config": shape,
                                 "export_dir": str(run / "model"), "loss_chunk_size": 64}}},
    )  # fmt: skip
    cli = fit("quickstart/mtp_heads_pretrain.yaml", override, run)
    assert cli.model.backward_mode() == "sequential" and cli.model.mtp.num_heads == 4
    exported = load_export(run / "model")
    assert exported.num_layers == TINY_MODEL["num_hidden_layers"] and exported.num_heads == 4
