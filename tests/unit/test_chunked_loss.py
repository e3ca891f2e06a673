"""The chunked-loss engine (trainer/losses/chunked.py) against autograd through the naive formulas in float64: the whole
[n, V] logits built at once, each row's loss written out plainly, weighted and summed. Values and gradients, with and
without weights (given, or from the rows' losses), token labels, dense, log-space and top-k distributions, ignored
rows, several chunkings, two terms and a term that is the logits themselves, the output scaling, and losses over a
reduced draft vocabulary (total variation and -log acceptance against a target over the whole vocabulary)."""

from __future__ import annotations

import pytest
import torch

from trainer.losses.chunked import (
    Target,
    Term,
    autograd_rows,
    chunked_loss,
    chunked_loss_with_grads,
    cross_entropy_rows,
)
from trainer.models.logit_scaling import LogitScaling

N, D, V, R, K = 13, 6, 17, 3, 4


def _inputs(dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    extra = torch.randn(N, R, generator=g, dtype=dtype, requires_grad=True)  # a second term (DSpark's Markov bias)
    extra_weight = torch.randn(V, R, generator=g, dtype=dtype, requires_grad=True)
    weights = torch.rand(N, generator=g, dtype=dtype)
    ids = torch.randint(0, V, (N,), generator=g)
    probs = torch.softmax(2 * torch.randn(N, V, generator=g, dtype=dtype), dim=-1)
    probs[0, 3] = 0.0  # a zero probability: its term counts 0
    probs[0] /= probs[0].sum()
    top = torch.randn(N, V, generator=g).topk(K, dim=-1).indices  # [N, K] distinct ids
    top_p = torch.softmax(torch.randn(N, K, generator=g, dtype=dtype), dim=-1)
    return rows, weight, extra, extra_weight, weights, ids, probs, (top, top_p)


def _naive_rows(logits: torch.Tensor, kind: str, ids, probs, sparse) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's loss [n] (and its acceptance rate [n]) written out plainly on the full logits [n, V]."""
    q = torch.softmax(logits, dim=-1)
    if kind == "ids":
        return -torch.log(q[torch.arange(len(ids)), ids]), None
    if kind in ("probs", "log_probs"):
        p = probs
        kl = torch.where(p > 0, p * (torch.log(p) - torch.log(q)), torch.zeros_like(p)).sum(-1)
        return kl, torch.minimum(q, p).sum(-1)
    top, p = sparse
    return (p * (torch.log(p) - torch.log(q.gather(-1, top)))).sum(-1), torch.minimum(q.gather(-1, top), p).sum(-1)


def _target(kind: str, ids, probs, sparse, part, acceptance: bool = False) -> Target:
    if kind == "ids":
        return Target(ids=ids[part])
    if kind == "probs":
        return Target(probs=probs[part], acceptance=acceptance)
    if kind == "log_probs":
        return Target(log_probs=torch.log(probs[part]), acceptance=acceptance)
    return Target(sparse=(sparse[0][part], sparse[1][part]), acceptance=acceptance)


@pytest.mark.parametrize("kind", ["ids", "probs", "log_probs", "sparse"])
@pytest.mark.parametrize("chunks", [1, 4, None, "uneven"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("two_terms", [False, True])
def test_cross_entropy_rows_equal_autograd_through_the_naive_formulas(kind, chunks, weighted, two_terms):
    rows, weight, extra, extra_weight, weights, ids, probs, sparse = _inputs()
    if not weighted:
        weights = torch.ones(N, dtype=torch.float64)
    index = torch.tensor([0, 2, 3, 4, 7, 8, 9, 12])  # rows 1, 5, 6, 10, 11 are ignored
    n = index.numel()
    sel_ids, sel_probs = ids[index], probs[index]
    sel_sparse = (sparse[0][index], sparse[1][index])
    parts = [slice(0, 3), slice(3, 4), slice(4, n)] if chunks == "uneven" else chunks
    terms = [Term(rows, weight)] + ([Term(extra, extra_weight)] if two_terms else [])
    acceptance = kind != "ids"

    def targets(part: slice) -> Target:
        return _target(kind, sel_ids, sel_probs, sel_sparse, part, acceptance)

    out = chunked_loss(terms, cross_entropy_rows, targets, weights[index], index=index, chunks=parts)
    logits = rows @ weight.t() + (extra @ extra_weight.t() if two_terms else 0.0)  # [N, V]
    want_rows, want_accept = _naive_rows(logits[index], kind, sel_ids, sel_probs, sel_sparse)
    want = (want_rows * weights[index]).sum()
    torch.testing.assert_close(out.total, want)
    torch.testing.assert_close(out.losses, want_rows.detach())
    if acceptance:
        torch.testing.assert_close(out.stats[0], want_accept.detach())
    else:
        assert out.stats == ()
    inputs = [rows, weight] + ([extra, extra_weight] if two_terms else [])
    got = torch.autograd.grad(out.total * 3.0, inputs)  # an upstream gradient other than 1
    expected = torch.autograd.grad(want * 3.0, inputs)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)
    assert float(got[0][1].abs().sum()) == 0.0  # an ignored row gets no gradient


@pytest.mark.parametrize("scaling", [LogitScaling(multiplier=0.6), LogitScaling(multiplier=1.3, softcap=4.0)])
@pytest.mark.parametrize("kind", ["ids", "probs"])
def test_the_output_scaling_is_differentiated_through(scaling, kind):
    rows, weight, _, _, weights, ids, probs, sparse = _inputs()
    out = chunked_loss(
        [Term(rows, weight)], cross_entropy_rows, lambda part: _target(kind, ids, probs, sparse, part), weights,
        chunks=5, scaling=scaling,
    )  # fmt: skip
    want_rows, _ = _naive_rows(scaling(rows @ weight.t()), kind, ids, probs, sparse)
    want = (want_rows * weights).sum()
    torch.testing.assert_close(out.total, want)
    for a, b in zip(torch.autograd.grad(out.total, [rows, weight]), torch.autograd.grad(want, [rows, weight])):
        torch.testing.assert_close(a, b)


def _divergences(logits: torch.Tensor, target: tuple[torch.Tensor, str]) -> tuple[torch.Tensor, tuple]:
    """Per-row reverse KL, JSD (beta 0.5), total variation or -log acceptance, with the acceptance as a statistic."""
    p, which = target
    log_q = torch.log_softmax(logits, dim=-1)
    q = log_q.exp()
    accept = torch.minimum(q, p).sum(-1)
    if which == "reverse_kl":
        loss = (q * (log_q - torch.log(p))).sum(-1)
    elif which == "jsd":
        m = 0.5 * (p + q)
        loss = 0.5 * (p * torch.log(p / m)).sum(-1) + 0.5 * (q * (log_q - torch.log(m))).sum(-1)
    elif which == "tv":
        loss = 0.5 * (q - p).abs().sum(-1)
    else:
        loss = -torch.log(accept)
    return loss, (accept,)


@pytest.mark.parametrize("which", ["reverse_kl", "jsd", "tv", "neg_log_accept"])
@pytest.mark.parametrize("chunks", [2, None])
def test_a_loss_through_autograd_rows_equals_autograd_on_the_whole_logits(which, chunks):
    rows, weight, _, _, weights, _, probs, _ = _inputs()
    probs = torch.softmax(torch.log(probs + 1e-3), dim=-1)  # no zero (the reverse KL's log p)
    out = chunked_loss(
        [Term(rows, weight)], autograd_rows(_divergences), lambda part: (probs[part], which), weights, chunks=chunks
    )
    want_rows, (want_accept,) = _divergences(rows @ weight.t(), (probs, which))
    want = (want_rows * weights).sum()
    torch.testing.assert_close(out.total, want)
    torch.testing.assert_close(out.stats[0], want_accept.detach())
    for a, b in zip(torch.autograd.grad(out.total, [rows, weight]), torch.autograd.grad(want, [rows, weight])):
        torch.testing.assert_close(a, b)


def _reduced_vocabulary_rows(logits: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor, str]):
    """A drafter over a reduced vocabulary against a target over the whole one: ``p_in`` [C, Vd] the target's mass on
    the draft ids, ``p_out`` [C] its mass outside them (where the drafter puts none). Total variation
    ``0.5 * (sum_j |q_j - p_in_j| + p_out)`` or ``-log sum_j min(q_j, p_in_j)``."""
    p_in, p_out, which = target
    q = torch.softmax(logits, dim=-1)  # [C, Vd]
    accept = torch.minimum(q, p_in).sum(-1)  # [C]
    loss = 0.5 * ((q - p_in).abs().sum(-1) + p_out) if which == "tv" else -torch.log(accept)
    return loss, (accept,)


@pytest.mark.parametrize("which", ["tv", "neg_log_accept"])
def test_losses_over_a_reduced_draft_vocabulary_against_the_whole_target_vocabulary(which):
    rows, _, _, _, weights, _, _, _ = _inputs()
    g = torch.Generator().manual_seed(5)
    vd = 7
    draft_ids = torch.randperm(V, generator=g)[:vd]  # [Vd] the target ids of the draft vocabulary
    draft_head = torch.randn(vd, D, generator=g, dtype=torch.float64, requires_grad=True)  # [Vd, D]
    target_hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    target_head = torch.randn(V, D, generator=g, dtype=torch.float64)

    def targets(part: slice):  # the target's distribution over the whole vocabulary, one chunk at a time
        p = torch.softmax(target_hidden[part] @ target_head.t(), dim=-1)  # [C, V]
        p_in = p[:, draft_ids]  # [C, Vd]
        return p_in, 1.0 - p_in.sum(-1), which

    out = chunked_loss([Term(rows, draft_head)], autograd_rows(_reduced_vocabulary_rows), targets, weights, chunks=3)
    want_rows, _ = _reduced_vocabulary_rows(rows @ draft_head.t(), targets(slice(0, N)))
    want = (want_rows * weights).sum()
    torch.testing.assert_close(out.total, want)
    for a, b in zip(
        torch.autograd.grad(out.total, [rows, draft_head]), torch.autograd.grad(want, [rows, draft_head]), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_loss_dependent_weights_are_taken_per_chunk_and_held_constant():
    rows, weight, _, _, _, ids, _, _ = _inputs()
    chunks = [slice(0, 4), slice(4, 9), slice(9, N)]

    def weigh(part: slice, losses: torch.Tensor) -> torch.Tensor:  # the chunk's weights from all its losses
        return torch.softmax(-losses, dim=0) * (part.start + 1)

    out = chunked_loss(
        [Term(rows, weight)], cross_entropy_rows, lambda part: Target(ids=ids[part]), weigh, chunks=chunks
    )
    want_rows, _ = _naive_rows(rows @ weight.t(), "ids", ids, None, None)
    constants = torch.cat([weigh(c, want_rows[c].detach()) for c in chunks])
    want = (want_rows * constants).sum()
    torch.testing.assert_close(out.total, want)
    for a, b in zip(torch.autograd.grad(out.total, [rows, weight]), torch.autograd.grad(want, [rows, weight])):
        torch.testing.assert_close(a, b)


def test_a_term_without_weight_is_the_logits_themselves_and_the_input_is_not_overwritten():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (N,), generator=g)
    before = logits.detach().clone()
    weights = torch.rand(N, generator=g, dtype=torch.float64)
    out = chunked_loss([Term(logits)], cross_entropy_rows, lambda part: Target(ids=ids[part]), weights, chunks=4)
    assert torch.equal(logits.detach(), before)  # the closed-form gradient is formed in a copy
    want = (torch.nn.functional.cross_entropy(logits, ids, reduction="none") * weights).sum()
    torch.testing.assert_close(out.total, want)
    torch.testing.assert_close(torch.autograd.grad(out.total, logits)[0], torch.autograd.grad(want, logits)[0])


def test_with_grads_returns_the_gradients_of_the_scaled_total_and_adds_into_a_buffer():
    rows, weight, _, _, weights, ids, _, _ = _inputs()
    buffer = torch.ones(V, D, dtype=torch.float64)

    def targets(part: slice) -> Target:
        return Target(ids=ids[part])

    out, [(g_rows, g_weight)] = chunked_loss_with_grads(
        [Term(rows, weight)], cross_entropy_rows, targets, weights, [(True, True)], chunks=5, grad_scale=0.25,
        weight_grads_out=[buffer],
    )  # fmt: skip
    want_rows, _ = _naive_rows(rows @ weight.t(), "ids", ids, None, None)
    want = (want_rows * weights).sum()
    want_rows_grad, want_weight_grad = torch.autograd.grad(0.25 * want, [rows, weight])
    assert not out.total.requires_grad
    torch.testing.assert_close(out.total, want.detach())
    torch.testing.assert_close(g_rows, want_rows_grad)
    assert g_weight is buffer
    torch.testing.assert_close(g_weight, want_weight_grad + 1.0)
    _, [(none_rows, only_weight)] = chunked_loss_with_grads(
        [Term(rows, weight)], cross_entropy_rows, targets, weights, [(False, True)]
    )
    assert none_rows is None
    torch.testing.assert_close(only_weight, want_weight_grad / 0.25)


def test_without_grad_mode_the_values_are_the_same_and_nothing_is_differentiable():
    rows, weight, _, _, weights, _, probs, _ = _inputs()

    def targets(part: slice) -> Target:
        return Target(probs=probs[part], acceptance=True)

    with_grad = chunked_loss([Term(rows, weight)], cross_entropy_rows, targets, weights, chunks=3)
    with torch.no_grad():
        without = chunked_loss([Term(rows, weight)], cross_entropy_rows, targets, weights, chunks=3)
    assert not without.total.requires_grad
    torch.testing.assert_close(without.total, with_grad.total.detach())
    torch.testing.assert_close(without.stats[0], with_grad.stats[0])


def test_no_row_gives_a_zero_loss_with_zero_gradients():
    rows, weight, _, _, _, ids, _, _ = _inputs()
    index = torch.zeros(0, dtype=torch.long)
    out = chunked_loss(
        [Term(rows, weight)], cross_entropy_rows, lambda part: Target(ids=ids[part]), torch.ones(0), index=index
    )
    out.total.backward()
    assert float(out.total.detach()) == 0.0 and out.losses.numel() == 0
    assert float(rows.grad.abs().sum()) == 0.0 and float(weight.grad.abs().sum()) == 0.0


def test_bfloat16_rows_are_projected_in_bfloat16_and_get_bfloat16_gradients():
    rows, weight, _, _, weights, ids, _, _ = _inputs(torch.float32)
    half_rows = rows.detach().bfloat16().requires_grad_()
    half_weight = weight.detach().bfloat16().requires_grad_()

    def targets(part: slice) -> Target:
        return Target(ids=ids[part])

    out = chunked_loss([Term(half_rows, half_weight)], cross_entropy_rows, targets, weights.float(), chunks=4)
    assert out.total.dtype == torch.float32  # computed in float32
    out.total.backward()
    assert half_rows.grad.dtype == torch.bfloat16 and half_weight.grad.dtype == torch.bfloat16
    wide = [half_rows.detach().double().requires_grad_(), half_weight.detach().double().requires_grad_()]
    want_rows, _ = _naive_rows(wide[0] @ wide[1].t(), "ids", ids, None, None)
    want = (want_rows * weights.double()).sum()
    torch.testing.assert_close(out.total.double(), want.detach(), rtol=2e-2, atol=2e-2)
    for got, ref in zip([half_rows.grad, half_weight.grad], torch.autograd.grad(want, wide), strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=5e-2, atol=5e-2)


def test_bad_terms_raise_clear_errors():
    rows, weight, _, _, weights, ids, _, _ = _inputs()

    def targets(part: slice) -> Target:
        return Target(ids=ids[part])

    with pytest.raises(ValueError, match="a term's weight must be"):
        chunked_loss([Term(rows, weight.t())], cross_entropy_rows, targets, weights)
    with pytest.raises(ValueError, match="different vocabulary sizes"):
        chunked_loss([Term(rows, weight), Term(rows, weight[:-1])], cross_entropy_rows, targets, weights)
    with pytest.raises(ValueError, match="chunks=0 must be"):
        chunked_loss([Term(rows, weight)], cross_entropy_rows, targets, weights, chunks=0)
    with pytest.raises(ValueError, match="a Target needs"):
        chunked_loss([Term(rows, weight)], cross_entropy_rows, lambda part: Target(), weights)
