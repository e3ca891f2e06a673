"""DFlash exports read back by each reader's rules: the z-lab format as vLLM, SGLang and the z-lab package read it
(every tensor consumed, the same logits, the layer ids meaning the same target tensor in every reader's counting),
the speculators format, and the loaders' refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests.unit.test_dflash_drafter import small_drafter
from trainer.methods.dflash import export as formats
from trainer.registry import load_drafter


def draft_logits(drafter, seed: int = 0) -> torch.Tensor:
    """The block outputs of a drafter for fixed target hidden states and block, [1, b, H]."""
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(1, 9, 16, generator=g) for _ in drafter.config.target_layers]
    block = torch.randn(1, drafter.config.block_size, 16, generator=g)
    with torch.no_grad():
        past = drafter.context_kv(drafter.context(hidden), torch.arange(9)[None])
        return drafter.draft(block, torch.arange(9, 9 + drafter.config.block_size)[None], past)


EXPECTED = {
    f"layers.{i}.{name}.weight"
    for i in range(2)
    for name in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )  # fmt: skip
} | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def test_zlab_export_reloads_by_every_readers_rules(tmp_path):
    drafter = small_drafter().eval()
    out = formats.save_zlab(drafter, str(tmp_path / "zlab"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    assert config["num_target_layers"] == 4 and config["num_hidden_layers"] == 2
    assert config["dflash_config"]["mask_token_id"] == 49
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]  # outputs of layers: HF indices 1, 3 minus one
    assert "eagle_aux_hidden_state_layer_ids" not in config  # vLLM then adds one to target_layer_ids itself
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == EXPECTED  # no embedding, no lm_head: the target's are used
    assert tuple(tensors["fc.weight"].shape) == (16, 2 * 16)
    expected = draft_logits(drafter)
    for reading in ("vllm", "sglang", "dflash"):
        reloaded = formats.load_zlab(str(out), reading).eval()
        assert reloaded.config == drafter.config, reading
        torch.testing.assert_close(draft_logits(reloaded), expected, rtol=0, atol=0)
    module, record = load_drafter(str(out))  # recognised from its files
    assert record.kind == "dflash" and record.target_layers == [1, 3] and record.draft_tokens == 3


def test_layer_ids_name_the_same_target_tensor_for_every_reader(tmp_path):
    """SGLang captures the output of decoder layer ``id``; vLLM the input of layer ``id + 1`` (or of the layers a
    top-level eagle_aux_hidden_state_layer_ids names); the z-lab package reads HF's ``hidden_states[id + 1]``. Hooks
    on a real target's layers give each engine's tensor, which must be the one the drafter trained on."""
    drafter = small_drafter()
    out = formats.save_zlab(drafter, str(tmp_path / "zlab"))
    config = json.loads((out / "config.json").read_text())
    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4)
    ).eval()
    outputs, inputs = {}, {}
    for i, layer in enumerate(target.model.layers):
        layer.register_forward_hook(
            lambda m, args, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: inputs.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True,
        )
    ids = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    trained_on = [hidden[i] for i in drafter.config.target_layers]  # what compute_loss and the proposer read
    ids_written = config["dflash_config"]["target_layer_ids"]
    sglang = [outputs[j] for j in ids_written]  # read as written: outputs of layers
    vllm = [inputs[i] for i in formats.zlab_target_layers(config, "vllm", "x")]  # inputs of layers (ids + 1)
    package = [hidden[j + 1] for j in ids_written]  # dflash.model.extract_context_feature: offset 1
    for name, tensors in (("sglang", sglang), ("vllm", vllm), ("dflash", package)):
        for got, want in zip(tensors, trained_on):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert formats.zlab_target_layers(config, "sglang", "x") == formats.zlab_target_layers(config, "vllm", "x")
    # a top-level key is what vLLM reads instead, verbatim, as inputs of layers
    config["eagle_aux_hidden_state_layer_ids"] = [2, 3]
    assert formats.zlab_target_layers(config, "vllm", "x") == [2, 3]


def test_speculators_export_reloads(tmp_path):
    drafter = small_drafter(1).eval()
    out = formats.save_speculators(
        drafter, str(tmp_path / "spec"), verifier="some/target", verifier_architectures=["X"]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert config["aux_hidden_state_layer_ids"] == [1, 3]  # z-lab ids [0, 2] + 1
    assert config["mask_token_id"] == 49 and config["block_size"] == 4
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert set(load_file(str(out / "model.safetensors"))) == EXPECTED
    reloaded = formats.load_speculators(str(out)).eval()
    torch.testing.assert_close(draft_logits(reloaded), draft_logits(drafter), rtol=0, atol=0)
    _, record = load_drafter(str(out))
    assert record.kind == "dflash" and record.target == "some/target"


def test_loaders_refuse_what_an_engine_would_misread(tmp_path):
    out = formats.save_zlab(small_drafter(), str(tmp_path / "zlab"))
    weights, config_path = out / "model.safetensors", out / "config.json"
    tensors = load_file(str(weights))
    good = json.loads(config_path.read_text())

    def rewrite(config=None, extra=None, drop=None):
        save_file({**{k: v for k, v in tensors.items() if k != drop}, **(extra or {})}, str(weights))
        config_path.write_text(json.dumps(config or good))

    rewrite(extra={"embed_tokens.weight": torch.zeros(50, 16)})
    with pytest.raises(ValueError, match=r"tensors not consumed \['embed_tokens.weight'\]"):
        formats.load_zlab(str(out))
    rewrite(drop="layers.1.self_attn.k_norm.weight")
    with pytest.raises(ValueError, match=r"weights missing \['layers.1.self_attn.k_norm.weight'\]"):
        formats.load_zlab(str(out))
    rewrite({**good, "block_size": 8})
    with pytest.raises(ValueError, match="block_size 8 and dflash_config.block_size 4 disagree"):
        formats.load_zlab(str(out))
    rewrite({**good, "dflash_config": {"mask_token_id": 49, "block_size": 4}})
    with pytest.raises(ValueError, match="dflash_config.target_layer_ids is missing"):
        formats.load_zlab(str(out))
    rewrite({**good, "dflash_config": {**good["dflash_config"], "target_layer_ids": [0, 3]}})
    with pytest.raises(ValueError, match=r"target_layers=\[1, 4\]: \[4\] outside"):
        formats.load_zlab(str(out))
    rewrite({**good, "dflash_config": {"target_layer_ids": [0, 2], "block_size": 4}})
    with pytest.raises(ValueError, match="config.json lacks the key 'mask_token_id'"):
        formats.load_zlab(str(out))
