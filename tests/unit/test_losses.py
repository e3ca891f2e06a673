"""trainer.losses.distillation against plain float64 reference formulas written out here, chunked against unchunked."""

import math

import pytest
import torch

from trainer.losses.distillation import (
    SoftTargets,
    chunked_cross_entropy,
    cross_entropy_with_grads,
    fused_kd_loss,
    kd_loss,
    sparse_kd_loss,
)
from trainer.models.logit_scaling import LogitScaling

B, S, V, H, HT = 2, 5, 11, 6, 7


def make_inputs(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    student = (2.0 * torch.randn(B, S, V, generator=g)).to(dtype)
    teacher = (2.0 * torch.randn(B, S, V, generator=g)).to(dtype)
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[0, 0] = True
    mask[1, -1] = False
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 1] = -100
    return student, teacher, mask, labels


def reference(student, teacher, mask, labels, loss, beta=0.5, temperature=1.0, alpha=0.0, lk_eta=3.0):
    """Float64 loop over positions: (loss, kd, ce, acceptance), the formulas of trainer.losses.distillation written out
    plainly (the LK losses without T^2)."""
    t, divergence = temperature, loss
    kd_terms, weights, ce_terms, ce_weights, accept = [], [], [], [], []
    for b in range(student.shape[0]):
        for s in range(student.shape[1]):
            w = float(mask[b, s])
            if w == 0:
                continue
            q = torch.softmax(student[b, s].double() / t, dim=0)  # [V]
            p = torch.softmax(teacher[b, s].double() / t, dim=0)  # [V]
            overlap = sum(min(float(p[v]), float(q[v].detach())) for v in range(len(p)))
            tv = 0.5 * sum(abs(p[v] - q[v]) for v in range(len(p)))  # 1 - overlap, written as the distance
            accept.append(w * overlap)
            if divergence == "tv":
                d = tv / (t * t)
            elif divergence == "nla":
                d = -torch.log(1 - tv).clamp(max=-math.log(1e-5)) / (t * t)
            elif divergence == "lk_hybrid":
                lam = math.exp(-lk_eta * overlap)
                d = (lam * (p * (p.log() - q.log())).sum() + (1 - lam) * tv) / (t * t)
            elif divergence == "kl" or (divergence == "jsd" and beta == 0):
                d = (p * (p.log() - q.log())).sum()
            elif divergence == "reverse_kl" or (divergence == "jsd" and beta == 1):
                d = (q * (q.log() - p.log())).sum()
            else:
                m = beta * p + (1 - beta) * q
                d = beta * (p * (p / m).log()).sum() + (1 - beta) * (q * (q / m).log()).sum()
            kd_terms.append(w * d * t * t)
            weights.append(w)
            if labels is not None and int(labels[b, s]) != -100:
                logq1 = torch.log_softmax(student[b, s].double(), dim=0)  # temperature 1
                ce_terms.append(-w * logq1[int(labels[b, s])])
                ce_weights.append(w)
    kd = sum(kd_terms) / sum(weights)
    ce = sum(ce_terms) / sum(ce_weights) if ce_terms else None
    loss = (1 - alpha) * kd + (alpha * ce if alpha > 0 else 0.0)
    return loss, kd, ce, sum(accept) / sum(weights)


def grad_of(fn, x):
    x = x.detach().clone().requires_grad_(True)
    fn(x).backward()
    return x.grad


CASES = [
    ("kl", 0.5, 1.0, 0.0),
    ("reverse_kl", 0.5, 2.0, 0.0),
    ("jsd", 0.5, 1.0, 0.0),
    ("jsd", 0.2, 1.7, 0.3),
    ("kl", 0.5, 2.5, 0.4),
    ("reverse_kl", 0.5, 0.7, 1.0),
    ("tv", 0.5, 1.0, 0.0),
    ("nla", 0.5, 1.0, 0.0),
    ("lk_hybrid", 0.5, 1.0, 0.0),
    ("tv", 0.5, 1.6, 0.3),
    ("nla", 0.5, 0.8, 0.2),
    ("lk_hybrid", 0.5, 1.4, 0.4),
]


