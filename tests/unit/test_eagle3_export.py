"""EAGLE-3 exports: native and speculators round trips (every tensor consumed, none missing, same logits), layer ids
in both engines' conventions, and clear errors on tampered files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.test_eagle3_drafter import small_drafter
from trainer.export.files import WEIGHTS
from trainer.interface.errors import ModelFolderError
from trainer.methods.eagle3.export import load_native, load_speculators, save_native, save_speculators
from trainer.training.registry import load_drafter, recognise


def logits_of(drafter, embedding, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = drafter.config.target_hidden_size
    fused_in = [torch.randn(2, 6, width, generator=g, dtype=torch.float64) for _ in drafter.config.aux_layers]
    tokens = torch.randint(0, drafter.config.vocab_size, (2, 6), generator=g)
    fused = drafter.fuse(fused_in)
    return torch.stack([logits for logits in drafter.unroll(embedding, fused, tokens, 3)])  # [3, B, S, Vd]


@pytest.mark.parametrize("fmt", ["native", "speculators"])
def test_round_trip(fmt, tmp_path):
    drafter, embedding = small_drafter(2, target_hidden=12 if fmt == "native" else 16)
    if fmt == "native":
        save_native(drafter, str(tmp_path))
        reloaded = load_native(str(tmp_path))
    else:
        save_speculators(
            drafter, str(tmp_path), verifier="some/target", embedding=embedding.weight, speculative_tokens=5,
            verifier_architectures=["LlamaForCausalLM"],
        )  # fmt: skip
        reloaded = load_speculators(str(tmp_path))
    kind, recognised = recognise(tmp_path)  # what `draftsmith eval --drafter DIR` does with the folder
    assert (kind.name, recognised.name) == ("eagle3", "eagle3" if fmt == "native" else "eagle3-speculators")
    assert load_drafter(str(tmp_path))[1].target_layers == [1, 2, 3]
    reloaded = reloaded.double()
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(str(tmp_path / WEIGHTS))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].shape == (16, 3 * drafter.config.target_hidden_size)
    layer = "midlayer." if fmt == "native" else "layers.0."
    assert tensors[layer + "self_attn.q_proj.weight"].shape == (4 * 8, 2 * 16)
    if fmt == "native":  # SGLang and vLLM take the target's embedding
        assert not any(k.startswith("embed_tokens") for k in tensors)
    else:  # speculators reads it from the file (and keeps uninitialised memory without it)
        torch.testing.assert_close(tensors["embed_tokens.weight"], embedding.weight, rtol=0, atol=0)
    # HF hidden_states indices (1, 2, 3) are inputs of layers for vLLM, outputs of layers (one less) for SGLang
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    if fmt == "native":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert config["draft_vocab_size"] == 20 and config["vocab_size"] == 50
        assert config["tie_word_embeddings"] is False
    else:
        assert config["architectures"] == ["Eagle3Speculator"] and config["norm_before_residual"] is False
        assert config["speculators_config"]["verifier"]["name_or_path"] == "some/target"
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
        assert config["transformer_layer_config"]["num_hidden_layers"] == 1
        assert config["norm_before_fc"] is config["fc_norm"] is config["norm_output"] is False
    for key, value in drafter.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[key], value, rtol=0, atol=0)
    torch.testing.assert_close(logits_of(reloaded, embedding), logits_of(drafter, embedding), rtol=0, atol=0)


@pytest.mark.parametrize("tamper", ["extra", "missing", "t2d", "ids"])
def test_tampered_exports_are_refused(tamper, tmp_path):
    drafter, _ = small_drafter(3)
    save_native(drafter, str(tmp_path))
    tensors = load_file(str(tmp_path / WEIGHTS))
    config = json.loads((tmp_path / "config.json").read_text())
    if tamper == "extra":
        tensors["midlayer.self_attn.q_norm.weight"] = torch.ones(8)
        message = "not consumed"
    elif tamper == "missing":
        del tensors["d2t"]
        message = "missing"
    elif tamper == "t2d":
        tensors["t2d"] = ~tensors["t2d"]
        message = "t2d does not match"
    else:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # off by one
        message = "disagree"
    save_file(tensors, str(tmp_path / WEIGHTS))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_native(str(tmp_path))


def test_speculators_loader_rejects_native_names_and_a_missing_embedding(tmp_path):
    drafter, embedding = small_drafter(4, target_hidden=16)
    save_native(drafter, str(tmp_path / "native"))
    save_speculators(drafter, str(tmp_path / "spec"), verifier="t", embedding=embedding.weight, speculative_tokens=3)
    native = load_file(str(tmp_path / "native" / WEIGHTS))
    save_file(native, str(tmp_path / "spec" / WEIGHTS))
    with pytest.raises(ValueError, match="embed_tokens.weight is None"):
        load_speculators(str(tmp_path / "spec"))
    save_file({**native, "embed_tokens.weight": embedding.weight.detach()}, str(tmp_path / "spec" / WEIGHTS))
    with pytest.raises(ValueError, match="not consumed"):
        load_speculators(str(tmp_path / "spec"))
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    config["transformer_layer_config"]["num_hidden_layers"] = 2  # a deeper EAGLE-3 drafter: named, not misread
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="num_hidden_layers is 2: draftsmith's EAGLE-3 drafter has one"):
        load_speculators(str(tmp_path / "spec"))


def test_speculators_writer_refuses_what_speculators_cannot_load(tmp_path):
    drafter, embedding = small_drafter(5)  # drafter width 16, target width 12
    with pytest.raises(ValueError, match="width .16. to be the target's .12."):
        save_speculators(drafter, str(tmp_path), verifier="t", embedding=embedding.weight, speculative_tokens=3)
    repeated, embedding = small_drafter(6, target_hidden=16)
    repeated.config.aux_layers = (2, 2, 1)
    with pytest.raises(ValueError, match="repeated target layer ids"):
        save_speculators(repeated, str(tmp_path), verifier="t", embedding=embedding.weight, speculative_tokens=3)
    assert not any(tmp_path.iterdir())  # nothing written
