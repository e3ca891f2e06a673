"""The one ``loss`` option (kl, tv, nla, lk_hybrid; KD and on-policy also reverse_kl and jsd) in the objectives that
train toward a distribution, outside the EAGLE/DFlash families: KD, on-policy, Medusa and parallel MTP heads with
``labels: original``, LayerSkip's exits. Each objective's loss and its expected-acceptance metric (``alpha_*``)
against naive float64 formulas written per position from the definitions, the gradients against autograd through
them (the MTP heads' sequential backward among them), the KL bit-identical to the row functions it had before, and the
refusals naming the key."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers import tiny_llama
from trainer.interface.errors import RecipeError
from trainer.losses.chunked import Target, Term, chunked_loss_with_grads, cross_entropy_rows, kl_from_log_probs
from trainer.losses.distillation import (
    KD_LOSSES,
    SoftTargets,
    _log1mexp,
    _reduce,
    _select,
    cross_entropy_with_grads,
    divergence_from_log_probs,
    kd_loss,
    sparse_kd_loss,
)
from trainer.losses.distribution import LOSSES, NLA_EPS, DistributionLoss
from trainer.methods.draft_model.kd import KnowledgeDistillation
from trainer.methods.draft_model.on_policy import OnPolicyDistillation
from trainer.methods.layerskip.objective import LayerSkip, exit_scales
from trainer.methods.medusa.objective import Medusa, shifted
from trainer.methods.mtp_heads.module import MTPHeads, Original, head_labels
from trainer.methods.mtp_heads.objective import ParallelMTPHeads
from trainer.models.logit_scaling import LogitScaling

pytestmark = pytest.mark.usefixtures("one_thread")
V = 40
B, S, H, HT = 2, 7, 12, 10


def naive(p: torch.Tensor, logits: torch.Tensor, name: str, eta: float = 3.0) -> tuple[torch.Tensor, float]:
    """One position from the definitions, float64: ``p`` [V] the target's distribution (possibly sub-normalised),
    ``logits`` [V] the drafter's (differentiable). Returns the loss and the acceptance ``sum_v min(p_v, q_v)``."""
    p, q = p.double(), torch.softmax(logits.double(), 0)
    overlap = sum(torch.minimum(p[v], q[v]) for v in range(len(p)))
    tv = 0.5 * sum(abs(p[v] - q[v]) for v in range(len(p))) + 0.5 * (1 - p.sum())  # outside mass rejected
    p_n = p / p.sum()
    kl = sum(p_n[v] * (torch.log(p_n[v]) - torch.log(q[v])) for v in range(len(p)) if p_n[v] > 0)
    if name == "kl":
        loss = kl
    elif name == "tv":
        loss = tv
    elif name == "nla":
        loss = -torch.log(torch.clamp(overlap, min=NLA_EPS))
    else:
        lam = math.exp(-eta * float(overlap.detach()))
        loss = lam * kl + (1 - lam) * tv
    return loss, float(overlap.detach())


def naive_mean(p: torch.Tensor, logits: torch.Tensor, kept: torch.Tensor, name: str, eta: float = 3.0):
    """Mean loss and acceptance over the positions ``kept`` [B, S] of p, logits [B, S, V]."""
    losses, alphas = [], []
    for b, s in kept.nonzero().tolist():
        loss, alpha = naive(p[b, s], logits[b, s], name, eta)
        losses.append(loss)
        alphas.append(alpha)
    return torch.stack(losses).mean(), sum(alphas) / len(alphas)


