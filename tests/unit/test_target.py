"""The frozen target: never trained, hidden states in HF's indexing, a KV cache that decodes like a full forward."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers import SCALED_FAMILIES, tiny_scaled_model
from trainer.models.target import FrozenTarget


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return FrozenTarget(LlamaForCausalLM(config).double())


def test_frozen_and_in_eval_mode_whatever_the_parent_does(target):
    parent = torch.nn.ModuleDict({"target": target})
    parent.train()
    assert not target.model.training and all(not p.requires_grad for p in target.parameters())
    out = target(torch.randint(0, 64, (2, 5)))
    assert not out.logits.requires_grad


def test_hidden_states_follow_hf_indexing(target):
    ids = torch.randint(0, 64, (2, 7))
    out = target(ids, hidden_layers=(0, 2, 3))
    reference = target.model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden_states[0], target.model.get_input_embeddings()(ids))
    torch.testing.assert_close(out.hidden_states[1], reference[2])
    torch.testing.assert_close(out.hidden_states[2], reference[3])
    torch.testing.assert_close(target.lm_head_weight @ out.hidden_states[2][0, -1], out.logits[0, -1])
    torch.testing.assert_close(target.final_hidden(ids), reference[3])
    with pytest.raises(ValueError, match="out of range"):
        target(ids, hidden_layers=(4,))


@pytest.mark.parametrize("name", SCALED_FAMILIES)
def test_projecting_the_final_hidden_state_gives_the_forwards_logits(name):
    """Hidden states without logits (``logits=False``), then ``project`` over every row or a subset of rows: the
    target's own logits, its output scaling included (what EAGLE-3's soft labels rely on)."""
    target = FrozenTarget(tiny_scaled_model(name))
    ids = torch.randint(0, 64, (2, 7))
    full = target(ids).logits  # [B, S, V]
    out = target(ids, hidden_layers=[target.num_layers], logits=False)
    assert out.logits is None
    (final,) = out.hidden_states
    torch.testing.assert_close(target.project(final), full)
    rows = torch.tensor([3, 17, 40, 63])
    torch.testing.assert_close(target.project(final, rows), full[..., rows])
    unscaled = final @ target.lm_head_weight.T  # [B, S, V]
    assert (name == "llama") == torch.allclose(unscaled, full)


def test_kv_cache_decoding_matches_a_full_forward(target):
    ids = torch.randint(0, 64, (1, 9))
    full = target(ids).logits  # [1, 9, V]
    prefix = target(ids[:, :6], use_cache=True)
    step = target(ids[:, 6:], cache=prefix.cache, use_cache=True)
    torch.testing.assert_close(step.logits, full[:, 6:])


def test_missing_local_target_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        FrozenTarget.from_pretrained(str(tmp_path / "empty"))
