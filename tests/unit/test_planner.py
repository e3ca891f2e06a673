"""`draftsmith plan`: exact parameter, gradient and optimizer counts against real modules, the activation estimate
against tensors measured on CPU, recipe reading and the command's output."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.planner import PRESETS, Shape, drafter_activation_bytes, estimate, main, parse_bytes, plan_from_recipe

ROOT = Path(__file__).resolve().parents[2]
KD = str(ROOT / "recipes" / "quickstart" / "kd.yaml")

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def _llama(**config) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa"))


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        dict(TINY, tie_word_embeddings=True),
        dict(TINY, num_key_value_heads=4, head_dim=32, attention_bias=True),
        dict(TINY, hidden_size=96, intermediate_size=200, num_hidden_layers=3, mlp_bias=True),
    ],
)
def test_parameter_count_is_exact(config):
    model = _llama(**config)
    assert Shape.from_config(model.config.to_dict()).parameters() == sum(p.numel() for p in model.parameters())


def test_presets_match_the_published_sizes():
    assert Shape.from_config(PRESETS["llama-3-8b"]).parameters() == 8_030_261_248
    assert Shape.from_config(PRESETS["llama-3-70b"]).parameters() == 70_553_706_496
    assert Shape.from_config(PRESETS["llama-3.2-1b"]).parameters() == 1_235_814_400


def test_weights_grads_and_adamw_states_match_a_real_step():
    model = _llama(**TINY)
    shape = Shape.from_config(model.config.to_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.randint(0, 512, (2, 16)), labels=torch.randint(0, 512, (2, 16))).loss.backward()
    optimizer.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    states = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    by_stage = {e.stage: e for e in estimate(shape, shape, batch=2, seq=16, gpus=4, precision="32-true")}
    assert by_stage["ddp"].drafter_weights == weights and by_stage["ddp"].gradients == grads
    assert by_stage["ddp"].optimizer == states
    # each stage shards one more part across the 4 ranks
    assert by_stage["zero1"].optimizer == -(-states // 4) and by_stage["zero1"].gradients == grads
    assert by_stage["zero2"].gradients == -(-grads // 4) and by_stage["zero2"].drafter_weights == weights
    assert by_stage["zero3"].drafter_weights == -(-weights // 4)
    assert by_stage["zero3"].target_weights < by_stage["zero2"].target_weights
    assert [e.total for e in by_stage.values()][:3] == sorted([e.total for e in by_stage.values()][:3], reverse=True)


@pytest.mark.parametrize(
    "batch, seq, config", [(2, 64, TINY), (4, 128, dict(TINY, hidden_size=128, intermediate_size=344))]
)
def test_activation_estimate_against_measured_saved_tensors(batch, seq, config):
    """The tensors autograd keeps for backward (distinct storages, measured on CPU) within 0.8x-1.25x of the plan."""
    model = _llama(**config)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 512, (batch, seq))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, S, H]
    measured = sum(n for ptr, n in seen.items() if ptr not in params)
    planned = drafter_activation_bytes(Shape.from_config(model.config.to_dict()), batch, seq, act_bytes=4)
    assert hidden.shape == (batch, seq, config["hidden_size"])
    print(f"activations measured {measured} planned {planned} ratio {measured / planned:.2f}")
    assert 0.8 * planned <= measured <= 1.25 * planned, (measured, planned)


def test_recipe_reading_applies_drafter_config(tmp_path):
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(dict(TINY, model_type="llama")))
    plan = plan_from_recipe([KD], target_config=str(target_dir))
    # kd.yaml: a 2-layer, hidden-128 student with the target's vocabulary; batch 8 x 256, fp32
    assert plan.drafter.num_hidden_layers == 2 and plan.drafter.hidden_size == 128
    assert plan.drafter.vocab_size == 512 and plan.drafter.head_dim == 32
    assert (plan.batch, plan.seq, plan.precision) == (8, 256, "32-true")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  init_args:\n    drafter_config:\n      num_hiden_layers: 2\n")
    with pytest.raises(ValueError, match="num_hiden_layers"):
        plan_from_recipe([KD, str(bad)], target="llama-3-8b")
    with pytest.raises(ValueError, match="llama-9b"):
        plan_from_recipe([KD], target="llama-9b")


@pytest.mark.parametrize("recipe", ["kd.yaml", "on_policy.yaml", "kd_offline.yaml"])
def test_quickstart_recipes_plan_without_their_artifacts(recipe, tmp_path, monkeypatch, capsys):
    """The recipes name artifacts/tiny_target, absent here: the recipe parses, the target shape is the preset's."""
    monkeypatch.chdir(tmp_path)
    path = str(ROOT / "recipes" / "quickstart" / recipe)
    seq = ["--seq_len", "128"] if "offline" in recipe else []  # a ShardDataModule's length is in its shards
    assert main(["--config", path, "--gpus", "2", "--target", "llama-3.2-1b", *seq]) == 0
    out = capsys.readouterr().out
    assert "fits:" in out and "| zero3 |" in out
    plan = plan_from_recipe([path], target="llama-3.2-1b", seq=128 if seq else None)
    assert plan.target == Shape.from_config(PRESETS["llama-3.2-1b"])
    assert (plan.drafter.num_hidden_layers, plan.drafter.hidden_size) == (2, 128)
    assert (plan.batch, plan.seq, plan.precision, plan.chunk_size) == (8, 128 if seq else 256, "32-true", 512)
    if "offline" in recipe:
        assert main(["--config", path, "--gpus", "2", "--target", "llama-3.2-1b"]) == 2
        assert "seq_len" in capsys.readouterr().err