# ---------------------------------------------------------------------------------------------------------------------
# The losses (trainer/losses/distillation.py) on the chunked-loss engine.


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_cross_entropy_with_grads_toward_soft_targets_matches_the_naive_loss_and_autograd(name, chunk_size):
    """The MTP heads' sequential backward's primitive: the loss, its gradients (scaled) and the acceptance, from a
    teacher's hidden states with its output scaling, against the per-position formulas in float64."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, S, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    ht, wt = (
        torch.randn(B, S, HT, generator=g, dtype=torch.float64),
        torch.randn(V, HT, generator=g, dtype=torch.float64),
    )
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :2] = -100
    scaling = LogitScaling(0.8, 3.0)
    p = torch.softmax(scaling(ht @ wt.t()), -1)  # [B, S, V]
    ref, ref_alpha = naive_mean(p, scaling(hidden @ weight.t()), labels != -100, name, 2.0)
    ref_grads = torch.autograd.grad(0.5 * ref, [hidden, weight])
    loss, g_hidden, g_weight, alpha = cross_entropy_with_grads(
        hidden, weight, labels, chunk_size, scale=0.5, scaling=scaling, soft_targets=SoftTargets(ht, wt, scaling),
        loss=DistributionLoss(name, 2.0),
    )  # fmt: skip
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(float(alpha), ref_alpha)
    torch.testing.assert_close(g_hidden, ref_grads[0])
    torch.testing.assert_close(g_weight, ref_grads[1])
    if name != "kl":
        with pytest.raises(ValueError, match="soft_targets"):
            cross_entropy_with_grads(hidden, weight, labels, loss=DistributionLoss(name))


@pytest.mark.parametrize("name", LOSSES[1:])
def test_sparse_kd_loss_takes_the_lk_losses_over_the_stored_ids(name):
    """A top-k teacher: the LK loss over the k ids (its mass outside them rejected, the hybrid's KL renormalised over
    them, the drafter's distribution the full one at T), no T^2; the acceptance the overlap over the ids."""
    g = torch.Generator().manual_seed(2)
    student = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    t, k = 1.3, 6
    lp = torch.log_softmax(torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2 / t, -1)
    ids = lp.topk(k, -1).indices  # [B, S, k]
    lp_k = lp.gather(-1, ids)  # [B, S, k]
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 3:] = False
    x = student.clone().requires_grad_()
    out = sparse_kd_loss(x, ids, lp_k, mask, loss=name, lk_eta=2.5, temperature=t, chunk_size=3)
    (grad,) = torch.autograd.grad(out.loss, x)
    y = student.clone().requires_grad_()
    losses, alphas = [], []
    for b, s in mask.nonzero().tolist():
        q = torch.softmax(y[b, s] / t, 0)[ids[b, s]]  # [k] the full distribution at the ids
        p = lp_k[b, s].exp()  # [k] sub-normalised
        overlap = torch.minimum(p, q).sum()
        p_n = p / p.sum()
        kl = (p_n * (p_n.log() - q.log())).sum()
        lam = math.exp(-2.5 * float(overlap.detach()))
        losses.append({"tv": 1 - overlap, "nla": -overlap.clamp(min=NLA_EPS).log(),
                       "lk_hybrid": lam * kl + (1 - lam) * (1 - overlap)}[name])  # fmt: skip
        alphas.append(float(overlap.detach()))
    ref = torch.stack(losses).mean()
    torch.testing.assert_close(out.loss.double(), ref.detach())
    torch.testing.assert_close(float(out.alpha), sum(alphas) / len(alphas))
    torch.testing.assert_close(grad, torch.autograd.grad(ref, y)[0])


def _old_dense_rows(student_logits, teacher_logits, divergence, beta, t):
    """trainer/losses/distillation.py's row function of the KD losses before the LK losses, as it was written."""
    lq = F.log_softmax(student_logits / t if t != 1.0 else student_logits, dim=-1)  # [C, V]
    with torch.no_grad():
        lp = F.log_softmax(teacher_logits / t if t != 1.0 else teacher_logits, dim=-1)  # [C, V]
    return divergence_from_log_probs(lp, lq, divergence, beta) * (t * t)


def top_k(ids: torch.Tensor, lp: torch.Tensor):
    """A chunk's top-k teacher from the flat ids [N, k] and log-probabilities [N, k]."""
    return lambda rows: (ids.index_select(0, rows), lp.index_select(0, rows))


