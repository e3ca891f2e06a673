"""DFlash's slot loss (trainer/methods/dflash/slot_loss.py), gradients taken in forward, against autograd through the
plain formulas: token cross entropy, KL to a dense or a sparse target distribution, with and without the Markov bias,
chunked or not, the acceptance rates of DSpark's confidence head, and D-PACE's loss-dependent weights."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.methods.dflash.slot_loss import ChunkLabels, block_chunks, block_dpace_weights, slot_loss

N, H, V, R, K = 11, 8, 23, 4, 5


def _inputs(markov: bool, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    head = torch.randn(V, H, generator=g, dtype=dtype)
    weights = torch.rand(N, generator=g, dtype=dtype)
    emb = torch.randn(N, R, generator=g, dtype=dtype, requires_grad=True) if markov else None
    w2 = torch.randn(V, R, generator=g, dtype=dtype, requires_grad=True) if markov else None
    tokens = torch.randint(0, V, (N,), generator=g)
    probs = torch.softmax(torch.randn(N, V, generator=g, dtype=dtype) * 2, dim=-1)
    top = torch.randn(N, V, generator=g).topk(K, dim=-1).indices  # [N, K] distinct ids
    sparse_p = torch.softmax(torch.randn(N, K, generator=g, dtype=dtype), dim=-1)
    return hidden, head, weights, emb, w2, tokens, probs, (top, sparse_p)


def _reference(hidden, head, weights, emb, w2, labels: ChunkLabels):
    """Losses [n], right-argmax flags and acceptance rates by the formulas, through autograd."""
    logits = hidden @ head.t() + (emb @ w2.t() if emb is not None else 0.0)  # [N, V]
    log_q = torch.log_softmax(logits, dim=-1)
    guess = logits.argmax(-1)
    q = log_q.exp()
    if labels.ids is not None:
        loss, hits = -log_q[torch.arange(N), labels.ids], guess == labels.ids
    elif labels.probs is not None:
        p = labels.probs
        loss, hits = (p * (p.log() - log_q)).sum(-1), guess == p.argmax(-1)
    else:
        ids, p = labels.sparse
        loss, hits = (p * (p.log() - log_q.gather(-1, ids))).sum(-1), guess == ids[:, 0]
    if labels.sparse is not None:
        accept = torch.minimum(q.gather(-1, labels.sparse[0]), labels.sparse[1]).sum(-1)
    elif labels.probs is not None:
        accept = torch.minimum(q, labels.probs).sum(-1)
    else:
        accept = None
    return (loss * weights).sum(), loss, hits, accept


@pytest.mark.parametrize("markov", [False, True])
@pytest.mark.parametrize("kind", ["ids", "probs", "sparse", "ids+probs", "ids+sparse"])
@pytest.mark.parametrize("chunk", [3, 64])
def test_the_loss_and_its_gradients_equal_autograd_through_the_formulas(markov, kind, chunk):
    hidden, head, weights, emb, w2, tokens, probs, sparse = _inputs(markov)
    want_accept = "+" in kind or kind != "ids"
    full = ChunkLabels(
        ids=tokens if kind.startswith("ids") else None,
        probs=probs if "probs" in kind else None,
        sparse=sparse if "sparse" in kind else None,
        want_accept=want_accept,
    )

    def labels(part: slice) -> ChunkLabels:
        sp = None if full.sparse is None else (full.sparse[0][part], full.sparse[1][part])
        ids = None if full.ids is None else full.ids[part]
        probs_part = None if full.probs is None else full.probs[part]
        return ChunkLabels(ids=ids, probs=probs_part, sparse=sp, want_accept=want_accept)

    total, loss, hits, accept = slot_loss(hidden, head, weights, labels, chunk, emb, w2)
    ref_total, ref_loss, ref_hits, ref_accept = _reference(hidden, head, weights, emb, w2, full)
    torch.testing.assert_close(total.double(), ref_total, rtol=1e-5, atol=1e-6)  # float32 inside
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(hits, ref_hits)
    if ref_accept is None:
        assert accept.numel() == 0
    else:
        torch.testing.assert_close(accept.double(), ref_accept.detach(), rtol=1e-5, atol=1e-6)
    inputs = [hidden] + ([emb, w2] if markov else [])
    grads = torch.autograd.grad(total * 3.0, inputs)  # an upstream gradient other than 1
    ref_grads = torch.autograd.grad(ref_total * 3.0, inputs)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_slot_gives_a_zero_loss_that_backpropagates():
    hidden = torch.randn(0, H, requires_grad=True)
    total, loss, hits, accept = slot_loss(hidden, torch.randn(V, H), torch.ones(0), lambda p: ChunkLabels(), 4)
    total.backward()
    assert float(total.detach()) == 0.0 and loss.numel() == hits.numel() == accept.numel() == 0
    assert hidden.grad is not None and hidden.grad.shape == (0, H)


def test_bfloat16_slots_get_bfloat16_gradients_close_to_float32():
    hidden, head, weights, _, _, tokens, _, _ = _inputs(False, torch.float32)
    half = hidden.detach().bfloat16().requires_grad_()
    labels = lambda part: ChunkLabels(ids=tokens[part])  # noqa: E731
    total, *_ = slot_loss(half, head.bfloat16(), weights, labels, 4)
    total.backward()
    ref, *_ = slot_loss(half.detach().float().requires_grad_(), head.bfloat16().float(), weights, labels, 4)
    assert half.grad.dtype == torch.bfloat16
    torch.testing.assert_close(total, ref, rtol=2e-2, atol=2e-2)


def _naive_dpace(losses: list[float], blocks: list[int], slots: list[int], alpha: float) -> list[float]:
    """Slot k of a block: the sum over the block's trained slots j >= k of the product over its trained i <= j of
    (1 - alpha) exp(-loss_i) + alpha, one slot at a time."""
    out = []
    for b, k in zip(blocks, slots, strict=True):
        mine = [(s, loss) for bb, s, loss in zip(blocks, slots, losses, strict=True) if bb == b]
        conf = {s: (1 - alpha) * math.exp(-loss) + alpha for s, loss in mine}
        out.append(sum(math.prod(conf[i] for i in conf if i <= j) for j in conf if j >= k))
    return out


def test_block_dpace_weights_equal_the_naive_sums_of_products_and_chunks_keep_whole_blocks():
    g = torch.Generator().manual_seed(3)
    blocks = [0, 0, 0, 2, 2, 5, 5, 5, 5, 6]  # block 2 lacks slot 1, block 6 has only its last slot
    slots = [0, 1, 2, 0, 2, 0, 1, 2, 3, 3]
    losses = torch.rand(len(blocks), generator=g, dtype=torch.float64) * 3
    block, slot = torch.tensor(blocks), torch.tensor(slots)
    got = block_dpace_weights(losses, block, slot, 0.5)
    torch.testing.assert_close(got.double(), torch.tensor(_naive_dpace(losses.tolist(), blocks, slots, 0.5)).double())
    # one block's weights do not depend on another's losses
    moved = losses.clone()
    moved[5:9] += 1.0
    assert torch.equal(block_dpace_weights(moved, block, slot, 0.5)[:5], got[:5])
    for size in (1, 2, 4, 100):
        chunks = block_chunks(block, size)
        assert chunks[0].start == 0 and chunks[-1].stop == len(blocks)
        assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))  # consecutive
        for c in chunks:
            assert c.stop == len(blocks) or blocks[c.stop] != blocks[c.stop - 1]  # never inside a block
            assert c.stop - c.start >= size or c.stop == len(blocks)  # at least the size, but the last


@pytest.mark.parametrize("markov", [False, True])
def test_loss_dependent_weights_give_autograd_through_the_formulas_with_those_weights_held_constant(markov):
    hidden, head, _, emb, w2, tokens, _, _ = _inputs(markov)
    block = torch.tensor([0, 0, 0, 1, 1, 3, 3, 3, 4, 4, 4])  # N slots
    slot = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 2])

    def weigh(part: slice, losses: torch.Tensor) -> torch.Tensor:
        return block_dpace_weights(losses, block[part], slot[part], 0.3)

    def labels(part: slice) -> ChunkLabels:
        return ChunkLabels(ids=tokens[part])

    total, loss, *_ = slot_loss(hidden, head, weigh, labels, block_chunks(block, 4), emb, w2)
    _, ref_loss, _, _ = _reference(hidden, head, torch.ones(N, dtype=hidden.dtype), emb, w2, ChunkLabels(ids=tokens))
    weights = block_dpace_weights(ref_loss.detach(), block, slot, 0.3).double()  # constants
    ref_total = (ref_loss * weights).sum()
    torch.testing.assert_close(total.double(), ref_total, rtol=1e-5, atol=1e-6)
    inputs = [hidden] + ([emb, w2] if markov else [])
    got = torch.autograd.grad(total, inputs)
    want = torch.autograd.grad(ref_total, inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)
