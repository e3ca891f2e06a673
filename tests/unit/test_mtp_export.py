"""MTP exports reloaded by loaders that follow the engines' rules: every tensor consumed, the same weights and logits;
the NextN copies of the embedding and lm_head bitwise the target's; an engine-style forward written from the raw
tensors (vLLM's DeepSeekMTP and Qwen3NextMTP, the blocks loaded by transformers itself) agrees with the modules; the
model without its modules loads in transformers; and the bad inputs are named."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

from tests.helpers import tiny_llama, tiny_model
from trainer.methods.mtp import export as exports
from trainer.methods.mtp import kind as kind
from trainer.methods.mtp.module import MTPConfig, MTPDrafter
from trainer.training.registry import kinds

IDS = torch.tensor([[5, 3, 9, 1, 7, 2, 8, 4, 6, 0, 11, 12]])


def perturbed(drafter: MTPDrafter, seed: int = 0) -> MTPDrafter:
    """Every weight moved off its initial value (norms of ones would hide a swapped norm)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return drafter.eval()


def setup_target(tmp_path, family: str, dense_block: bool = False):
    if family == "llama":
        target = tiny_llama(0, vocab=96, hidden=32, layers=2)
    else:  # first_k_dense_replace = layers: the trunk is dense, the MTP block (layer N) is MoE, as engines build it
        target = tiny_model("deepseek_v3", 0, vocab=96, layers=3)
        if dense_block:
            target.config.first_k_dense_replace = 8  # the block at layer N dense too
    with torch.no_grad():  # a trained final norm: its input and output then differ beyond a scale
        target.model.norm.weight.copy_(torch.linspace(0.5, 1.5, target.config.hidden_size, dtype=torch.float64))
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    return target, str(folder)


def modules(target, folder: str, depth: int, **config) -> tuple[MTPDrafter, object]:
    torch.manual_seed(1)
    mtp_config = MTPConfig.for_trunk(target.config, depth, **config)
    drafter = perturbed(MTPDrafter(mtp_config).to(torch.float64))
    record = kind.make_record(mtp_config, folder, ["X"], with_trunk=False, tokenizer=None)
    return drafter, record


def module_logits(drafter: MTPDrafter, target, k: int = 0, steps: int = 1) -> torch.Tensor:
    """Logits of module 0 (then ``steps - 1`` reuses of it, as a one-module engine chains them) over IDS."""
    with torch.no_grad():
        h = target(input_ids=IDS, output_hidden_states=True).hidden_states[-1][:, :-1]  # the target's normed output
        positions = torch.arange(IDS.shape[1] - 1)[None]
        out = drafter.mtp.run(k, h, target.get_input_embeddings()(IDS[:, 1:]), positions)
        return target.lm_head(drafter.mtp.head_input(k, out))


