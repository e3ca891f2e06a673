"""The losses toward a target distribution (trainer/losses/distribution.py) against their naive formulas in float64:
KL, TV, negative log-acceptance and the LK hybrid, their values and autograd gradients, on dense, sub-normalised
(reduced draft vocabulary), one-hot and top-k targets, directly and chunked through the chunked-loss engine."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.interface.errors import RecipeError
from trainer.losses.chunked import Target, Term, chunked_loss
from trainer.losses.distribution import (
    LOSSES,
    NLA_EPS,
    DistributionLoss,
    distribution_rows,
    loss_rows,
    sparse_loss_rows,
)

torch.manual_seed(0)


def naive(logits: torch.Tensor, p: torch.Tensor, name: str, eta: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, element by element, from the definitions: p [N, V] may be sub-normalised (its mass outside the
    vocabulary is rejected), the KL is against p renormalised."""
    losses, alphas = [], []
    for z, pr in zip(logits, p):
        q = torch.exp(z - torch.logsumexp(z, 0))
        alpha = sum(torch.minimum(q[v], pr[v]) for v in range(len(q)))
        mass = pr.sum()
        kl = sum((pr[v] / mass) * (torch.log(pr[v] / mass) - torch.log(q[v])) for v in range(len(q)) if pr[v] > 0)
        if name == "kl":
            loss = kl
        elif name == "tv":
            loss = 0.5 * sum(abs(q[v] - pr[v] / 1.0) for v in range(len(q))) + 0.5 * (1 - mass)
        elif name == "nla":
            loss = -torch.log(torch.clamp(alpha, min=NLA_EPS))
        else:
            lam = math.exp(-eta * float(alpha.detach()))
            loss = lam * kl + (1 - lam) * (1 - alpha)
        losses.append(loss)
        alphas.append(alpha)
    return torch.stack(losses), torch.stack(alphas)