@pytest.mark.parametrize("divergence,beta,temperature,alpha", CASES)
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_kd_loss_matches_float64_reference(divergence, beta, temperature, alpha, chunk_size):
    student, teacher, mask, labels = make_inputs()
    opts = dict(loss=divergence, beta=beta, temperature=temperature, alpha=alpha)
    ref_loss, ref_kd, ref_ce, ref_alpha = reference(student, teacher, mask, labels, **opts)
    out = kd_loss(student, teacher, mask, labels, chunk_size=chunk_size, **opts)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.alpha.double(), torch.tensor(ref_alpha, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.kd.double(), ref_kd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.ce.double(), ref_ce, rtol=1e-5, atol=1e-6)

    grad = grad_of(lambda x: kd_loss(x, teacher, mask, labels, chunk_size=chunk_size, **opts).loss, student)
    ref_grad = grad_of(lambda x: reference(x, teacher.double(), mask, labels, **opts)[0], student.double())
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    assert grad[~mask].abs().max() == 0  # masked positions get no gradient
    if alpha < 1:  # with alpha == 1 (pure CE) a position whose label is -100 gets no gradient either
        assert grad[mask].abs().sum(-1).min() > 0


@pytest.mark.parametrize("divergence", ["kl", "reverse_kl", "jsd"])
def test_chunked_equals_unchunked_float_weights(divergence):
    student, teacher, mask, labels = make_inputs(1)
    weights = mask.float() * torch.linspace(0.5, 2.0, S)  # [B, S] float weights
    ref = reference(student, teacher, weights, labels, divergence, 0.3, 1.5, 0.25)[0]
    grads, losses = [], []
    for chunk_size in (None, 1, 2, 4, 1000):
        x = student.clone().requires_grad_(True)
        out = kd_loss(x, teacher, weights, labels, loss=divergence, beta=0.3, temperature=1.5, alpha=0.25,
                      chunk_size=chunk_size)  # fmt: skip
        out.loss.backward()
        losses.append(out.loss)
        grads.append(x.grad)
    torch.testing.assert_close(losses[0].double(), ref, rtol=1e-5, atol=1e-6)
    for loss, grad in zip(losses[1:], grads[1:]):
        torch.testing.assert_close(loss, losses[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, grads[0], rtol=1e-5, atol=1e-7)


def test_jsd_endpoints_are_forward_and_reverse_kl():
    student, teacher, mask, _ = make_inputs(2)
    fwd = kd_loss(student, teacher, mask, temperature=1.3).loss
    rev = kd_loss(student, teacher, mask, loss="reverse_kl", temperature=1.3).loss
    assert not torch.allclose(fwd, rev)
    torch.testing.assert_close(kd_loss(student, teacher, mask, loss="jsd", beta=0.0, temperature=1.3).loss, fwd)
    torch.testing.assert_close(kd_loss(student, teacher, mask, loss="jsd", beta=1.0, temperature=1.3).loss, rev)
    # near the ends the mixture formula vanishes like beta * KL(p||q), so the endpoints are a switch, not a limit
    near0 = kd_loss(student, teacher, mask, loss="jsd", beta=1e-4, temperature=1.3).loss
    assert near0 < 1e-2 * fwd


def test_bf16_logits_are_upcast_per_chunk():
    student, teacher, mask, labels = make_inputs(3, torch.bfloat16)
    ref = reference(student, teacher, mask, labels, "kl", temperature=2.0, alpha=0.5)[0]  # from bf16 values
    x = student.clone().requires_grad_(True)
    out = kd_loss(x, teacher, mask, labels, temperature=2.0, alpha=0.5, chunk_size=2)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)
    assert x.grad.dtype == torch.bfloat16
    ref_grad = grad_of(lambda y: reference(y, teacher.double(), mask, labels, "kl", 0.5, 2.0, 0.5)[0],
                       student.double())  # fmt: skip
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize(
    "divergence,alpha", [("kl", 0.0), ("jsd", 0.4), ("reverse_kl", 0.7), ("tv", 0.0), ("nla", 0.2), ("lk_hybrid", 0.4)]
)
def test_fused_equals_kd_loss_on_projected_logits(divergence, alpha):
    g = torch.Generator().manual_seed(4)
    _, _, mask, labels = make_inputs(4)
    hs = torch.randn(B, S, H, generator=g, requires_grad=True)
    ws = torch.randn(V, H, generator=g, requires_grad=True)
    ht, wt = torch.randn(B, S, HT, generator=g), torch.randn(V, HT, generator=g)
    opts = dict(loss=divergence, beta=0.35, temperature=1.6, alpha=alpha)

    ref = kd_loss(hs @ ws.t(), ht @ wt.t(), mask, labels, **opts)
    ref_grads = torch.autograd.grad(ref.loss, [hs, ws])
    for chunk_size in (None, 3):
        out = fused_kd_loss(hs, ws, ht, wt, mask, labels, chunk_size=chunk_size, **opts)
        grads = torch.autograd.grad(out.loss, [hs, ws])
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.kd, ref.kd, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.ce, ref.ce, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.alpha, ref.alpha, rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_fused_teacher_gets_no_gradient_and_frozen_head_works():
    g = torch.Generator().manual_seed(5)
    _, _, mask, _ = make_inputs(5)
    hs = torch.randn(B, S, H, generator=g, requires_grad=True)
    ws = torch.randn(V, H, generator=g)  # frozen head (as EAGLE's target head)
    ht = torch.randn(B, S, HT, generator=g, requires_grad=True)
    wt = torch.randn(V, HT, generator=g, requires_grad=True)
    out = fused_kd_loss(hs, ws, ht, wt, mask, chunk_size=4)
    out.loss.backward()
    assert ht.grad is None and wt.grad is None and ws.grad is None
    assert hs.grad is not None and hs.grad[mask].abs().sum() > 0
    # a scaled loss scales the stored gradients
    hs2 = hs.detach().clone().requires_grad_(True)
    (3.0 * fused_kd_loss(hs2, ws, ht, wt, mask, chunk_size=4).loss).backward()
    torch.testing.assert_close(hs2.grad, 3.0 * hs.grad)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_chunked_cross_entropy_matches_reference(chunk_size):
    g = torch.Generator().manual_seed(6)
    _, _, _, labels = make_inputs(6)
    labels[1, 2] = -100
    hidden = torch.randn(B, S, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_size)
    grads = torch.autograd.grad(loss, [hidden, weight])

    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    terms = []
    for b in range(B):
        for s in range(S):
            if int(labels[b, s]) != -100:
                terms.append(-torch.log_softmax(h64[b, s] @ w64.t(), dim=0)[int(labels[b, s])])
    ref = sum(terms) / len(terms)
    ref_grads = torch.autograd.grad(ref, [h64, w64])
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_bf16_head_gradients_match_float64():
    """Both fused losses with a bf16 student and head (the input gradient's bf16 GEMM, laid out for the CPU's fast
    path): the float64 formulas on the same bf16 values."""
    g = torch.Generator().manual_seed(7)
    _, _, mask, labels = make_inputs(7)
    hidden = torch.randn(B, S, H, generator=g).bfloat16().requires_grad_(True)
    weight = torch.randn(V, H, generator=g).bfloat16().requires_grad_(True)
    ht, wt = torch.randn(B, S, HT, generator=g), torch.randn(V, HT, generator=g)
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    fused = fused_kd_loss(hidden, weight, ht, wt, mask, labels, alpha=0.3, chunk_size=4).loss
    fused_ref = reference(h64 @ w64.t(), (ht @ wt.t()).double(), mask, labels, "kl", alpha=0.3)[0]
    ce = chunked_cross_entropy(hidden, weight, labels, 4)
    ce_ref = chunked_cross_entropy(h64, w64, labels, None)
    for got, want in ((fused, fused_ref), (ce, ce_ref)):
        grads = torch.autograd.grad(got, [hidden, weight])
        ref_grads = torch.autograd.grad(want, [h64, w64])
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-3, atol=1e-4)
        for grad, ref_grad in zip(grads, ref_grads):
            assert grad.dtype == torch.bfloat16
            torch.testing.assert_close(grad.double(), ref_grad.double(), rtol=2e-2, atol=2e-3)


