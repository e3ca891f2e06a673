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
from trainer.interface.errors import ModelFolderError
from trainer.methods.dflash import export as formats
from trainer.training.registry import load_drafter


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


# ---- folders written by speculators' own trainer -------------------------------------------------------------------

# config.json exactly as speculators 0.9.0 writes it: DFlashDraftModel.from_training_args(verifier_config=
# create_transformer_layer_config(verifier, num_layers, "qwen3", None, 2048, []), ...) then save_pretrained
# (speculators/train/cli.py create_transformer_layer_config; the trainer's defaults in speculators/train/config/
# schema.py: --sliding-window 2048, no --full-attention-indices, so every draft layer "sliding_attention", and
# sliding_window_non_causal False for dflash; the keys and defaults of speculators/models/dflash/config.py
# DFlashSpeculatorConfig). Only the sizes are the small drafter's; speculators' save_pretrained writes
# "architectures": ["DFlashDraftModel"], the z-lab name, beside speculators_model_type.
SPECULATORS_SAVED = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"": "config.DFlashSpeculatorConfig"},
    "aux_hidden_state_layer_ids": [1, 3],
    "block_size": 4,
    "draft_vocab_size": 50,
    "dtype": "float32",
    "mask_token_id": 49,
    "sample_from_anchor": False,
    "sliding_window_non_causal": False,
    "speculators_config": {
        "algorithm": "dflash",
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}
        ],
        "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "VERIFIER"},
    },
    "speculators_model_type": "dflash",
    "speculators_version": "0.9.0",
    "target_hidden_size": None,
    "tie_word_embeddings": False,
    "transformer_layer_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "head_dim": 8,
        "hidden_act": "silu",
        "hidden_size": 16,
        "initializer_range": 0.02,
        "intermediate_size": 32,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "max_position_embeddings": 256,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": 2048,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": True,
        "vocab_size": 50,
    },
    "transformers_version": "5.19.0",
}


def speculators_folder(tmp_path, drafter, **changes) -> str:
    """A folder as speculators' trainer saves one: SPECULATORS_SAVED (with ``changes``; a key set to None under
    ``transformer_layer_config`` is removed), the drafter's weights, and a local 4-layer verifier config."""
    verifier = tmp_path / "verifier"
    verifier.mkdir(exist_ok=True)
    (verifier / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}))
    config = json.loads(json.dumps(SPECULATORS_SAVED))
    config["speculators_config"]["verifier"]["name_or_path"] = str(verifier)
    for key, value in changes.items():
        if key.startswith("layer."):
            layer = config["transformer_layer_config"]
            layer.pop(key[6:], None) if value is None else layer.__setitem__(key[6:], value)
        else:
            config[key] = value
    out = tmp_path / "speculators_saved"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(out / "model.safetensors"))
    return str(out)


def reference_block(drafter, hidden, block, window, non_causal, layer_types) -> torch.Tensor:
    """One block anchored at position S after a context of S positions, through the drafter's layers with
    attention written out from speculators' ``create_anchor_block_mask_mod`` (speculators/models/dflash/
    attention.py): a query of the block sees base position ``c`` when ``c < anchor`` and, in a sliding layer,
    ``c >= anchor - sliding_window``; it sees slot ``j`` of its own block always in a full layer (non-causal), and in
    a sliding one when ``j <= i`` unless ``sliding_window_non_causal``. Softmax over the allowed keys, float64."""
    c = drafter.config
    S, b = hidden[0].shape[1], block.shape[1]
    anchor = S
    context = drafter.context(hidden)  # [1, S, H]
    cos_c, sin_c = drafter.rope(block, torch.arange(S)[None])
    cos, sin = drafter.rope(block, torch.arange(anchor, anchor + b)[None])
    h = block
    for index, layer in enumerate(drafter.layers):
        sliding = layer_types[index] == "sliding_attention" and window is not None
        allowed = torch.zeros(b, S + b, dtype=torch.bool)
        for i in range(b):
            for kv in range(S + b):
                if kv < S:  # base_prefix_mod
                    allowed[i, kv] = kv < anchor and (not sliding or kv >= anchor - window)
                else:  # same_block_mod: non-causal for full layers (sliding_window None) or when asked
                    allowed[i, kv] = (not sliding or non_causal) or (kv - S <= i)

        def attend(q, k, v, context_kv, allowed=allowed):
            keys = torch.cat([context_kv[0], k], dim=2).repeat_interleave(
                c.num_attention_heads // c.num_key_value_heads, 1
            )
            values = torch.cat([context_kv[1], v], dim=2).repeat_interleave(
                c.num_attention_heads // c.num_key_value_heads, 1
            )
            scores = (q @ keys.transpose(-1, -2)) / c.head_dim**0.5  # [1, nh, b, S + b]
            return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values

        h = layer(h, cos, sin, attend, (context, cos_c, sin_c))
    return drafter.norm(h)