def distributions(n: int, v: int, outside: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(n, v, dtype=torch.float64) * 2
    p = torch.softmax(torch.randn(n, v, dtype=torch.float64) * 2, -1) * (1 - outside)
    return logits, p


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("outside", [0.0, 0.3])
def test_each_loss_and_its_gradient_match_the_naive_formula(name, outside):
    logits, p = distributions(5, 7, outside)
    spec = DistributionLoss(name, 2.5)
    a = logits.clone().requires_grad_()
    loss, alpha = loss_rows(a, p, spec)
    b = logits.clone().requires_grad_()
    ref, ref_alpha = naive(b, p, name, 2.5)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(alpha, ref_alpha)
    # TV of a sub-normalised p: 1 - alpha equals half the L1 distance with the outside mass counted
    (g,) = torch.autograd.grad(loss.sum(), a)
    (g_ref,) = torch.autograd.grad(ref.sum(), b)
    torch.testing.assert_close(g, g_ref)


def test_the_outside_mass_is_rejected_and_the_kl_ignores_it():
    logits, p = distributions(4, 6)
    for name in LOSSES:
        full, alpha_full = loss_rows(logits, p, DistributionLoss(name))
        cut, alpha_cut = loss_rows(logits, p * 0.5, DistributionLoss(name))
        assert bool((alpha_cut < alpha_full).all())
        if name == "kl":
            torch.testing.assert_close(full, cut)


def test_one_hot_targets_reduce_nla_to_the_cross_entropy():
    logits = torch.randn(6, 9, dtype=torch.float64)
    ids = torch.randint(0, 9, (6,))
    p = torch.nn.functional.one_hot(ids, 9).double()
    nla, alpha = loss_rows(logits, p, DistributionLoss("nla"))
    ce = torch.nn.functional.cross_entropy(logits, ids, reduction="none")
    torch.testing.assert_close(nla, ce)
    torch.testing.assert_close(alpha, torch.softmax(logits, -1).gather(-1, ids[:, None])[:, 0])


def test_the_hybrid_weight_carries_no_gradient():
    logits, p = distributions(3, 5)
    a = logits.clone().requires_grad_()
    loss, alpha = loss_rows(a, p, DistributionLoss("lk_hybrid", 3.0))
    kl, _ = loss_rows(a, p, DistributionLoss("kl"))
    tv, _ = loss_rows(a, p, DistributionLoss("tv"))
    lam = torch.exp(-3.0 * alpha.detach())
    (g,) = torch.autograd.grad(loss.sum(), a)
    (g_ref,) = torch.autograd.grad((lam * kl + (1 - lam) * tv).sum(), a)
    torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("name", LOSSES)
def test_top_k_targets_match_the_naive_formula_over_the_stored_ids(name):
    logits = torch.randn(4, 10, dtype=torch.float64)
    ids = torch.stack([torch.randperm(10)[:3] for _ in range(4)])  # [4, 3]
    p = torch.softmax(torch.randn(4, 3, dtype=torch.float64), -1) * 0.8
    loss, alpha = sparse_loss_rows(logits, ids, p, DistributionLoss(name))
    q = torch.softmax(logits, -1).gather(-1, ids)
    ref_alpha = torch.minimum(q, p).sum(-1)
    pn = p / p.sum(-1, keepdim=True)
    kl = (pn * (pn.log() - q.log())).sum(-1)
    ref = {"kl": kl, "tv": 1 - ref_alpha, "nla": -ref_alpha.log()}.get(name)
    if ref is None:
        lam = torch.exp(-3.0 * ref_alpha)
        ref = lam * kl + (1 - lam) * (1 - ref_alpha)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(alpha, ref_alpha)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("form", ["probs", "ids", "sparse"])
def test_the_chunked_engine_gives_the_direct_loss_and_gradients(name, form):
    """Hidden rows projected a chunk at a time: the total, the rows' alpha and the gradients of the rows and the head
    equal autograd through the full logits."""
    n, d, v = 11, 4, 13
    hidden = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    head = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(n, v, dtype=torch.float64) * 2, -1)
    ids = p.argmax(-1)
    top = p.topk(4, -1)
    weights = torch.rand(n, dtype=torch.float64)
    spec = DistributionLoss(name)

    def targets(part: slice) -> Target:
        if form == "probs":
            return Target(probs=p[part])
        if form == "ids":
            return Target(ids=ids[part], probs=p[part])
        return Target(sparse=(top.indices[part], top.values[part] / top.values[part].sum(-1, keepdim=True)))

    out = chunked_loss([Term(hidden, head)], distribution_rows(spec), targets, weights, chunks=3)
    g_h, g_w = torch.autograd.grad(out.total, (hidden, head))
    h2, w2 = hidden.detach().clone().requires_grad_(), head.detach().clone().requires_grad_()
    logits = h2 @ w2.t()
    if form == "probs":
        ref, alpha = loss_rows(logits, p, spec)
    elif form == "ids":
        ref, _ = loss_rows(logits, torch.nn.functional.one_hot(ids, v).double(), spec)
        alpha = torch.minimum(torch.softmax(logits, -1), p).sum(-1)
    else:
        pn = top.values / top.values.sum(-1, keepdim=True)
        ref, alpha = sparse_loss_rows(logits, top.indices, pn, spec)
    total = (ref * weights).sum()
    r_h, r_w = torch.autograd.grad(total, (h2, w2))
    torch.testing.assert_close(out.total, total)
    torch.testing.assert_close(out.stats[0], alpha.detach())
    torch.testing.assert_close(g_h, r_h)
    torch.testing.assert_close(g_w, r_w)


def test_bad_options_are_refused_naming_the_key():
    with pytest.raises(RecipeError, match="model.loss='klx'"):
        DistributionLoss.from_options("klx")
    with pytest.raises(RecipeError, match="model.lk_eta"):
        DistributionLoss.from_options("lk_hybrid", -1.0)
    with pytest.raises(RecipeError, match="model.loss='tv' is not one of kl"):
        DistributionLoss.from_options("tv", allowed=("kl",))