def teacher_topk(teacher, temperature, k):
    """Top-k ids and the teacher's full log-softmax at `temperature` gathered there (float16, as on disk)."""
    lp = torch.log_softmax(teacher.float() / temperature, dim=-1)  # [B, S, V]
    vals, ids = lp.topk(k, dim=-1)
    return ids.to(torch.int32), vals.to(torch.float16)


@pytest.mark.parametrize("tail", ["renormalize", "bucket"])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_sparse_equals_dense_when_k_is_vocab(tail, chunk_size):
    student, teacher, mask, labels = make_inputs(7)
    ids, _ = teacher_topk(teacher, 1.5, V)
    lp = torch.log_softmax(teacher / 1.5, dim=-1).gather(-1, ids.long())  # float32, exact
    x1, x2 = student.clone().requires_grad_(True), student.clone().requires_grad_(True)
    sparse = sparse_kd_loss(x1, ids, lp, mask, labels, tail=tail, temperature=1.5, alpha=0.2, chunk_size=chunk_size)
    dense = kd_loss(x2, teacher, mask, labels, temperature=1.5, alpha=0.2)
    sparse.loss.backward()
    dense.loss.backward()
    torch.testing.assert_close(sparse.loss, dense.loss, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=2e-6)


def test_sparse_topk_matches_plain_formulas():
    student, teacher, mask, _ = make_inputs(8)
    k, t = 4, 1.2
    ids, lp16 = teacher_topk(teacher, t, k)
    renorm = sparse_kd_loss(student, ids, lp16, mask, tail="renormalize", temperature=t, chunk_size=2).loss
    bucket = sparse_kd_loss(student, ids, lp16, mask, tail="bucket", temperature=t).loss
    want_r, want_b, n = 0.0, 0.0, 0
    for b in range(B):
        for s in range(S):
            if not mask[b, s]:
                continue
            n += 1
            p = lp16[b, s].double().exp()  # [k]
            q = torch.softmax(student[b, s].double() / t, dim=0)[ids[b, s].long()]  # [k] full softmax at the ids
            pr, qr = p / p.sum(), q / q.sum()
            want_r += (pr * (pr / qr).log()).sum() * t * t
            p_tail, q_tail = 1 - p.sum(), 1 - q.sum()
            want_b += ((p * (p / q).log()).sum() + p_tail * (p_tail / q_tail).log()) * t * t
    torch.testing.assert_close(renorm.double(), want_r / n, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bucket.double(), want_b / n, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(renorm, bucket)


def test_bad_inputs_raise_clear_errors():
    student, teacher, mask, labels = make_inputs(9)
    with pytest.raises(ValueError, match="'kl_forward'"):
        kd_loss(student, teacher, mask, loss="kl_forward")
    with pytest.raises(ValueError, match="loss_mask"):
        kd_loss(student, teacher, torch.zeros(B, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="loss_mask"):
        fused_kd_loss(torch.randn(B, S, H), torch.randn(V, H), torch.randn(B, S, HT), torch.randn(V, HT),
                      torch.zeros(B, S))  # fmt: skip
    with pytest.raises(ValueError, match="labels"):
        kd_loss(student, teacher, mask, alpha=0.5)
    with pytest.raises(ValueError, match="teacher_logits"):
        kd_loss(student, teacher[..., :-1], mask)
    with pytest.raises(ValueError, match="vocabulary sizes differ"):
        fused_kd_loss(torch.randn(B, S, H), torch.randn(V, H), torch.randn(B, S, HT), torch.randn(V + 3, HT), mask)
    with pytest.raises(ValueError, match="tail='top'"):
        ids, lp = teacher_topk(teacher, 1.0, 3)
        sparse_kd_loss(student, ids, lp, mask, tail="top")
    with pytest.raises(ValueError, match="teacher_topk_ids"):
        sparse_kd_loss(student, torch.full((B, S, 3), V), torch.zeros(B, S, 3), mask)
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(torch.randn(B, S, H), torch.randn(V, H), torch.full((B, S), -100), 4)
    with pytest.raises(ValueError, match="chunk_size"):
        kd_loss(student, teacher, mask, chunk_size=0)


def test_no_grad_path_gives_the_same_values():
    student, teacher, mask, labels = make_inputs(10)
    with torch.no_grad():
        out = kd_loss(student.requires_grad_(True), teacher, mask, labels, loss="jsd", alpha=0.5, chunk_size=3)
    want = reference(student.detach(), teacher, mask, labels, "jsd", alpha=0.5)[0]
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-5, atol=1e-6)
    assert not out.loss.requires_grad
    assert math.isfinite(float(out.kd))


@pytest.mark.parametrize("divergence", ["kl", "jsd"])
def test_teacher_minus_inf_logits_give_finite_loss_and_gradients(divergence):
    student, teacher, mask, _ = make_inputs(11)
    teacher[..., -3:] = float("-inf")  # e.g. padded vocabulary rows the teacher masks out
    x = student.clone().requires_grad_(True)
    out = kd_loss(x, teacher, mask, loss=divergence, beta=0.4, chunk_size=3)
    out.loss.backward()
    want, n = 0.0, 0
    for b in range(B):
        for s in range(S):
            if mask[b, s]:
                n += 1
                p = torch.softmax(teacher[b, s].double(), 0)
                q = torch.softmax(student[b, s].double(), 0)
                live = p > 0
                if divergence == "kl":
                    want += (p[live] * (p[live] / q[live]).log()).sum()
                else:
                    m = 0.4 * p + 0.6 * q
                    want += 0.4 * (p[live] * (p[live] / m[live]).log()).sum() + 0.6 * (q * (q / m).log()).sum()
    torch.testing.assert_close(out.loss.double(), want / n, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(x.grad).all()


# ---------------------------------------------------------------------------------------------------------------------
# Output scaling (Cohere's and Granite's scales, Gemma-2's soft-cap) on either side of the fused losses.


def scaled_by_hand(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """``x * multiplier``, then ``softcap * tanh(x / softcap)``: the architectures' forwards, written out."""
    x = logits * multiplier
    return x if softcap is None else softcap * torch.tanh(x / softcap)


SCALED_CASES = [  # (student (multiplier, softcap) or None, teacher (multiplier, softcap) or None, divergence, alpha)
    ((2.5, None), None, "kl", 0.0),
    (None, (1.0, 1.5), "reverse_kl", 0.0),
    ((0.7, 2.0), (0.5, 3.0), "jsd", 0.3),
    ((1.0, 1.5), (3.0, None), "kl", 0.5),
]


@pytest.mark.parametrize("student,teacher,divergence,alpha", SCALED_CASES)
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_fused_kd_loss_with_output_scaling_matches_the_scaled_reference(student, teacher, divergence, alpha,
                                                                         chunk_size):  # fmt: skip
    """The loss, its parts and the gradients w.r.t. the student's hidden states and head: those of the float64
    formulas on full logits scaled by hand (the cross entropy on the student's scaled logits too)."""
    g = torch.Generator().manual_seed(12)
    _, _, mask, labels = make_inputs(12)
    hs = torch.randn(B, S, H, generator=g, requires_grad=True)
    ws = torch.randn(V, H, generator=g, requires_grad=True)
    ht, wt = torch.randn(B, S, HT, generator=g), torch.randn(V, HT, generator=g)
    opts = dict(loss=divergence, beta=0.35, temperature=1.6, alpha=alpha)
    student_scaling = None if student is None else LogitScaling(*student)
    teacher_scaling = None if teacher is None else LogitScaling(*teacher)
    out = fused_kd_loss(hs, ws, ht, wt, mask, labels, chunk_size=chunk_size, student_scaling=student_scaling,
                        teacher_scaling=teacher_scaling, **opts)  # fmt: skip
    grads = torch.autograd.grad(out.loss, [hs, ws])

    h64, w64 = hs.detach().double().requires_grad_(True), ws.detach().double().requires_grad_(True)
    student_logits = h64 @ w64.t()  # [B, S, V]
    teacher_logits = ht.double() @ wt.double().t()  # [B, S, V]
    if student is not None:
        student_logits = scaled_by_hand(student_logits, *student)
    if teacher is not None:
        teacher_logits = scaled_by_hand(teacher_logits, *teacher)
    ref_loss, ref_kd, ref_ce, _ = reference(student_logits, teacher_logits, mask, labels, **opts)
    ref_grads = torch.autograd.grad(ref_loss, [h64, w64])
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.kd.double(), ref_kd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.ce.double(), ref_ce, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    unscaled = fused_kd_loss(hs, ws, ht, wt, mask, labels, chunk_size=chunk_size, **opts).loss
    assert not torch.allclose(unscaled, out.loss, rtol=1e-3)  # the scaling matters on these logits


@pytest.mark.parametrize("multiplier,softcap", [(2.5, None), (1.0, 1.5), (0.7, 2.0)])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_chunked_cross_entropy_with_output_scaling_matches_the_scaled_reference(multiplier, softcap, chunk_size):
    g = torch.Generator().manual_seed(13)
    _, _, _, labels = make_inputs(13)
    labels[1, 2] = -100
    hidden = torch.randn(B, S, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    scaling = LogitScaling(multiplier, softcap)
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_size, scaling=scaling)
    grads = torch.autograd.grad(loss, [hidden, weight])

    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    logits = scaled_by_hand(h64 @ w64.t(), multiplier, softcap)  # [B, S, V]
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, [h64, w64])
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    # the sequential MTP heads' cross entropy, its gradients taken without autograd: float64-exact
    loss64, g_hidden, g_weight, _ = cross_entropy_with_grads(h64, w64, labels, chunk_size, scale=0.5, scaling=scaling)
    torch.testing.assert_close(loss64, ref.detach())
    torch.testing.assert_close(g_hidden, 0.5 * ref_grads[0])
    torch.testing.assert_close(g_weight, 0.5 * ref_grads[1])


@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.7, 2.0)])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_cross_entropy_with_grads_on_soft_targets_is_the_forward_kl_and_its_gradients(multiplier, softcap, chunk_size):
    """``soft_targets``: the mean ``KL(p || q)`` over the labelled positions, p a teacher's (scaled) distribution from
    its hidden states, with autograd's gradients of it (float64), the labels only selecting the positions."""
    g = torch.Generator().manual_seed(15)
    _, _, _, labels = make_inputs(15)
    labels[0, 1] = -100
    h64 = torch.randn(B, S, H, generator=g, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    ht, wt = (
        torch.randn(B, S, HT, generator=g, dtype=torch.float64),
        torch.randn(V, HT, generator=g, dtype=torch.float64),
    )
    scaling = LogitScaling(multiplier, softcap)
    log_p = torch.log_softmax(scaled_by_hand(ht @ wt.t(), multiplier, softcap), -1)  # [B, S, V]
    log_q = torch.log_softmax(scaled_by_hand(h64 @ w64.t(), multiplier, softcap), -1)  # [B, S, V]
    kept = labels != -100
    ref = (log_p.exp() * (log_p - log_q)).sum(-1)[kept].mean()
    ref_grads = torch.autograd.grad(ref, [h64, w64])
    teacher = SoftTargets(ht, wt, scaling)
    loss, g_hidden, g_weight, accept = cross_entropy_with_grads(
        h64, w64, labels, chunk_size, scale=0.5, scaling=scaling, soft_targets=teacher
    )
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(g_hidden, 0.5 * ref_grads[0])
    torch.testing.assert_close(g_weight, 0.5 * ref_grads[1])
    torch.testing.assert_close(accept, torch.minimum(log_p.exp(), log_q.exp()).sum(-1)[kept].mean().detach())
    with pytest.raises(ValueError, match="soft_targets.hidden has"):
        cross_entropy_with_grads(h64, w64, labels, soft_targets=SoftTargets(ht[:, :-1], wt))


def test_identity_scaling_changes_nothing():
    """``LogitScaling()`` is None: bit for bit the same losses and gradients."""
    g = torch.Generator().manual_seed(14)
    _, _, mask, labels = make_inputs(14)
    hs = torch.randn(B, S, H, generator=g, requires_grad=True)
    ws = torch.randn(V, H, generator=g, requires_grad=True)
    ht, wt = torch.randn(B, S, HT, generator=g), torch.randn(V, HT, generator=g)
    identity = LogitScaling()
    for scaled in (False, True):
        extra = dict(student_scaling=identity, teacher_scaling=identity) if scaled else {}
        fused = fused_kd_loss(hs, ws, ht, wt, mask, labels, alpha=0.4, chunk_size=3, **extra).loss
        ce = chunked_cross_entropy(hs, ws, labels, 3, **({"scaling": identity} if scaled else {}))
        got = [fused, ce, *torch.autograd.grad(fused + ce, [hs, ws])]
        if not scaled:
            plain = got
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
