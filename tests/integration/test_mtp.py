"""Sequential MTP end to end through the real CLI: pre-training the tiny target's shape with two modules, refresh on a
frozen model (new modules, and the modules a model checkpoint holds), extend (MiMo); ``draftsmith export`` and
``draftsmith eval --drafter CKPT|DIR`` through the drafter kind, lossless decoding on the trained model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.recipe_runs import TINY_MODEL, data_overrides, fit, merge, trainer_overrides
from trainer.checkpoints.reading import load_training_checkpoint
from trainer.cli import main as draftsmith
from trainer.decoding.evaluate import evaluate_drafter, load_prompts, resolve_drafter
from trainer.decoding.options import ProposerOptions
from trainer.export.cli import main as export_main
from trainer.methods.mtp.objective import SequentialMTP
from trainer.training.registry import recognise

pytestmark = pytest.mark.slow


def mtp_override(run: Path, corpus, max_steps: int, **model) -> dict:
    return merge(
        trainer_overrides(run, max_steps=max_steps, every_n=max_steps),
        data_overrides(corpus),
        {"model": {"init_args": {"loss_chunk_size": 64, "optim": {"lr": 0.005, "warmup_steps": 5}, **model}}},
    )


def decode(target_dir: Path, drafter: str, corpus, ks: list[int], temperature: float = 1.0, **options) -> dict:
    """``draftsmith eval`` in-process on one held-out prompt: greedy output checked against the target's, sampling at
    ``temperature`` (0: greedy only)."""
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompts = load_prompts(corpus.heldout_file, AutoTokenizer.from_pretrained(target_dir), cut=24)[:1]
    proposer = resolve_drafter(drafter, target, ProposerOptions(**options))
    return evaluate_drafter(target, proposer, prompts, ks, max_new_tokens=16, temperature=temperature)


@pytest.fixture(scope="module")
def pretrained(tiny_corpus, tmp_path_factory):
    """recipes/quickstart/mtp_pretrain.yaml with two modules, 6 steps, the SpeculativeEvalCallback at the end."""
    run = tmp_path_factory.mktemp("mtp_pretrain")
    override = mtp_override(
        run, tiny_corpus, 6, tokenizer=tiny_corpus.tokenizer_dir, target_config=TINY_MODEL, mtp_depth=2,
        export_dir=str(run / "model"),
    )  # fmt: skip
    override["trainer"]["callbacks"].append(
        {
            "class_path": "trainer.decoding.callback.SpeculativeEvalCallback",
            "init_args": {
                "prompts": str(tiny_corpus.heldout_file),
                "prompt_tokens": 16,
                "k": 2,
                "max_new_tokens": 8,
                "every_n_steps": 6,
                "max_prompts": 1,
                "temperature": 1.0,
            },
        }  # fmt: skip
    )
    cli = fit("quickstart/mtp_pretrain.yaml", override, run)
    return run, cli


def test_pretraining_exports_and_evaluates_through_the_kind(pretrained, tiny_corpus, tmp_path, capsys):
    run, cli = pretrained
    callback = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SpeculativeEvalCallback")
    assert {"spec_eval/tau", "spec_eval/acceptance_2", "spec_eval/tau_sampling"} <= set(callback.last)
    ckpt = run / "checkpoints" / "last.ckpt"
    state, record = load_training_checkpoint(str(ckpt))
    assert record["kind"] == "mtp" and record["config"]["depth"] == 2 and record["target"] is None
    assert {k.split(".")[1] for k in state if k.startswith("drafter.")} == {"trunk", "mtp"}
    # the default export: the model with its modules in the mtp.* layout (a Llama trunk has no NextN layout)
    assert export_main(["--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "model")]) == 0
    kind, fmt = recognise(tmp_path / "model")
    assert (kind.name, fmt.name) == ("mtp", "qwen3-next")
    assert export_main(["--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "nextn"), "--format", "nextn"]) == 2
    assert "model_type 'llama'" in capsys.readouterr().err
    assert export_main(["--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "plain"), "--format", "hf"]) == 0
    saved = AutoModelForCausalLM.from_pretrained(run / "model").eval()  # the export_dir of the run
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    ids = torch.tensor([[1, 5, 9, 30, 7]])
    torch.testing.assert_close(plain(ids).logits, saved(ids).logits, rtol=0, atol=0)
    # draftsmith eval --drafter CKPT and --drafter DIR: lossless, the same drafts
    by_ckpt = decode(run / "model", str(ckpt), tiny_corpus, [4])
    by_dir = decode(tmp_path / "model", str(tmp_path / "model"), tiny_corpus, [2], temperature=0.0, tree=True)
    assert all(entry["identical"] for entry in by_ckpt["greedy"] + by_dir["greedy"])
    assert len(by_ckpt["greedy"][0]["acceptance_per_position"]) == 4 and by_ckpt["sampling"]
    proposer = resolve_drafter(str(ckpt), saved)
    with pytest.raises(ValueError, match="2 does not divide 3"):
        proposer.check_k(3)
    # draftsmith eval refuses a --k the modules do not divide before decoding anything
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    argv = ["--target", str(run / "model"), "--drafter", str(ckpt), "--prompts", str(prompts), "--k", "1,3"]
    assert draftsmith(["eval", *argv, "--output_dir", str(tmp_path / "eval")]) == 2
    assert "2 does not divide 3" in capsys.readouterr().err and not (tmp_path / "eval").exists()


def test_refresh_and_extend_on_a_frozen_model(tiny_corpus, tiny_target, tmp_path):
    refresh_run = tmp_path / "refresh"
    fit(
        "quickstart/mtp_refresh.yaml",
        mtp_override(refresh_run, tiny_corpus, 4, target=str(tiny_target), init_from=None),
        refresh_run,
    )
    ckpt = refresh_run / "checkpoints" / "last.ckpt"
    state, record = load_training_checkpoint(str(ckpt))
    assert record["target"] == str(tiny_target) and set(record["components"]) == {"mtp"}
    assert all(k.startswith("drafter.mtp.") or k == "mtp_tokens_seen" for k in state)  # the frozen model is not saved
    # the model with its refreshed module, then a refresh that reads the module from that model checkpoint itself
    assert export_main(["--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "with_module")]) == 0
    again = SequentialMTP(mode="refresh", target=str(tmp_path / "with_module"))
    for name, value in again.drafter.mtp.state_dict().items():
        assert torch.equal(value, state[f"drafter.mtp.{name}"]), name
    extend_run = tmp_path / "extend"
    override = mtp_override(extend_run, tiny_corpus, 4, target=str(tiny_target), init_from=str(ckpt), mtp_depth=3)
    cli = fit("quickstart/mtp_extend.yaml", override, extend_run)
    extended, record = load_training_checkpoint(str(extend_run / "checkpoints" / "last.ckpt"))
    assert record["config"]["depth"] == 3
    for name in [k for k in state if k.startswith("drafter.mtp.layers.0.")]:
        assert torch.equal(extended[name], state[name])  # module 1 frozen (and the fc and norms all modules share)
        copy = name.replace("layers.0.", "layers.1.")
        if ".block." in name and "norm" not in name:
            assert not torch.equal(extended[copy], state[name])  # module 2's block trained from its copy
    assert {"train/mtp_loss_2", "train/mtp_loss_3"} <= set(cli.trainer.callback_metrics)
    report = decode(tiny_target, str(extend_run / "checkpoints" / "last.ckpt"), tiny_corpus, [3], temperature=0.0)
    assert all(entry["identical"] for entry in report["greedy"])