def test_composed_recipe_and_fit_arguments(tmp_path):
    ddp = str(ROOT / "recipes" / "_base" / "ddp.yaml")
    plan = plan_from_recipe([KD, ddp], target="llama-3-8b", overrides=["--data.init_args.batch_size", "3"])
    assert plan.batch == 3 and plan.seq == 256 and plan.chunk_size == 512
    with pytest.raises(ValueError, match="batch_sise"):
        plan_from_recipe([KD, ddp], target="llama-3-8b", overrides=["--data.init_args.batch_sise", "3"])


def test_what_a_recipe_omits_comes_from_the_signatures(tmp_path):
    """A recipe without loss_chunk_size, batch_size, seq_len and precision: the KD objective's, the datamodule's and
    the Trainer's defaults, as fit would use them."""
    from trainer.data.text import TextDataModule
    from trainer.methods.draft_model.kd import KnowledgeDistillation

    lines = Path(KD).read_text().splitlines()
    dropped = ("loss_chunk_size:", "batch_size:", "seq_len:", "precision:")
    bare = tmp_path / "bare.yaml"
    bare.write_text("\n".join(line for line in lines if not line.strip().startswith(dropped)) + "\n")
    plan = plan_from_recipe([str(bare)], target="llama-3-8b")

    def default(cls, name):
        return inspect.signature(cls.__init__).parameters[name].default

    assert plan.chunk_size == default(KnowledgeDistillation, "loss_chunk_size")
    assert plan.batch == default(TextDataModule, "batch_size") and plan.seq == default(TextDataModule, "seq_len")
    assert plan.precision == "32-true"  # Lightning's default precision (None) resolves to 32-true
    # what a recipe sets wins over the default
    sets = tmp_path / "sets.yaml"
    sets.write_text("model:\n  init_args:\n    loss_chunk_size: 64\ndata:\n  init_args:\n    seq_len: 32\n")
    plan = plan_from_recipe([str(bare), str(sets)], target="llama-3-8b")
    assert (plan.chunk_size, plan.seq) == (64, 32)


def test_command_prints_the_table_and_what_fits(capsys):
    assert (
        main(
            [
                "--config",
                KD,
                "--gpus",
                "8",
                "--gpu_memory",
                "80GB",
                "--target",
                "llama-3-70b",
                "--precision",
                "bf16-mixed",
                "--batch_size",
                "1",
                "--seq_len",
                "2048",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"ddp", "zero1", "zero2", "zero3"}
    # a 70B bf16 target (131 GiB) fits 80 GB GPUs only when ZeRO-3 partitions it
    assert rows["ddp"].rstrip().endswith("| no |") and rows["zero3"].rstrip().endswith("| yes |")
    assert out.strip().splitlines()[-1] == "fits: zero3"
    assert main(["--config", KD, "--gpus", "1", "--gpu_memory", "lots"]) == 2
    assert "lots" in capsys.readouterr().err
    assert parse_bytes("80GB") == 80 * 1024**3 and parse_bytes("512MiB") == 512 * 1024**2
