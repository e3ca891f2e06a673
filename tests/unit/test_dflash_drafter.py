"""The DFlash drafter: the anchored block-sparse attention against the mask written out (dense and flex), every block
of the training pass against drafting that block alone with a cached context (as the proposer does), the default
target layers, the mask-token rules and the config's refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter, check_mask_token, default_target_layers
from trainer.models.block_attention import anchored_block_attention, anchored_block_mask


def small_config(**overrides) -> DFlashConfig:
    settings = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=50, target_layers=(1, 3), num_target_layers=4, block_size=4, mask_token_id=49,
    )  # fmt: skip
    settings.update(overrides)
    return DFlashConfig(**settings)


def small_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(small_config(**overrides))
    for p in drafter.parameters():  # non-trivial norms too
        nn.init.normal_(p, std=0.3)
    return drafter


def test_default_target_layers_follow_zlab_and_stay_readable_on_shallow_targets():
    # z-lab's rule in its ids round(1 + i (L - 4) / (m - 1)) (Qwen3-8B: 1, 9, 17, 25, 33), as HF indices (+1)
    assert default_target_layers(36, 5) == (2, 10, 18, 26, 34)
    assert default_target_layers(32, 5) == (2, 9, 16, 23, 30)
    assert default_target_layers(36, 1) == (19,)  # L // 2 for one layer
    # too shallow for the rule: distinct layers over the outputs of layers 0..L-2 (never the last one)
    assert default_target_layers(7, 5) == (1, 2, 3, 5, 6)
    assert default_target_layers(4, 5) == (1, 2, 3)
    assert default_target_layers(2, 5) == (1,) == default_target_layers(2, 1)
    with pytest.raises(ValueError, match="1 layers has no intermediate layer output"):
        default_target_layers(1, 5)


@pytest.mark.parametrize("groups", [1, 2])
def test_anchored_attention_matches_the_written_mask(groups):
    torch.manual_seed(groups)
    B, nkv, S, N, b, D = 2, 2, 20, 3, 4, 8
    nh = nkv * groups
    q = torch.randn(B, nh, N * b, D, dtype=torch.float64)
    k_ctx, v_ctx = torch.randn(B, nkv, S, D, dtype=torch.float64), torch.randn(B, nkv, S, D, dtype=torch.float64)
    k_blk, v_blk = (
        torch.randn(B, nkv, N * b, D, dtype=torch.float64),
        torch.randn(B, nkv, N * b, D, dtype=torch.float64),
    )
    anchors = torch.tensor([[0, 7, 19], [3, 3, 12]])  # an empty context, a repeated anchor, the row's last position
    # the mask element by element: block j sees context c < a_j and its own b slots
    allowed = torch.zeros(B, N * b, S + N * b, dtype=torch.bool)
    for r in range(B):
        for j in range(N):
            for s in range(b):
                allowed[r, j * b + s, : int(anchors[r, j])] = True
                allowed[r, j * b + s, S + j * b : S + (j + 1) * b] = True
    assert torch.equal(anchored_block_mask(anchors, S, b), allowed)
    keys = torch.cat([k_ctx, k_blk], 2).repeat_interleave(groups, 1)
    values = torch.cat([v_ctx, v_blk], 2).repeat_interleave(groups, 1)
    naive = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None])
    dense = anchored_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, b, "dense")
    torch.testing.assert_close(dense, naive, rtol=1e-12, atol=1e-12)
    if groups == 2:  # flex (CUDA's path; here its uncompiled forward) applies the same mask
        args = [t.float() for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
        flex = anchored_block_attention(*args, anchors, b, "flex")
        torch.testing.assert_close(flex.double(), naive, rtol=1e-5, atol=1e-5)
        args[0].requires_grad_(True)
        with pytest.raises(ValueError, match="attention: flex cannot train on cpu"):
            anchored_block_attention(*args, anchors, b, "flex")


def test_training_blocks_equal_drafting_each_block_alone():
    """Slot s of block j in the one-pass training forward is what the proposer computes for a block at anchor a_j
    after caching the context of positions 0..a_j-1: positions, context visibility and rotary offsets agree."""
    drafter = small_drafter()
    embedding = nn.Embedding(50, 16)
    B, S, b = 2, 12, 4
    hidden = [torch.randn(B, S, 16) for _ in range(2)]
    context = drafter.context(hidden)  # [B, S, H]
    ids = torch.randint(0, 48, (B, S))
    anchors = torch.tensor([[0, 5, 10], [1, 3, 11]])  # blocks past the row's end are drafted all the same
    block_ids = drafter.block_ids(ids.gather(1, anchors))  # [B, N * b]
    blocks = block_ids.view(B, 3, b)
    assert blocks[:, :, 1:].eq(49).all() and torch.equal(blocks[:, :, 0], ids.gather(1, anchors))
    with torch.no_grad():
        out = drafter.train_blocks(context, embedding(block_ids), anchors, "dense")  # [B, N * b, H]
        for r in range(B):
            for j in range(3):
                a = int(anchors[r, j])
                past = drafter.context_kv(context[r : r + 1, :a], torch.arange(a)[None])
                block = block_ids[r : r + 1, j * b : (j + 1) * b]
                alone = drafter.draft(embedding(block), torch.arange(a, a + b)[None], past)  # [1, b, H]
                torch.testing.assert_close(out[r : r + 1, j * b : (j + 1) * b], alone, rtol=1e-5, atol=1e-5)
    # and the context matters: another anchor (a different visible prefix) gives other outputs
    with torch.no_grad():
        moved = drafter.train_blocks(context, embedding(block_ids), anchors + 1, "dense")
    assert not torch.allclose(moved, out, atol=1e-4)


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="block_size=1: a block needs the anchor and at least one mask slot"):
        small_config(block_size=1)
    with pytest.raises(ValueError, match=r"target_layers=\[1, 4\]: \[4\] outside .* hidden_states 1..3"):
        small_config(target_layers=(1, 4))
    with pytest.raises(ValueError, match=r"target_layers=\[0, 2\]: \[0\] outside"):
        small_config(target_layers=(0, 2))
    with pytest.raises(ValueError, match=r"target_layers=\[2, 2\] repeats a layer"):
        small_config(target_layers=(2, 2))
    with pytest.raises(ValueError, match="mask_token_id=50 is outside the target's 50 embedding rows"):
        small_config(mask_token_id=50)


def test_mask_token_rules(tok):
    n = len(tok)
    assert check_mask_token(None, tok, n + 8) == n  # the first row past the tokenizer (the reference trainer's)
    assert check_mask_token(n + 3, tok, n + 8) == n + 3
    with pytest.raises(ValueError, match=r"no row past its tokenizer's 512 tokens: .*candidates: 2 '<\|system\|>'"):
        check_mask_token(None, tok, n)
    with pytest.raises(ValueError, match=r"mask_token_id=0 is the tokenizer's bos token: the tokenizer uses it"):
        check_mask_token(tok.eos_token_id, tok, n)
    with pytest.raises(ValueError, match=r"mask_token_id=1 is the tokenizer's pad token"):
        check_mask_token(tok.pad_token_id, tok, n)
    with pytest.raises(ValueError, match=r"mask_token_id=300 is the token '.*', which the tokenizer uses"):
        check_mask_token(300, tok, n)
    with pytest.raises(ValueError, match=r"mask_token_id=600 is outside the target's 520 embedding rows"):
        check_mask_token(600, tok, n + 8)
    assert check_mask_token(2, tok, n) == 2  # a special token without a role (the data is checked by the objective)
    with pytest.raises(ValueError, match="model.mask_token_id is not set and the target has no tokenizer"):
        check_mask_token(None, None, n)
