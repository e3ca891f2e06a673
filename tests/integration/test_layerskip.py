"""LayerSkip through the real CLI: per-sample layer dropout in 2 processes under DDP, FSDP2 and ZeRO-3 (ranks skip
different layers: no collective may hang, no gradient may be missing), the end-of-fit export, and ``draftsmith eval``
sweeping the exit layer on it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests._multiproc import run_group
from tests.recipe_runs import RECIPES, data_overrides, merge, trainer_overrides, write_override
from trainer.cli import main as draftsmith
from trainer.decoding.eval_cli import main as eval_main

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}


def layerskip_override(run: Path, corpus, steps: int) -> dict:
    """The quickstart pre-training recipe on a 4-layer, hidden-32 model with a high dropout rate: with 2 rows per
    rank, some steps have a layer that every row of one rank skips while the other rank runs it."""
    return merge(
        trainer_overrides(run, max_steps=steps, every_n=steps),
        data_overrides(corpus, batch_size=2),
        {
            "model": {
                "init_args": {
                    "tokenizer": str(corpus.tokenizer_dir),
                    "target_config": SHAPE,
                    "p_max": 0.9,
                    "export_dir": str(run / "model"),
                    "loss_chunk_size": 64,
                }
            }
        },
    )


# A layer one rank skipped and another ran would hang a sharded strategy's gather or DDP's gradient reduction: ZeRO-3
# stands for FSDP2 here (both gather a layer's shards before it runs); one run of each kind of hazard.
@pytest.mark.parametrize("strategy", ["ddp.yaml", "deepspeed_zero3.yaml"])
@pytest.mark.multiprocess
def test_layer_dropout_in_two_processes_neither_hangs_nor_misses_gradients(
    strategy, tiny_corpus, tmp_path, torch_extensions_dir
) -> None:
    run = tmp_path / "run"
    override = write_override(tmp_path / "override.yaml", layerskip_override(run, tiny_corpus, 6))
    cmd = [
        str(Path(sys.executable).parent / "draftsmith"), "fit",
        "--config", str(RECIPES / "quickstart/layerskip_pretrain.yaml"), "--config", str(RECIPES / "_base" / strategy),
        "--config", str(override), "--trainer.devices", "2", "--trainer.accelerator", "cpu",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = run_group(cmd, timeout=300, log_dir=run / "logs", nprocs=2, env=env, rank_env=True, cwd=str(REPO))
    assert res.ok, f"2-process fit failed (timed out: {res.timed_out}, exit {res.returncodes}):\n{res.output[-5000:]}"
    assert (run / "model" / "layerskip.json").is_file() and (run / "model" / "model.safetensors").is_file()


def test_eval_sweeps_the_exit_layer_of_an_exported_model(tiny_corpus, tmp_path) -> None:
    from tests.recipe_runs import fit

    run = tmp_path / "run"
    fit("quickstart/layerskip_pretrain.yaml", layerskip_override(run, tiny_corpus, 4), run)
    prompts = tmp_path / "prompts.jsonl"
    lines = Path(tiny_corpus.heldout_file).read_text().splitlines()[:2]
    prompts.write_text("".join(json.dumps({"prompt": json.loads(x)["text"][:100]}) + "\n" for x in lines))
    model = str(run / "model")
    argv = ["--target", model, "--drafter", model, "--prompts", str(prompts), "--max_new_tokens", "12"]
    argv += ["--k", "3", "--target_dtype", "float64", "--temperature", "0", "--output_dir", str(tmp_path / "eval")]
    assert eval_main([*argv, "--exit_layer", "1,3"]) == 0
    for exit_layer in (1, 3):
        report = json.loads((tmp_path / "eval" / f"exit_{exit_layer}" / "report.json").read_text())
        assert report["exit_layer"] == exit_layer and report["greedy"][0]["identical"]
    assert draftsmith(["eval", *argv, "--exit_layer", "4"]) == 2  # the model has layers 0..3: E must be in 1..3
    with pytest.raises(SystemExit):
        eval_main([*argv, "--exit_layer", "0"])


def test_resume_drops_the_same_layers_and_ends_at_the_same_weights(tiny_corpus, tmp_path) -> None:
    """Layer dropout and the rotational curriculum are functions of (seed, step): a run stopped after 2 of 4 steps and
    resumed from its checkpoint ends at the uninterrupted run's weights."""
    import torch
    from safetensors.torch import load_file

    from tests.recipe_runs import fit

    def override(run: Path, extra_callbacks: list) -> dict:
        settings = layerskip_override(run, tiny_corpus, 4)
        settings["model"]["init_args"].update({"p_max": 0.5, "curriculum": "rotational"})
        settings["trainer"]["val_check_interval"] = 2
        settings["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
        settings["trainer"]["callbacks"] += extra_callbacks
        return settings

    straight, split = tmp_path / "straight", tmp_path / "split"
    fit("quickstart/layerskip_pretrain.yaml", override(straight, []), straight)
    stop = {"class_path": "tests.callbacks.StopAtStep", "init_args": {"step": 2}}
    fit("quickstart/layerskip_pretrain.yaml", override(split, [stop]), split)
    fit("quickstart/layerskip_pretrain.yaml", override(split, []), split, ("--ckpt_path", "last"))
    a = load_file(straight / "model" / "model.safetensors")
    b = load_file(split / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


def test_the_fine_tune_recipe_runs_with_a_logger(tiny_corpus, tiny_target, tmp_path) -> None:
    """recipes/quickstart/layerskip_finetune.yaml logs to TensorBoard: the model's unused ``tokenizer`` argument must
    not clash with the datamodule's hyperparameter of the same name (Lightning refuses two values)."""
    from tests.recipe_runs import fit

    settings = merge(
        trainer_overrides(tmp_path, max_steps=2, every_n=2),
        data_overrides(tiny_corpus, batch_size=2),
        {
            "model": {
                "init_args": {
                    "target": str(tiny_target),
                    "export_dir": str(tmp_path / "model"),
                    "loss_chunk_size": 64,
                    "early_exit_layers": [0],
                }
            }
        },  # the test target has 2 layers
    )
    fit("quickstart/layerskip_finetune.yaml", settings, tmp_path)
    marker = json.loads((tmp_path / "model" / "layerskip.json").read_text())
    assert marker["labels"] == "original" and marker["target_kl_weight"] == 4.0  # the recipe keeps the original
    assert list((tmp_path / "tensorboard").rglob("hparams.yaml"))
