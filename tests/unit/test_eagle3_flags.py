"""EAGLE-3.1 norm flags (norm_before_residual, norm_before_fc, fc_norm, norm_output): the drafter against a naive
reference written from the formulas, every flag through both exports and back with identical logits, lossless
drafting, and refusals naming the flag (mismatched weights, native export, init_from)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.integration.test_eagle3_offline import tiny_llama
from tests.unit.test_eagle3_drafter import small_config, small_drafter
from trainer.export.files import WEIGHTS
from trainer.interface.errors import CheckpointError, ModelFolderError, RecipeError, UsageError
from trainer.methods.eagle3 import kind as eagle3_kind
from trainer.methods.eagle3 import records as eagle3_records
from trainer.methods.eagle3.export import load_native, load_speculators, save_native, save_speculators
from trainer.methods.eagle3.module import Eagle3Config, Eagle3Drafter
from trainer.methods.eagle3.objective import Eagle3
from trainer.methods.eagle3.vocab_map import build_vocab_map

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {
    "none": {},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "eagle3.1": {"fc_norm": True, "norm_output": True, "norm_before_residual": True},
}


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def naive_unroll(d: Eagle3Drafter, embedding, aux, tokens, data, steps: int, flags: dict) -> list[torch.Tensor]:
    """The TTT unroll written out element by element from the formulas (speculators 0.9 ``Eagle3DraftModel``):
    aux: [B, S, Ht] per layer; tokens: [B, S]; data: [B, S + steps + 1] -> ``steps`` x [B, S, Vd]."""
    c, p = d.config, dict(d.named_parameters())
    eps = c.rms_norm_eps
    if flags.get("fc_norm"):
        aux = [rms(h, p[f"fc_norm.{j}.weight"], eps) for j, h in enumerate(aux)]
    x = torch.cat(aux, -1)  # [B, S, n Ht]
    if flags.get("norm_before_fc"):
        x = rms(x, p["input_norm.weight"], eps)
    h = x @ p["fc.weight"].T  # [B, S, H]
    B, S, _ = h.shape
    nh, nkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    keys, values, out_logits = [], [], []
    for i in range(steps):
        e = embedding(tokens)  # [B, S, H]
        hn = rms(h, p["midlayer.hidden_norm.weight"], eps)
        xin = torch.cat([rms(e, p["midlayer.input_layernorm.weight"], eps), hn], -1)  # [B, S, 2H]
        q = (xin @ p["midlayer.self_attn.q_proj.weight"].T).view(B, S, nh, D).transpose(1, 2)
        k = (xin @ p["midlayer.self_attn.k_proj.weight"].T).view(B, S, nkv, D).transpose(1, 2)
        v = (xin @ p["midlayer.self_attn.v_proj.weight"].T).view(B, S, nkv, D).transpose(1, 2)
        cos, sin = d.rope(h, torch.arange(S).expand(B, S) + i)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k.repeat_interleave(nh // nkv, 1))
        values.append(v.repeat_interleave(nh // nkv, 1))
        attn = torch.zeros(B, nh, S, D, dtype=h.dtype)
        for t in range(S):  # step-0 keys 0..t, then the key at t of every later step
            ks = torch.cat([keys[0][:, :, : t + 1]] + [kk[:, :, t : t + 1] for kk in keys[1:]], 2)
            vs = torch.cat([values[0][:, :, : t + 1]] + [vv[:, :, t : t + 1] for vv in values[1:]], 2)
            w = torch.softmax((q[:, :, t : t + 1] @ ks.transpose(-1, -2)) / D**0.5, -1)  # [B, nh, 1, n]
            attn[:, :, t] = (w @ vs)[:, :, 0]
        residual = hn if flags.get("norm_before_residual") else h
        h1 = residual + attn.transpose(1, 2).reshape(B, S, nh * D) @ p["midlayer.self_attn.o_proj.weight"].T
        m = rms(h1, p["midlayer.post_attention_layernorm.weight"], eps)
        mlp = F.silu(m @ p["midlayer.mlp.gate_proj.weight"].T) * (m @ p["midlayer.mlp.up_proj.weight"].T)
        out = h1 + mlp @ p["midlayer.mlp.down_proj.weight"].T  # [B, S, H]
        normed = rms(out, p["norm.weight"], eps)
        out_logits.append(normed @ p["lm_head.weight"].T)  # [B, S, Vd]
        h = normed if flags.get("norm_output") else out
        tokens = data[:, i + 2 : i + 2 + S]
    return out_logits


def inputs(drafter: Eagle3Drafter, seed: int = 0, B: int = 2, S: int = 6, K: int = 3):
    g = torch.Generator().manual_seed(seed)
    width = drafter.config.target_hidden_size
    aux = [torch.randn(B, S, width, generator=g, dtype=torch.float64) * 3 for _ in drafter.config.aux_layers]
    data = torch.randint(0, drafter.config.vocab_size, (B, S + K + 1), generator=g)
    return aux, data[:, 1 : S + 1], data


def unrolled(drafter, embedding, seed: int = 0, K: int = 3) -> torch.Tensor:
    aux, tokens, data = inputs(drafter, seed, K=K)
    return torch.stack(list(drafter.unroll(embedding, drafter.fuse(aux), tokens, K, data)))  # [K, B, S, Vd]


@pytest.mark.parametrize("case", list(CASES))
def test_unroll_matches_the_naive_formulas(case):
    flags = CASES[case]
    drafter, embedding = small_drafter(2, **flags)
    aux, tokens, data = inputs(drafter)
    with torch.no_grad():
        ours = list(drafter.unroll(embedding, drafter.fuse(aux), tokens, 3, data))
        naive = naive_unroll(drafter, embedding, aux, tokens, data, 3, flags)
        plain = naive_unroll(drafter, embedding, aux, tokens, data, 3, {})
    for i in range(3):
        # RMSNorm runs in float32 (Llama's), the reference in float64: differences ~1e-7 on logits of size ~10
        torch.testing.assert_close(ours[i], naive[i], rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"step {i}: {m}")
    if flags and flags != {"norm_output": True}:
        assert not torch.allclose(ours[0], plain[0])  # the flag changes step 0
    if flags:
        assert not torch.allclose(ours[2], plain[2])  # and the later steps


def test_flags_are_checked_and_default_off():
    assert small_config().flags() == dict.fromkeys(CASES["eagle3.1"] | {"norm_before_fc": 0}, False)
    with pytest.raises(ValueError, match="mutually exclusive"):
        small_config(norm_before_fc=True, fc_norm=True)
    old = small_config().to_dict()
    for flag in small_config().flags():
        old.pop(flag)  # a record written before the flags existed
    assert Eagle3Config(**old).flags() == small_config().flags()


def test_greedy_drafting_with_the_flags_is_lossless():
    from tests.unit.test_eagle3_proposer import target_and_drafter
    from trainer.decoding.generate import speculative_generate
    from trainer.decoding.proposers import NoProposer
    from trainer.methods.eagle3.proposer import Eagle3Proposer

    target, plain = target_and_drafter(0)
    config = Eagle3Config(**{**plain.config.to_dict(), **CASES["eagle3.1"]})
    drafter = Eagle3Drafter(config).double()
    drafter.set_vocab_map(plain.d2t, plain.t2d)
    prompt = torch.randint(0, 96, (12,))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=16)
    spec = speculative_generate(target, prompt, Eagle3Proposer(drafter, target.get_input_embeddings()), k=3,
                                max_new_tokens=16)  # fmt: skip
    assert spec.tokens == alone.tokens


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", ["native", "speculators"])
def test_export_and_reload_keep_the_flags_and_the_logits(case, fmt, tmp_path):
    flags = CASES[case]
    drafter, embedding = small_drafter(3, target_hidden=16, **flags)
    if fmt == "native":
        if flags.get("fc_norm") or flags.get("norm_output"):
            name = "fc_norm" if flags.get("fc_norm") else "norm_output"
            with pytest.raises(UsageError, match=f"cannot express {name}"):
                save_native(drafter, str(tmp_path))
            return
        save_native(drafter, str(tmp_path))
        reloaded = load_native(str(tmp_path))
    else:
        save_speculators(drafter, str(tmp_path), verifier="some/target", embedding=embedding.weight,
                         speculative_tokens=3)  # fmt: skip
        reloaded = load_speculators(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    names = set(load_file(str(tmp_path / WEIGHTS)))
    written = ("norm_before_residual", "norm_before_fc") if fmt == "native" else tuple(drafter.config.flags())
    assert {f: config[f] for f in written} == {f: drafter.config.flags()[f] for f in written}
    assert ("input_norm.weight" in names) == bool(flags.get("norm_before_fc"))
    assert ({"fc_norm.0.weight", "fc_norm.2.weight"} <= names) == bool(flags.get("fc_norm"))
    assert reloaded.config.flags() == drafter.config.flags()
    with torch.no_grad():
        torch.testing.assert_close(unrolled(reloaded.double(), embedding), unrolled(drafter, embedding), rtol=0, atol=0)


@pytest.mark.parametrize("tamper", ["weights_missing", "flag_dropped", "bad_value", "both"])
def test_exports_whose_weights_disagree_with_the_flags_are_refused(tamper, tmp_path):
    drafter, embedding = small_drafter(4, target_hidden=16, fc_norm=True)
    save_speculators(drafter, str(tmp_path), verifier="t", embedding=embedding.weight, speculative_tokens=3)
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(str(tmp_path / WEIGHTS))
    if tamper == "weights_missing":
        del tensors["fc_norm.1.weight"]
        message = r"fc_norm is true but the weights lack \['fc_norm.1.weight'\]"
    elif tamper == "flag_dropped":
        config["fc_norm"] = False
        message = "fc_norm is false but the weights hold"
    elif tamper == "bad_value":
        config["norm_output"] = "yes"
        message = "norm_output must be true or false"
    else:
        config["norm_before_fc"] = True
        message = "mutually exclusive"
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / WEIGHTS))
    with pytest.raises(ModelFolderError, match=message):
        load_speculators(str(tmp_path))


def test_checkpoint_weights_that_disagree_with_the_recorded_flags_are_refused():
    drafter, _ = small_drafter(5, norm_before_fc=True)
    record = eagle3_kind.make_record(drafter.config, "t", [], 3)
    state = {"drafter." + k: v for k, v in drafter.state_dict().items()}
    eagle3_records.load_weights(eagle3_kind.build(record), record, dict(state), "x.ckpt")  # agrees: loads
    del state["drafter.input_norm.weight"]
    with pytest.raises(CheckpointError, match=r"x.ckpt: .*norm_before_fc is true but the weights lack"):
        eagle3_records.load_weights(eagle3_kind.build(record), record, state, "x.ckpt")
    plain = eagle3_kind.make_record(small_config(), "t", [], 3)
    state = {"drafter." + k: v for k, v in drafter.state_dict().items()}
    with pytest.raises(CheckpointError, match="norm_before_fc is false but the weights hold"):
        eagle3_records.load_weights(eagle3_kind.build(plain), plain, state, "x.ckpt")


def test_objective_flags_and_init_from_mismatch(tmp_path):
    target = tiny_llama(tmp_path / "target", tied=False)
    with pytest.raises(RecipeError, match="model.norm_before_fc and model.fc_norm are mutually exclusive"):
        Eagle3(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], norm_before_fc=True,
               fc_norm=True)  # fmt: skip
    objective = Eagle3(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], fc_norm=True,
                       norm_output=True)  # fmt: skip
    assert objective.drafter.config.flags() == {**dict.fromkeys(CASES["eagle3.1"], False), "norm_before_fc": False,
                                                "fc_norm": True, "norm_output": True}  # fmt: skip
    trained = Eagle3Drafter(Eagle3Config.from_target(target.config, 32, [0, 1, 2], norm_before_fc=True))
    trained.set_vocab_map(*build_vocab_map(torch.arange(64), 32))
    save_native(trained, str(tmp_path / "export"))
    with pytest.raises(RecipeError, match="model.norm_before_fc is false but model.init_from .* norm_before_fc: true"):
        Eagle3(str(tmp_path / "target"), draft_vocab_size=32, init_from=str(tmp_path / "export"))
    again = Eagle3(str(tmp_path / "target"), draft_vocab_size=32, init_from=str(tmp_path / "export"),
                   norm_before_fc=True)  # fmt: skip
    assert again.drafter.config.norm_before_fc
