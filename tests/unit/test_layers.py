"""trainer/models/layers.py against the formulas written out: RMSNorm, the gated MLP and the key/value repeat; and the
parameter names the drafters' checkpoints hold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.layers import AttentionProjections, GatedMLP, RMSNorm, repeat_kv


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rms_norm_is_the_formula(dtype: torch.dtype):
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    nn.init.normal_(norm.weight)
    x = torch.randn(2, 3, 8, dtype=torch.float64).to(dtype)  # [B, S, H]
    x32 = x.float()
    expected = norm.weight * (x32 / torch.sqrt((x32**2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(norm(x), expected)
    assert list(norm.state_dict()) == ["weight"]


def test_repeat_kv_gives_each_query_head_its_groups_key():
    torch.manual_seed(0)
    kv = torch.randn(2, 3, 5, 4)  # [B, nkv, S, D]
    repeated = repeat_kv(kv, 4)  # [B, 12, S, D]
    assert repeated.shape == (2, 12, 5, 4)
    torch.testing.assert_close(repeated, torch.repeat_interleave(kv, 4, dim=1))
    for head in range(12):
        torch.testing.assert_close(repeated[:, head], kv[:, head // 4])
    assert repeat_kv(kv, 1) is kv


@pytest.mark.parametrize("act", [F.silu, nn.GELU()], ids=["silu", "gelu-module"])
def test_gated_mlp_is_the_formula(act):
    torch.manual_seed(0)
    mlp = GatedMLP(6, 10, act).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)  # [B, S, H]
    W = dict(mlp.named_parameters())
    expected = (act(x @ W["gate_proj.weight"].T) * (x @ W["up_proj.weight"].T)) @ W["down_proj.weight"].T
    torch.testing.assert_close(mlp(x), expected)
    # the checkpoint names of Llama-family MLPs, no biases, and the activation holds no weights
    assert {k: tuple(v.shape) for k, v in mlp.state_dict().items()} == {
        "gate_proj.weight": (10, 6),
        "up_proj.weight": (10, 6),
        "down_proj.weight": (6, 10),
    }


def test_default_activation_is_silu():
    torch.manual_seed(0)
    mlp = GatedMLP(4, 8)
    x = torch.randn(3, 4)
    torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))


@pytest.mark.parametrize("qk_norm_eps", [None, 1e-6])
def test_attention_projections_hold_the_checkpoint_names_and_shapes(qk_norm_eps):
    """EAGLE-3's (q/k/v from 2H, no head norms) and DFlash's (from H, Qwen3's q_norm and k_norm) attention weights."""
    attn = AttentionProjections(32, 16, heads=4, kv_heads=2, head_dim=8, qk_norm_eps=qk_norm_eps)
    shapes = {name: tuple(t.shape) for name, t in attn.state_dict().items()}
    expected = {
        "q_proj.weight": (32, 32),
        "k_proj.weight": (16, 32),
        "v_proj.weight": (16, 32),
        "o_proj.weight": (16, 32),
    }
    if qk_norm_eps is not None:
        expected |= {"q_norm.weight": (8,), "k_norm.weight": (8,)}
        assert attn.q_norm.eps == qk_norm_eps
    assert shapes == expected
    assert all(m.bias is None for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