@pytest.mark.parametrize("dense_block", [False, True], ids=["moe_block", "dense_block"])
def test_nextn_round_trip_and_engine_forward(dense_block, tmp_path, one_thread):
    target, folder = setup_target(tmp_path, "deepseek_v3", dense_block)
    drafter, record = modules(target, folder, depth=2)
    out = kind.NEXTN.write(drafter, record, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    N = target.config.num_hidden_layers
    assert config["num_hidden_layers"] == N and config["num_nextn_predict_layers"] == 2
    tensors = {**load_file(str(out / exports.MTP_WEIGHTS)), **load_file(str(out / "model.safetensors"))}
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(tensors)  # engines read the files the index names
    for k in range(2):
        p = f"model.layers.{N + k}."
        assert tensors[p + "eh_proj.weight"].shape == (32, 64)
        for own in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "self_attn.kv_b_proj.weight"):
            assert p + own in tensors
        assert (p + "mlp.experts.0.gate_proj.weight" in tensors) is not dense_block  # per-expert, as HF saves
        # the head and embedding are exact copies of the target's: vLLM swaps in the target's, SGLang ignores them
        assert torch.equal(tensors[p + "shared_head.head.weight"], tensors["lm_head.weight"])
        assert torch.equal(tensors[p + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    for name, copy in exports.nextn_copies(out).items():
        original = target.lm_head.weight if "shared_head" in name else target.get_input_embeddings().weight
        assert torch.equal(copy, original.detach())
    assert (kind.KIND, "nextn") in [(k.name, f.name) for k in kinds().values() for f in k.formats if f.recognise(out)]
    loaded, loaded_record = kind.NEXTN.load(out)
    loaded = loaded.to(torch.float64).eval()
    for name, value in drafter.mtp.state_dict().items():
        assert torch.equal(loaded.mtp.state_dict()[name], value), name
    assert loaded_record.target == str(out) and loaded_record.draft_tokens == 2
    # the engine's forward, from the raw tensors: transformers itself loads layer N as a decoder layer (from one file
    # holding every tensor: given model.safetensors, transformers reads it alone and skips the MTP file)
    view = tmp_path / "engine_view"
    view.mkdir()
    (view / "config.json").write_text((out / "config.json").read_text())
    save_file(tensors, str(view / "model.safetensors"))
    engine = AutoModelForCausalLM.from_pretrained(
        view, num_hidden_layers=N + 2, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    block = engine.model.layers[N]
    p = f"model.layers.{N}."
    norm = type(engine.model.norm)

    def rms(x, weight):
        layer = norm(32, eps=target.config.rms_norm_eps).to(torch.float64)
        layer.weight.data.copy_(weight)
        return layer(x)

    with torch.no_grad():
        h = target(input_ids=IDS, output_hidden_states=True).hidden_states[-1][:, :-1]  # vLLM: the target's output
        positions = torch.arange(IDS.shape[1] - 1)[None]
        e = target.get_input_embeddings()(IDS[:, 1:])  # input ids shifted by one, the target's embedding
        e = torch.where(positions[..., None] == 0, 0.0, e)  # "masking inputs at position 0"
        x = F.linear(torch.cat([rms(e, tensors[p + "enorm.weight"]), rms(h, tensors[p + "hnorm.weight"])], -1),
                     tensors[p + "eh_proj.weight"])  # fmt: skip
        mask = create_causal_mask(engine.config, x, None, None, positions)
        o = block(
            x, attention_mask=mask, position_ids=positions, position_embeddings=engine.model.rotary_emb(x, positions)
        )
        expected = F.linear(rms(o, tensors[p + "shared_head.norm.weight"]), target.lm_head.weight)
    torch.testing.assert_close(module_logits(drafter, target), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(module_logits(loaded, target), expected, rtol=1e-6, atol=1e-6)
    # transformers loads the exported model and drops the MTP layers
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    torch.testing.assert_close(plain(IDS).logits, target(IDS).logits, rtol=0, atol=0)


def test_the_hidden_state_fed_to_module_one_is_checked_against_the_loader(tmp_path, one_thread):
    """The NextN engines feed the target's normed output: modules trained on the pre-norm state are refused, and
    the loader's forward of the same weights gives other logits than those modules compute."""
    target, folder = setup_target(tmp_path, "deepseek_v3", dense_block=True)
    prenorm, record = modules(target, folder, depth=1, trunk_hidden="before_norm")
    with pytest.raises(ValueError, match="served with trunk_hidden=after_norm.*trained with trunk_hidden=before_norm"):
        kind.NEXTN.write(prenorm, record, tmp_path / "refused")
    as_served = MTPDrafter(MTPConfig.for_trunk(target.config, 1)).to(torch.float64)
    as_served.mtp.load_state_dict(prenorm.mtp.state_dict())
    out = kind.NEXTN.write(as_served, record, tmp_path / "export")
    loaded = kind.NEXTN.load(out)[0].to(torch.float64).eval()
    decoder = target.get_decoder()
    captured = {}
    handle = decoder.norm.register_forward_pre_hook(lambda m, args: captured.setdefault("pre", args[0]))
    with torch.no_grad():
        decoder(input_ids=IDS)
        handle.remove()
        positions = torch.arange(IDS.shape[1] - 1)[None]
        own = prenorm.mtp.run(0, captured["pre"][:, :-1], target.get_input_embeddings()(IDS[:, 1:]), positions)
        own_logits = target.lm_head(prenorm.mtp.head_input(0, own))
    assert not torch.allclose(own_logits, module_logits(loaded, target), atol=1e-3)
    torch.testing.assert_close(module_logits(as_served, target), module_logits(loaded, target), rtol=1e-6, atol=1e-6)


def test_nextn_layer_at_another_index_is_refused(tmp_path, one_thread):
    target, folder = setup_target(tmp_path, "deepseek_v3", dense_block=True)
    drafter, record = modules(target, folder, depth=1)
    out = kind.NEXTN.write(drafter, record, tmp_path / "export")
    N = target.config.num_hidden_layers
    path = out / exports.MTP_WEIGHTS
    moved = {k.replace(f"model.layers.{N}.", f"model.layers.{N + 1}."): v for k, v in load_file(str(path)).items()}
    save_file(moved, str(path))
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {
        k.replace(f"model.layers.{N}.", f"model.layers.{N + 1}."): v for k, v in index["weight_map"].items()
    }
    index_file.write_text(json.dumps(index))
    message = rf"NextN layers stored at index \[{N + 1}\], but num_hidden_layers is {N}"
    with pytest.raises(ValueError, match=message):
        kind.NEXTN.load(out)
    with pytest.raises(ValueError, match=message):  # what refresh and extend read from a model checkpoint
        exports.load_model_modules(str(out))


def test_nextn_of_another_architecture_is_refused(tmp_path):
    target, folder = setup_target(tmp_path, "llama")
    drafter, record = modules(target, folder, depth=1, layout="nextn")
    with pytest.raises(ValueError, match="DeepSeek-V3-architecture models .*model_type 'llama'"):
        kind.NEXTN.write(drafter, record, tmp_path / "export")


@pytest.mark.parametrize("depth", [1, 2])
def test_qwen3_next_round_trip_and_engine_forward(depth, tmp_path, one_thread):
    target, folder = setup_target(tmp_path, "llama")
    drafter, record = modules(target, folder, depth=depth)
    first = drafter.mtp.layers[0]
    assert all(layer.eh_proj is first.eh_proj for layer in drafter.mtp.layers)  # the layout's one fc and norms
    out = kinds()["mtp"].format("mtp" if depth == 1 else "qwen3-next").write(drafter, record, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == depth and config["num_hidden_layers"] == 2
    tensors = load_file(str(out / exports.MTP_WEIGHTS))
    assert tensors["mtp.fc.weight"].shape == (32, 64)
    shared = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}
    assert shared <= set(tensors) and {k.split(".")[2] for k in tensors if k.startswith("mtp.layers.")} == {
        str(i) for i in range(depth)
    }
    assert not any(k.endswith(("embed_tokens.weight", "head.weight")) for k in tensors)  # the engine uses the target's
    loaded = kind.load_layout(out)[0].to(torch.float64).eval()
    for name, value in drafter.mtp.state_dict().items():
        assert torch.equal(loaded.mtp.state_dict()[name], value), name
    # vLLM's Qwen3NextMTP forward: fc(cat[norm_e(e), norm_h(h)]) -> layer -> mtp.norm -> lm_head; the normed output
    # is what the next step reads
    layer = type(first.block)(drafter.mtp.block_config, 2).to(torch.float64)
    layer.load_state_dict({k[len("mtp.layers.0.") :]: v for k, v in tensors.items() if k.startswith("mtp.layers.0.")})
    rms = type(target.model.norm)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = rms(32, eps=target.config.rms_norm_eps).to(torch.float64)
        norms[name].weight.data.copy_(tensors[f"mtp.{name}.weight"])
    with torch.no_grad():
        h = target(input_ids=IDS, output_hidden_states=True).hidden_states[-1][:, :-1]
        positions = torch.arange(IDS.shape[1] - 1)[None]
        e = target.get_input_embeddings()(IDS[:, 1:])
        x = F.linear(
            torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)], -1), tensors["mtp.fc.weight"]
        )
        mask = create_causal_mask(drafter.mtp.block_config, x, None, None, positions)
        o = norms["norm"](layer(x, attention_mask=mask, position_ids=positions,
                                position_embeddings=target.model.rotary_emb(x, positions)))  # fmt: skip
        expected = target.lm_head(o)
        handed = drafter.mtp.handoff(0, drafter.mtp.run(0, h, e, positions))
        torch.testing.assert_close(handed, o, rtol=1e-12, atol=1e-12)  # the next step reads the normed output
    torch.testing.assert_close(module_logits(loaded, target), expected, rtol=1e-10, atol=1e-10)
    if depth == 2:  # modules with their own fc cannot share the layout's one
        own = perturbed(MTPDrafter(replace(drafter.config, shared_input=False)).to(torch.float64))
        with pytest.raises(ValueError, match="module 1's eh_proj differs from module 0's"):
            kind.QWEN3_NEXT.write(own, record, tmp_path / "refused")
    assert exports.mtp_count_key("qwen3_5") == "mtp_num_hidden_layers"
    assert exports.mtp_count_key("qwen3_next") == "num_nextn_predict_layers"


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_the_model_without_its_modules_is_a_plain_hf_checkpoint(family, tmp_path, one_thread):
    target, folder = setup_target(tmp_path, family, dense_block=True)
    drafter, record = modules(target, folder, depth=2 if family == "deepseek_v3" else 1)
    with_modules = kind.MODEL.write(drafter, record, tmp_path / "with")
    plain = kind.HF.write(drafter, record, tmp_path / "plain")
    assert not (plain / exports.MTP_WEIGHTS).exists()
    model, info = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float64, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    torch.testing.assert_close(model.eval()(IDS).logits, target(IDS).logits, rtol=0, atol=0)
    assert json.loads((plain / "config.json").read_text()).get("num_nextn_predict_layers", 0) == 0
    # a refresh of the export replaces its modules: the trunk is copied without them
    again = kind.MODEL.write(
        drafter, kind.make_record(drafter.config, str(with_modules), [], False, None), tmp_path / "again"
    )
    assert (
        load_file(str(again / exports.MTP_WEIGHTS)).keys() == load_file(str(with_modules / exports.MTP_WEIGHTS)).keys()
    )
    assert not any(
        exports.is_mtp_tensor(k, target.config.num_hidden_layers) for k in load_file(str(again / "model.safetensors"))
    )
    with pytest.raises(ValueError, match="a plain HF checkpoint holds no MTP modules"):
        kind.HF.load(plain)


def test_a_pretraining_checkpoint_exports_its_own_trunk(tmp_path, one_thread):
    target = tiny_model("deepseek_v3", 0, vocab=96, layers=3)
    drafter = perturbed(MTPDrafter(MTPConfig.for_trunk(target.config, 1), trunk=target).to(torch.float64))
    record = kind.make_record(drafter.config, None, [], with_trunk=True, tokenizer=None)
    out = kind.MODEL.write(drafter, record, tmp_path / "export")
    for name, copy in exports.nextn_copies(out).items():
        original = target.lm_head.weight if "shared_head" in name else target.get_input_embeddings().weight
        assert torch.equal(copy, original.detach())
    loaded = kind.load_layout(out)[0].to(torch.float64)
    for name, value in drafter.mtp.state_dict().items():
        assert torch.equal(loaded.mtp.state_dict()[name], value), name
