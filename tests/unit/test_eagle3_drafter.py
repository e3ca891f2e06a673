"""The EAGLE-3 drafter: TTT attention against a naive mask, step 0 against a plain forward, every TTT step against
cached drafting as the proposer does it, and the reduced vocabulary against a naive count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trainer.methods.eagle3.module import (
    Eagle3Config,
    Eagle3Drafter,
    default_aux_layers,
    masked_attention,
    ttt_attention,
    ttt_mask,
)
from trainer.methods.eagle3.vocab_map import build_vocab_map, count_label_tokens


def small_config(
    vocab: int = 50, draft_vocab: int = 20, aux=(1, 2, 3), target_hidden: int = 12, **flags: bool
) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden, aux_layers=aux, **flags,
    )  # fmt: skip


def small_drafter(seed: int = 0, target_hidden: int = 12, **flags: bool) -> tuple[Eagle3Drafter, nn.Embedding]:
    """A random float64 drafter (norms too) with a vocabulary map, and an embedding; ``flags``: the norm options."""
    torch.manual_seed(seed)
    cfg = small_config(target_hidden=target_hidden, **flags)
    drafter = Eagle3Drafter(cfg).double()
    for p in drafter.parameters():  # non-trivial norms too
        nn.init.normal_(p, std=0.3)
    counts = torch.randint(0, 100, (cfg.vocab_size,))
    drafter.set_vocab_map(*build_vocab_map(counts, cfg.draft_vocab_size))
    return drafter, nn.Embedding(cfg.vocab_size, cfg.hidden_size).double()


def test_default_layers():
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(36) == (2, 18, 33)
    # shallow targets: distinct ids (engines refuse repeats), not (2, 2, 1)
    assert default_aux_layers(4) == (1, 2, 3)
    assert default_aux_layers(3) == (1, 2)
    assert default_aux_layers(1) == (1,)


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_attention_matches_naive_mask(step):
    torch.manual_seed(step)
    B, nh, nkv, S, D = 2, 4, 2, 7, 8
    q = torch.randn(B, nh, S, D, dtype=torch.float64)
    keys = [torch.randn(B, nkv, S, D, dtype=torch.float64) for _ in range(step + 1)]
    values = [torch.randn(B, nkv, S, D, dtype=torch.float64) for _ in range(step + 1)]
    # naive: every key of every step concatenated, with the mask written element by element
    allowed = torch.zeros(S, S * (step + 1), dtype=torch.bool)
    for t in range(S):
        for j in range(step + 1):
            for s in range(S):
                allowed[t, j * S + s] = (s <= t) if j == 0 else (s == t)
    assert torch.equal(ttt_mask(S, step), allowed)
    naive = masked_attention(q, torch.cat(keys, 2), torch.cat(values, 2), allowed)
    torch.testing.assert_close(ttt_attention(q, keys, values), naive)


def test_ttt_step0_is_a_plain_forward():
    drafter, embedding = small_drafter()
    B, S = 2, 9
    fused = torch.randn(B, S, 16, dtype=torch.float64)
    tokens = torch.randint(0, 50, (B, S))
    first = next(iter(drafter.unroll(embedding, fused, tokens, steps=3)))
    positions = torch.arange(S).expand(B, S)
    _, plain, _ = drafter(embedding(tokens), fused, positions)
    torch.testing.assert_close(first, plain)


ALL_FLAGS = {"norm_before_residual": True, "fc_norm": True, "norm_output": True}


@pytest.mark.parametrize("flags", [{}, ALL_FLAGS], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("data_tokens", [False, True])
def test_every_ttt_step_equals_cached_chain_drafting(data_tokens, flags):
    """Element t at step i of the unroll is exactly what chain drafting computes after committing 0..t (with the
    EAGLE-3.1 norm flags too: norm_output feeds the same post-norm feature in training and in drafting)."""
    drafter, embedding = small_drafter(1, **flags)
    B, S, K = 1, 8, 4
    fused = torch.randn(B, S, 16, dtype=torch.float64)
    stream = torch.randint(0, 50, (B, S + K + 1))
    tokens = stream[:, 1 : S + 1]
    unrolled = list(drafter.unroll(embedding, fused, tokens, K, stream if data_tokens else None))
    # RMSNorm computes in float32 (Llama's): with norm_output the fed-back features carry its rounding (~1e-7)
    tol = {"rtol": 1e-6, "atol": 1e-6} if flags else {}
    for t in range(S):
        pos = torch.arange(t + 1)[None]
        out, logits, past = drafter(embedding(tokens[:, : t + 1]), fused[:, : t + 1], pos)
        feat, logit = out[:, -1:], logits[:, -1]
        torch.testing.assert_close(unrolled[0][:, t], logit, **tol)
        for i in range(1, K):
            if data_tokens:
                token = stream[:, t + 1 + i]
            else:
                token = drafter.to_target_ids(logit.argmax(-1))
            feat, step_logits, (k, v) = drafter(embedding(token[:, None]), feat, torch.tensor([[t + i]]), past)
            past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
            logit = step_logits[:, -1]
            torch.testing.assert_close(unrolled[i][:, t], logit, **tol)


def test_vocab_map_counts_trained_labels_and_breaks_ties_by_id():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 30, size=(6, 11)).astype(np.int32)
    trained = rng.random((6, 11)) < 0.6
    counts = count_label_tokens([(ids[:3], trained[:3]), (ids[3:], trained[3:])], 30)
    naive = torch.zeros(30, dtype=torch.long)
    for r in range(6):
        for j in range(1, 11):  # token 0 of a row is never a label
            if trained[r, j]:
                naive[ids[r, j]] += 1
    assert torch.equal(counts, naive)
    d2t, t2d = build_vocab_map(counts, 12)
    ranked = sorted(range(30), key=lambda i: (-int(naive[i]), i))[:12]
    chosen = sorted(ranked)
    assert torch.equal(torch.arange(12) + d2t, torch.tensor(chosen))
    assert t2d.tolist() == [i in chosen for i in range(30)]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    # ties: equal counts keep the smaller ids; unseen tokens fill up by id
    d2t, _ = build_vocab_map(torch.tensor([0, 5, 5, 5, 0, 9]), 3)
    assert (torch.arange(3) + d2t).tolist() == [1, 2, 5]
    d2t, _ = build_vocab_map(torch.tensor([0, 5, 0, 0, 0, 9]), 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 5]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        count_label_tokens([(np.array([[1, 40]]), np.array([[True, True]]))], 30)


def test_ttt_flex_attention_matches_the_dense_one():
    """The flex path (CUDA's training path; here its uncompiled forward) applies the same TTT mask."""
    torch.manual_seed(0)
    B, nh, nkv, S, D = 1, 4, 2, 24, 8
    q = torch.randn(B, nh, S, D)
    keys = [torch.randn(B, nkv, S, D) for _ in range(3)]
    values = [torch.randn(B, nkv, S, D) for _ in range(3)]
    torch.testing.assert_close(
        ttt_attention(q, keys, values, "flex"), ttt_attention(q, keys, values, "dense"), rtol=1e-5, atol=1e-5
    )
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="attention: flex cannot train on cpu"):
        ttt_attention(q, keys, values, "flex")