@pytest.mark.parametrize(
    ("window", "non_causal", "layer_types"),
    [
        (2048, False, ["sliding_attention", "sliding_attention"]),  # speculators' trainer's default
        (3, False, ["sliding_attention", "sliding_attention"]),  # a window shorter than the context
        (3, True, ["full_attention", "sliding_attention"]),  # mixed layers, a non-causal window
        (None, False, ["sliding_attention", "sliding_attention"]),  # no window: full layers (use_sliding_window off)
    ],
)
def test_a_folder_saved_by_speculators_drafts_what_speculators_mask_gives(tmp_path, window, non_causal, layer_types):
    drafter = small_drafter(2).double().eval()
    changes = {"layer.layer_types": layer_types, "sliding_window_non_causal": non_causal}
    changes.update({"layer.sliding_window": window} if window else {"layer.use_sliding_window": False})
    folder = speculators_folder(tmp_path, drafter.float(), **changes)
    module, record = load_drafter(folder)  # speculators_model_type first, although architectures is z-lab's name
    assert record.kind == "dflash" and record.target == str(tmp_path / "verifier") and record.draft_tokens == 3
    c = module.config
    assert c.num_target_layers == 4 and c.target_layers == (1, 3) and c.head_dim == 8
    if window is None:
        assert c.layer_types is None and c.all_full  # as speculators: a sliding layer without a window is full
    else:
        assert c.layer_types == tuple(layer_types) and c.sliding_window == window
        assert c.sliding_window_non_causal is non_causal
    module = module.double()
    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn(1, 9, 16, generator=g, dtype=torch.float64) for _ in c.target_layers]
    block = torch.randn(1, c.block_size, 16, generator=g, dtype=torch.float64)
    with torch.no_grad():
        past = module.context_kv(module.context(hidden), torch.arange(9)[None])
        ours = module.draft(block, torch.arange(9, 9 + c.block_size)[None], past)
        want = reference_block(module, hidden, block, window, non_causal, layer_types)
        bidirectional = drafter.double().draft(block, torch.arange(9, 9 + c.block_size)[None], past)
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-10)
    if window is not None:  # reading the folder as bidirectional (what it was before) drafts other slots
        assert not torch.allclose(ours[:, :-1], bidirectional[:, :-1], atol=1e-6)


def test_speculators_fields_it_does_not_implement_are_refused_by_name(tmp_path):
    drafter = small_drafter(3).eval()
    cases = [
        ({"sample_from_anchor": True}, "sample_from_anchor true: the anchor slot drafting"),
        ({"target_hidden_size": 32}, "target_hidden_size 32: speculators' fc reads hidden states of the layers' width"),
        ({"layer.layer_types": ["linear_attention"] * 2}, r"transformer_layer_config.layer_types \[.*linear_attention"),
        (
            {"layer.layer_types": ["full_attention"]},
            r"transformer_layer_config is not a qwen3 config .*\(2\) must be equal to .*layer_types. \(1\)",
        ),
        ({"layer.attention_bias": True}, "attention_bias true: DFlash's attention projections have no bias"),
        ({"sliding_window_non_causal": "yes"}, 'sliding_window_non_causal "yes": must be true or false'),
        ({"draft_vocab_size": 32}, "draft_vocab_size 32: a reduced draft vocabulary"),
    ]
    for changes, message in cases:
        folder = speculators_folder(tmp_path, drafter, **changes)
        with pytest.raises(ModelFolderError, match=message):
            load_drafter(folder)
    folder = speculators_folder(tmp_path, drafter)
    config = json.loads((tmp_path / "speculators_saved" / "config.json").read_text())
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7
    (tmp_path / "speculators_saved" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=r"speculative_tokens \[7\]: a block of 4 drafts 1..3 tokens"):
        load_drafter(folder)


def test_sliding_layers_round_trip_in_the_speculators_format_and_not_in_zlabs(tmp_path):
    drafter = small_drafter(
        4, layer_types=("sliding_attention", "full_attention"), sliding_window=5, sliding_window_non_causal=False
    ).eval()
    out = formats.save_speculators(drafter, str(tmp_path / "spec"), verifier="some/target")
    config = json.loads((out / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention", "full_attention"] and layer["sliding_window"] == 5
    assert layer["use_sliding_window"] is True and config["sliding_window_non_causal"] is False
    assert config["sample_from_anchor"] is False
    reloaded = formats.load_speculators(str(out))
    assert reloaded.config == drafter.config
    torch.testing.assert_close(draft_logits(reloaded), draft_logits(drafter), rtol=0, atol=0)
    with pytest.raises(ModelFolderError, match=r"layer_types \['sliding_attention', 'full_attention'\].*z-lab format"):
        formats.save_zlab(drafter, str(tmp_path / "zlab"))
    with pytest.raises(ValueError, match="draftsmith trains non-causal blocks only"):
        drafter.train_blocks(torch.zeros(1, 6, 16), torch.zeros(1, 4, 16), torch.tensor([[2]]), "dense")
    # a z-lab folder whose layers are sliding is refused naming the field (its readers window each slot, not the anchor)
    zlab = formats.save_zlab(small_drafter(4), str(tmp_path / "zlab"))
    config = json.loads((zlab / "config.json").read_text())
    config.update(layer_types=["sliding_attention"] * 2, sliding_window=5, use_sliding_window=True)
    (zlab / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=r'layer_types \["sliding_attention", "sliding_attention"\].*each slot'):
        load_drafter(str(zlab))
    config.update(use_sliding_window=False)  # Qwen3's reading: no window, so full layers
    (zlab / "config.json").write_text(json.dumps(config))
    assert load_drafter(str(zlab))[0].config.all_full