def _old_sparse_rows(student_logits, ids, teacher_lp, tail, t):
    """The top-k row function before the LK losses, as it was written."""
    z = student_logits / t  # [C, V]
    if tail == "renormalize":
        lq_k = F.log_softmax(z.gather(-1, ids), dim=-1)
        lp_k = teacher_lp - torch.logsumexp(teacher_lp, dim=-1, keepdim=True)
        return kl_from_log_probs(lp_k, lq_k) * (t * t)
    lq_k = F.log_softmax(z, dim=-1).gather(-1, ids)
    p_k = teacher_lp.exp()
    head = (p_k * torch.where(p_k > 0, teacher_lp - lq_k, torch.zeros_like(lq_k))).sum(-1)
    max_head = math.log1p(-1e-6)
    lp_tail = _log1mexp(torch.logsumexp(teacher_lp, dim=-1).clamp(max=max_head))
    lq_tail = _log1mexp(torch.logsumexp(lq_k, dim=-1).clamp(max=max_head))
    return (head + lp_tail.exp() * (lp_tail - lq_tail)) * (t * t)


@pytest.mark.parametrize("loss", ["kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_the_kl_and_the_divergences_are_bit_identical_to_before(loss, temperature):
    """``loss: kl`` (and KD's reverse_kl, jsd) give the very bits the row functions before the LK losses gave on the
    same engine: the losses, their parts and the gradients; likewise the top-k KL of both tails and the soft-target
    cross entropy of the MTP heads' sequential backward."""
    g = torch.Generator().manual_seed(3)
    student = torch.randn(B, S, V, generator=g)
    teacher = torch.randn(B, S, V, generator=g)
    mask = torch.rand(B, S, generator=g) > 0.3
    labels = torch.randint(0, V, (B, S), generator=g)
    opts = dict(beta=0.3, temperature=temperature, alpha=0.25)
    x = student.clone().requires_grad_()
    new = kd_loss(x, teacher, mask, labels, loss=loss, chunk_size=4, **opts)
    (new_grad,) = torch.autograd.grad(new.loss, x)
    idx, w, lab, kd_den, ce_den = _select(mask, labels, (B, S), V, 0.25)
    flat = teacher.reshape(B * S, V)
    y = student.clone().requires_grad_()

    def old_rows(logits, t_logits):  # the row function as it was, with a zero acceptance beside it
        return _old_dense_rows(logits, t_logits, loss, 0.3, temperature), logits.new_zeros(logits.shape[0])

    old = _reduce(Term(y.reshape(B * S, V)), idx, w, lab, lambda r: flat.index_select(0, r).float(), old_rows, 0.25,
                  4, kd_den, ce_den)  # fmt: skip
    (old_grad,) = torch.autograd.grad(old.loss, y)
    assert torch.equal(new.loss, old.loss) and torch.equal(new.kd, old.kd) and torch.equal(new.ce, old.ce)
    assert torch.equal(new_grad, old_grad)
    if loss != "kl" or temperature == 1.0:
        return
    k = 5
    lp = torch.log_softmax(teacher / temperature, -1)
    ids = lp.topk(k, -1).indices
    lp_k = lp.gather(-1, ids)
    for tail in ("renormalize", "bucket"):
        x = student.clone().requires_grad_()
        new = sparse_kd_loss(x, ids, lp_k, mask, labels, tail=tail, chunk_size=3, temperature=temperature, alpha=0.25)
        (new_grad,) = torch.autograd.grad(new.loss, x)
        flat_ids, flat_lp = ids.reshape(B * S, k), lp_k.reshape(B * S, k)

        def old_sparse(logits, teacher_k, tail=tail):
            rows = _old_sparse_rows(logits, teacher_k[0], teacher_k[1], tail, temperature)
            return rows, logits.new_zeros(logits.shape[0])

        y = student.clone().requires_grad_()
        old = _reduce(Term(y.reshape(B * S, V)), idx, w, lab,
                      top_k(flat_ids, flat_lp), old_sparse, 0.25, 3, kd_den,
                      ce_den)  # fmt: skip
        (old_grad,) = torch.autograd.grad(old.loss, y)
        assert torch.equal(new.loss, old.loss) and torch.equal(new_grad, old_grad)
    # the soft-target cross entropy of the sequential heads: cross_entropy_rows toward the teacher's log-probabilities
    hidden, weight = torch.randn(B, S, H, generator=g), torch.randn(V, H, generator=g)
    ht, wt = torch.randn(B, S, HT, generator=g), torch.randn(V, HT, generator=g)
    soft = SoftTargets(ht, wt)
    lab = torch.where(mask, labels, -100)
    loss_new, gh_new, gw_new, _ = cross_entropy_with_grads(hidden, weight, lab, 3, scale=0.5, soft_targets=soft)
    rows = torch.nonzero(lab.reshape(-1) != -100).squeeze(-1)
    n = rows.numel()
    old, [(gh_old, gw_old)] = chunked_loss_with_grads(
        [Term(hidden.reshape(B * S, H), weight)], cross_entropy_rows,
        lambda part: Target(log_probs=soft.log_probs(rows[part], torch.float32)), torch.ones(n), [(True, True)],
        index=rows, chunks=3, dtype=torch.float32, grad_scale=0.5 / n,
    )  # fmt: skip
    assert torch.equal(loss_new, old.total / n) and torch.equal(gh_new, gh_old.view(B, S, H))
    assert torch.equal(gw_new, gw_old)


# ---------------------------------------------------------------------------------------------------------------------
# The objectives.


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lk") / "target"
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=1,
                         pad_token_id=0)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def batch(seed: int = 0, b: int = 2, s: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (b, s + 1), generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, :3] = False
    return {"input_ids": ids[:, :-1], "labels": torch.where(mask, ids[:, 1:], -100), "loss_mask": mask}


def move(model: torch.nn.Module, seed: int, size: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(size * torch.randn(p.shape, generator=g).to(p.dtype))


@pytest.mark.parametrize("loss", KD_LOSSES)
def test_kd_loss_and_alpha_0_match_the_naive_formulas(target_dir, loss):
    """KD: ``alpha_0`` is the drafter's mean acceptance under the target's distribution at the trained positions,
    for every loss; the LK losses' values and gradients are the naive ones (at temperature 1)."""
    model = KnowledgeDistillation(target_dir, drafter_config={"num_hidden_layers": 1}, loss=loss, loss_chunk_size=5,
                                  seed=2).train()  # fmt: skip
    b = batch(1)
    value, metrics = model.compute_loss(b)
    with torch.no_grad():
        p = torch.softmax(model.target.model(b["input_ids"]).logits.double(), -1)  # [B, S, V]
    params = [q for q in model.student.parameters() if q.requires_grad]
    logits = model.student(b["input_ids"]).logits  # [B, S, V]
    name = loss if loss in LOSSES else "kl"
    ref, ref_alpha = naive_mean(p, logits, b["loss_mask"], name)
    torch.testing.assert_close(float(metrics["alpha_0"]), ref_alpha, rtol=1e-5, atol=1e-6)
    if loss in LOSSES:
        torch.testing.assert_close(value.double(), ref.detach(), rtol=1e-5, atol=1e-6)
        for got, want in zip(torch.autograd.grad(value, params), torch.autograd.grad(ref, params)):
            torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", ["jsd", "nla"])
def test_on_policy_takes_the_same_loss_and_logs_alpha_0(target_dir, loss):
    """On-policy distillation: the loss option's value is KD's on the same rows (its default jsd with beta), and
    ``alpha_0`` the naive acceptance."""
    args = dict(drafter_config={"num_hidden_layers": 1}, loss=loss, beta=0.4, loss_chunk_size=5, seed=2)
    ours = OnPolicyDistillation(target_dir, lmbda=0.0, max_new_tokens=3, **args).train()
    kd = KnowledgeDistillation(target_dir, **args).train()
    b = batch(2)
    value, metrics = ours.compute_loss(b)
    torch.testing.assert_close(value, kd.compute_loss(b)[0], rtol=0, atol=0)
    with torch.no_grad():
        p = torch.softmax(ours.target.model(b["input_ids"]).logits.double(), -1)
        logits = ours.student(b["input_ids"]).logits
    torch.testing.assert_close(float(metrics["alpha_0"]), naive_mean(p, logits, b["loss_mask"], "kl")[1])


@pytest.mark.parametrize("loss", LOSSES)
def test_medusa_heads_learning_the_original_take_the_loss_and_log_alpha_per_head(target_dir, loss):
    """Medusa-1 with ``labels: original``: head k's loss toward the frozen target's distribution at t + 1 + k and its
    ``alpha_{k}``, against the naive formulas from every head's full logits, with autograd's gradients."""
    model = Medusa(target_dir, num_heads=2, num_layers=1, labels="original", loss=loss, lk_eta=2.0, loss_chunk_size=4)
    move(model.drafter.heads, 3, 0.1)
    b = batch(3)
    value, metrics = model.compute_loss(b)
    with torch.no_grad():
        out = model.target.model(b["input_ids"], output_hidden_states=True)
    logits = model.drafter.heads(out.hidden_states[-1])  # [B, S, K, V]
    expected = 0.0
    for k, weight in enumerate([1.0, 0.8]):
        p = torch.softmax(F.pad(out.logits[:, 1 + k :], (0, 0, 0, 1 + k)).double(), -1)  # [B, S, V]
        ref, ref_alpha = naive_mean(p, logits[:, :, k], shifted(b["labels"], k) != -100, loss, 2.0)
        torch.testing.assert_close(metrics[f"loss_{k}"].double(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(float(metrics[f"alpha_{k}"]), ref_alpha, rtol=1e-5, atol=1e-6)
        expected = expected + weight * ref
    params = list(model.drafter.heads.parameters())
    for got, want in zip(torch.autograd.grad(value, params), torch.autograd.grad(expected, params)):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", LOSSES)
def test_mtp_heads_sequential_backward_takes_the_loss_with_autograds_gradients(loss):
    """Parallel MTP heads distilled from an original: every backward (sequential, checkpoint, naive) and evaluation
    give the naive per-head loss and acceptance, and the same gradients as autograd through the naive formula, in
    float64 (the naive backward's KD loss runs in float32: its tolerances are float32's)."""
    heads = MTPHeads(tiny_llama(0, vocab=V, hidden=32, layers=3), 3, head_init="random")
    original_model = tiny_llama(1, vocab=V, hidden=32, layers=3)
    b = batch(4)
    ids, labels = b["input_ids"], b["labels"]
    with torch.no_grad():
        out = original_model(ids, output_hidden_states=True)
    original = Original(out.hidden_states[-1], original_model.lm_head.weight, b["loss_mask"])
    spec = DistributionLoss(loss, 2.0)
    weights = [1.0, 0.5, 0.25]
    params = [p for p in heads.parameters() if p.requires_grad]
    logits = heads.all_logits(ids)  # [B, S, n, V]
    refs, ref_alphas = [], []
    for i in range(3):
        p = torch.softmax(F.pad(out.logits[:, i:], (0, 0, 0, i)), -1)  # [B, S, V]: the original's at t + i
        ref, alpha = naive_mean(p, logits[:, :, i], head_labels(labels, i) != -100, loss, 2.0)
        refs.append(ref)
        ref_alphas.append(alpha)
    expected = sum(w * r for w, r in zip(weights, refs))
    want = torch.autograd.grad(expected, params)
    for backward in ("sequential", "checkpoint", "naive"):
        got = heads(ids, labels, backward=backward, chunk_size=4, weights=weights, original=original, distill=True,
                    loss=spec)  # fmt: skip
        tol = {} if backward == "sequential" else dict(rtol=1e-4, atol=1e-6, check_dtype=False)
        torch.testing.assert_close(got.head_losses, torch.stack(refs).detach(), **tol)
        torch.testing.assert_close(got.head_alpha, torch.tensor(ref_alphas, dtype=torch.float64), **tol)
        for g, w in zip(torch.autograd.grad(got.loss, params), want):
            torch.testing.assert_close(g, w, **tol)
    with torch.no_grad():
        evaluated = heads(ids, labels, chunk_size=4, weights=weights, original=original, distill=True, loss=spec)
    torch.testing.assert_close(evaluated.head_losses, torch.stack(refs).detach())
    torch.testing.assert_close(evaluated.head_alpha, torch.tensor(ref_alphas, dtype=torch.float64))


def test_the_mtp_objective_logs_alpha_per_head(target_dir):
    model = ParallelMTPHeads(target=target_dir, num_heads=2, labels="original", loss="lk_hybrid", loss_chunk_size=4)
    _, metrics = model.compute_loss(batch(5))
    assert {"loss_head0", "loss_head1", "alpha_head0", "alpha_head1"} <= set(metrics)
    assert 0 < float(metrics["alpha_head1"]) <= 1


@pytest.mark.parametrize("loss", LOSSES)
def test_layerskip_exits_take_the_loss_and_log_alpha_per_exit(target_dir, loss):
    """LayerSkip with ``labels: original``: every exit's loss toward the original's distribution and its
    ``alpha_exit_{layer}``, naive, with autograd's gradients; the whole-logits path (ZeRO-3) gives the same."""
    model = LayerSkip(target_dir, early_exit_layers=[0], labels="original", loss=loss, lk_eta=2.0, loss_chunk_size=4)
    model.eval()
    move(model.model, 6, 0.05)
    b = batch(6)
    value, metrics = model.compute_loss(b)
    head, norm = model.model.lm_head, model.model.model.norm
    with torch.no_grad():
        p = torch.softmax(model.target.model(b["input_ids"]).logits.double(), -1)
    out = model.model(b["input_ids"], output_hidden_states=True)
    exits = {0: head(norm(out.hidden_states[1])), 2: out.logits}
    scales = exit_scales([0, 2], "sum_l")
    expected = 0.0
    for (layer, logits), scale in zip(exits.items(), scales):
        ref, ref_alpha = naive_mean(p, logits, b["loss_mask"], loss, 2.0)
        torch.testing.assert_close(metrics[f"exit_{layer}"].double(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(float(metrics[f"alpha_exit_{layer}"]), ref_alpha, rtol=1e-5, atol=1e-6)
        expected = expected + scale * ref
    params = list(model.model.parameters())
    for got, want in zip(torch.autograd.grad(value, params), torch.autograd.grad(expected, params)):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)
    target = model.target
    frozen = (target.final_hidden(b["input_ids"]), target.lm_head_weight, b["loss_mask"], target.logit_scaling)
    _, losses, _, alphas = model.net(b["input_ids"], b["labels"], None, [0, 2], scales, whole_logits=True,
                                     original=frozen, distill=True, loss=DistributionLoss(loss, 2.0))  # fmt: skip
    whole = torch.stack(losses).double()
    torch.testing.assert_close(whole, torch.stack([metrics["exit_0"], metrics["exit_2"]]).double())
    torch.testing.assert_close(alphas[2], metrics["alpha_exit_2"])


# ---------------------------------------------------------------------------------------------------------------------
# Refusals.


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: KnowledgeDistillation(d, loss="tvd"), "model.loss='tvd'"),
        (lambda d: KnowledgeDistillation(d, loss="nla", lk_eta=-1.0), "model.lk_eta=-1.0"),
        (lambda d: KnowledgeDistillation(d, loss="jsd", target_signals="shards"), "model.loss='jsd'"),
        (lambda d: OnPolicyDistillation(d, loss="hybrid"), "model.loss='hybrid'"),
        (lambda d: Medusa(d, labels="argmax", loss="tv"), "model.loss='tv'.*labels: original"),
        (lambda d: Medusa(d, labels="original", loss="reverse_kl"), "model.loss='reverse_kl'"),
        (lambda d: ParallelMTPHeads(target=d, loss="nla"), "model.loss='nla'.*labels: original"),
        (lambda d: LayerSkip(d, loss="lk_hybrid"), "model.loss='lk_hybrid'.*labels: original"),
        (lambda d: LayerSkip(d, labels="original", lk_eta=float("nan")), "model.lk_eta=nan"),
    ],
)
def test_bad_loss_settings_are_refused_naming_the_key(target_dir, make, message):
    with pytest.raises(RecipeError, match=message) as refused:
        make(target_dir)
    assert "\n" not in str(refused.value)
