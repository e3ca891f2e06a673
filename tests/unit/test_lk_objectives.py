"""The one ``model.loss`` option (trainer/losses/distribution.py) in EAGLE-3, P-EAGLE and DFlash: for every loss, the
objective's loss on a tiny batch equals a naive reference built from the definitions in float64 (drafts computed as
drafting computes them, scored position by position), the expected acceptance ``alpha`` each logs per position equals
the naive ``sum_v min(p_v, q_v)`` against the target's own distribution (over the draft vocabulary not renormalised:
the mass outside it is rejected), ``kl`` keeps its gradients, and bad options are refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.integration.test_eagle3_offline import tiny_llama
from tests.unit.test_dflash_objective import save_target
from trainer.interface.errors import RecipeError
from trainer.losses.distribution import LOSSES, NLA_EPS
from trainer.methods.dflash.objective import DFlash
from trainer.methods.dspark.objective import DSpark
from trainer.methods.eagle3.objective import Eagle3
from trainer.methods.peagle.objective import PEagle

K = 3


def naive(z: torch.Tensor, p: torch.Tensor, name: str, eta: float = 3.0) -> tuple[float, float]:
    """(loss, alpha) of drafter logits z [V] against the target's probabilities p [V] (possibly sub-normalised), in
    float64, from the definitions: alpha = sum_v min(p_v, q_v); KL against p renormalised."""
    q = torch.softmax(z.double(), -1)
    p = p.double()
    alpha = float(sum(min(float(p[v]), float(q[v])) for v in range(len(q))))
    pn = p / p.sum()
    kl = float(sum(pn[v] * (math.log(pn[v]) - math.log(q[v])) for v in range(len(q)) if pn[v] > 0))
    loss = {"kl": kl, "tv": 1 - alpha, "nla": -math.log(max(alpha, NLA_EPS))}.get(name)
    if loss is None:
        lam = math.exp(-eta * alpha)
        loss = lam * kl + (1 - lam) * (1 - alpha)
    return loss, alpha


def entropy(p: torch.Tensor) -> float:
    pn = p.double() / p.double().sum()
    return float(-(torch.xlogy(pn, pn)).sum())


# ---------------------------------------------------------------------------------------------------------------------
# EAGLE-3


def eagle3(tmp_path, **options) -> tuple[Eagle3, torch.Tensor, torch.Tensor]:
    tiny_llama(tmp_path / "target", tied=False)
    objective = Eagle3(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], ttt_steps=K, **options)
    rows = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))  # [B, S + 1]
    objective.build_vocab_map(rows.numpy(), (rows > 4).numpy())
    torch.nn.init.normal_(objective.drafter.midlayer.self_attn.o_proj.weight, std=0.5)
    with torch.no_grad():
        objective.drafter.lm_head.weight.mul_(4.0)  # drafts far enough from uniform for the losses to differ
    return objective, rows[:, :-1], rows[:, 1:] > 4


def naive_eagle3(objective: Eagle3, ids, loss_mask, name: str) -> tuple[float, list[float]]:
    """Chain drafting with the drafter's cache, as at inference (data tokens fed at steps i > 0), every draft scored
    against the target's full distribution at its label position restricted to the draft vocabulary (soft labels,
    not renormalised: KL renormalises) or the one-hot of its argmax where that is in the draft vocabulary; the loss
    sum_i 0.8^i * mean_i, with ``kl`` the cross entropy (KL + entropy), and alpha_i over the trained positions."""
    drafter, target = objective.drafter, objective.target
    out = target(ids, hidden_layers=list(drafter.config.aux_layers))
    draft_ids = drafter.draft_ids()
    embedding = target.model.get_input_embeddings()
    B, S = ids.shape
    sums, counts, alphas, trained = [0.0] * K, [0] * K, [0.0] * K, [0] * K
    for b in range(B):
        fused = drafter.fuse([h[b : b + 1, :-1] for h in out.hidden_states])
        for t in range(S - 1):
            feats, logits, past = drafter(embedding(ids[b : b + 1, 1 : t + 2]), fused[:, : t + 1],
                                          torch.arange(t + 1)[None])  # fmt: skip
            feat, logit = feats[:, -1:], logits[0, -1]
            for i in range(K):
                label = t + 1 + i
                if label >= S:
                    break
                if i > 0:
                    token = ids[b, t + 1 + i]
                    feat, step_logits, (k, v) = drafter(
                        embedding(token.view(1, 1)), feat, torch.tensor([[t + i]]), past
                    )
                    past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
                    logit = step_logits[0, -1]
                if not loss_mask[b, label]:
                    continue
                full = torch.softmax(out.logits[b, label].double(), -1)  # [V] the target's own distribution
                p = full[draft_ids]  # [Vd] sub-normalised
                _, alpha = naive(logit, p, "kl")
                alphas[i] += alpha
                trained[i] += 1
                if objective.labels == "soft":
                    loss, _ = naive(logit, p, name, objective.loss_spec.eta)
                    sums[i] += loss + (entropy(p) if name == "kl" else 0.0)  # kl trains the cross entropy
                    counts[i] += 1
                    continue
                best = out.logits[b, label].argmax()
                if drafter.t2d[best]:
                    one = (draft_ids == best).double()
                    sums[i] += naive(logit, one, name, objective.loss_spec.eta)[0]
                    counts[i] += 1
    total = sum(objective.step_decay**i * sums[i] / counts[i] for i in range(K))
    return total, [alphas[i] / trained[i] for i in range(K)]


@pytest.mark.parametrize("labels", ["soft", "argmax"])
@pytest.mark.parametrize("name", LOSSES)
def test_eagle3_loss_and_alpha_equal_the_naive_definitions(name, labels, tmp_path):
    objective, ids, loss_mask = eagle3(tmp_path, loss=name, labels=labels, lk_eta=2.0)
    with torch.no_grad():
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        expected, alphas = naive_eagle3(objective, ids, loss_mask, name)
    torch.testing.assert_close(float(loss), expected, rtol=2e-5, atol=1e-6)
    for i in range(K):
        assert float(metrics[f"alpha_{i}"]) == pytest.approx(alphas[i], rel=1e-5, abs=1e-6)
    assert all(0.0 < a < 1.0 for a in alphas)


def test_eagle3_alpha_counts_the_mass_outside_the_draft_vocabulary_as_rejected(tmp_path):
    """A smaller draft vocabulary leaves more of the target's mass outside: the logged alpha is below the overlap
    with the renormalised distribution, by at least nothing and at most the outside mass."""
    objective, ids, loss_mask = eagle3(tmp_path, loss="tv")
    with torch.no_grad():
        _, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        signals = objective._online_signals(ids)
    mass = signals[-1]  # [B, S]
    assert bool((mass < 1.0).all()) and bool((mass > 0.0).all())
    objective_full = objective._ttt_loss(ids, loss_mask, *signals[:-1], torch.ones_like(mass))[1]
    for i in range(K):
        assert float(metrics[f"alpha_{i}"]) < float(objective_full[f"alpha_{i}"])


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_kl_skips_the_target_log_partition_on_steps_whose_metrics_are_not_logged(method, tmp_path, monkeypatch):
    """With ``kl`` the expected acceptance is a metric only: on a step whose metrics Lightning does not write
    (``metrics_due`` False) the target's whole-vocabulary log-partition is not taken (no [*, V] projection) and no
    alpha is logged, with the same loss; an LK loss reads it every step."""
    if method == "eagle3":
        objective, ids, loss_mask = eagle3(tmp_path)
    else:
        tiny_llama(tmp_path / "target", tied=False)
        objective = PEagle(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], mask_token_id=63,
                           num_depths=3, cod_ratio=0.8)  # fmt: skip
        rows = torch.randint(0, 60, (2, 10), generator=torch.Generator().manual_seed(1))
        objective.install_vocab_map([(rows.numpy(), (rows > 3).numpy())])
        ids, loss_mask = rows[:, :-1], rows[:, 1:] > 3
        fixed = objective.sample(loss_mask)  # the same COD-sampled elements in every call
        monkeypatch.setattr(objective, "sample", lambda _mask, _documents=None: fixed)
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    projected: list[int] = []  # the vocabulary width of every projection of the target's final states
    project = objective.target.project
    monkeypatch.setattr(objective.target, "project", lambda h, rows=None: projected.append(
        objective.target_config.vocab_size if rows is None else len(rows)) or project(h, rows))  # fmt: skip
    with torch.no_grad():
        torch.manual_seed(0)
        logged, logged_metrics = objective.compute_loss(batch)
        assert objective.target_config.vocab_size in projected
        projected.clear()
        monkeypatch.setattr(objective, "metrics_due", lambda: False)
        torch.manual_seed(0)
        quiet, quiet_metrics = objective.compute_loss(batch)
    assert objective.target_config.vocab_size not in projected
    assert torch.equal(logged, quiet)
    assert any(k.startswith("alpha_") for k in logged_metrics)
    assert not any(k.startswith("alpha_") for k in quiet_metrics)
    assert {k for k in logged_metrics if not k.startswith("alpha_")} == set(quiet_metrics)
    objective.loss_spec = type(objective.loss_spec).from_options("tv", 3.0)
    with torch.no_grad():
        _, tv_metrics = objective.compute_loss(batch)
    assert objective.target_config.vocab_size in projected and any(k.startswith("alpha_") for k in tv_metrics)


def test_eagle3_kl_gradients_equal_the_definitions(tmp_path):
    """``kl`` trains the cross entropy against the renormalised soft labels: its gradients equal those of the KL of the
    definitions (lk_hybrid at eta 0: lambda = 1, autograd through trainer/losses/distribution.py), which differs from it
    by the labels' entropy alone; recompute on, so the checkpointed steps are rerun in backward."""
    grads = []
    for name, eta in (("kl", 3.0), ("lk_hybrid", 0.0)):
        torch.manual_seed(0)
        objective, ids, loss_mask = eagle3(tmp_path / name, loss=name, lk_eta=eta)
        loss, _ = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in objective.drafter.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6)


def test_eagle3_shard_alpha_is_the_stored_top_k_share(tmp_path):
    """From shards at k = V in float32 the loss and every metric, alpha included, are the online step's."""
    objective, ids, loss_mask = eagle3(tmp_path, loss="nla")
    offline = Eagle3(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], ttt_steps=K,
                     loss="nla", target_signals="shards")  # fmt: skip
    offline.drafter.load_state_dict(objective.drafter.state_dict())
    with torch.no_grad():
        out = objective.target(ids, hidden_layers=[0, 1, 2])
        top = torch.log_softmax(out.logits.float(), -1).topk(64, -1)
        batch = {"input_ids": ids, "loss_mask": loss_mask, "teacher_topk_ids": top.indices,
                 "teacher_topk_logprobs": top.values, "teacher_hidden": torch.stack(out.hidden_states, 1)}  # fmt: skip
        online_loss, online = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        shard_loss, shard = offline.compute_loss(batch)
    torch.testing.assert_close(shard_loss, online_loss, rtol=1e-5, atol=1e-6)
    for key in online:
        torch.testing.assert_close(shard[key], online[key], rtol=1e-5, atol=1e-6)


def test_eagle3_refuses_a_bad_loss_and_argmax_weight_with_a_non_kl_loss(tmp_path):
    tiny_llama(tmp_path / "target", tied=False)
    target = str(tmp_path / "target")
    with pytest.raises(RecipeError, match=r"model.loss='ce' is not one of kl, tv, nla, lk_hybrid"):
        Eagle3(target, draft_vocab_size=32, target_layers=[0, 1, 2], loss="ce")
    with pytest.raises(RecipeError, match=r"model.lk_eta=-1"):
        Eagle3(target, draft_vocab_size=32, target_layers=[0, 1, 2], loss="lk_hybrid", lk_eta=-1.0)
    with pytest.raises(RecipeError, match=r"model.argmax_weight=0.3 .* model.loss is 'tv'"):
        Eagle3(target, draft_vocab_size=32, target_layers=[0, 1, 2], loss="tv", argmax_weight=0.3)
    with pytest.raises(RecipeError, match=r"model.loss='x'"):
        PEagle(target, draft_vocab_size=32, target_layers=[0, 1, 2], mask_token_id=63, loss="x")


# ---------------------------------------------------------------------------------------------------------------------
# P-EAGLE


@pytest.mark.parametrize("name", LOSSES)
def test_peagle_loss_and_alpha_equal_the_naive_definitions(name, tmp_path):
    """Every sampled element drafted as the proposer drafts it (entries 0..a and d placeholders) in float64, scored
    against the target's own distribution over the draft vocabulary; the loss one mean over the trained elements
    weighted 0.8 ** d, alpha_d the mean over depth d's."""
    tiny_llama(tmp_path / "target", tied=False)
    obj = PEagle(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], mask_token_id=63,
                 num_depths=3, cod_ratio=0.8, step_decay=0.8, loss=name)  # fmt: skip
    rows = torch.randint(0, 60, (2, 10), generator=torch.Generator().manual_seed(1))
    obj.install_vocab_map([(rows.numpy(), (rows > 3).numpy())])
    for p in obj.drafter.parameters():
        nn.init.normal_(p, std=0.3)
    drafter = obj.drafter.double()
    obj.target.model.double()
    ids, loss_mask = rows[:, :-1], rows[:, 1:] > 3
    with torch.no_grad():
        out = obj.target(ids, hidden_layers=drafter.config.aux_layers)
        aux = torch.cat([h[:, :-1] for h in out.hidden_states], -1)
        full = torch.softmax(out.logits, -1)  # [B, S, V]
        own = full.index_select(-1, drafter.draft_ids())  # [B, S, Vd]
        mass = own.sum(-1)
        anchor, depth, valid = obj.sample(loss_mask)
        loss, metrics = obj.parallel_loss(ids, loss_mask, aux, own / mass[..., None], out.logits.argmax(-1), anchor,
                                          depth, valid, mass)  # fmt: skip
        total = weight = 0.0
        alphas, counts = [0.0] * 3, [0] * 3
        for b in range(ids.shape[0]):
            fused = drafter.fuse([h[b : b + 1, :-1] for h in out.hidden_states])
            for j in range(int(valid[b].sum())):
                a, d = int(anchor[b, j]), int(depth[b, j])
                embeds, hidden = drafter.embed_tokens(ids[b : b + 1, 1 : a + 2]), fused[:, : a + 1]
                if d:
                    pe, ph = drafter.placeholder(d)
                    embeds, hidden = torch.cat([embeds, pe], 1), torch.cat([hidden, ph], 1)
                _, logits, _ = drafter(embeds, hidden, torch.arange(a + 1 + d)[None])
                lp = a + 1 + d
                if loss_mask[b, lp]:
                    value, alpha = naive(logits[0, -1], own[b, lp], name)
                    value += entropy(own[b, lp]) if name == "kl" else 0.0
                    total, weight = total + 0.8**d * value, weight + 1
                    alphas[d], counts[d] = alphas[d] + alpha, counts[d] + 1
    torch.testing.assert_close(float(loss), total / weight, rtol=1e-6, atol=1e-8)
    for d in range(3):
        assert float(metrics[f"alpha_{d}"]) == pytest.approx(alphas[d] / counts[d], rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# DFlash and DSpark

V = 64


def dflash(tmp_path, cls=DFlash, **options) -> tuple[DFlash, torch.Tensor, torch.Tensor]:
    if not (tmp_path / "target").exists():
        save_target(tmp_path / "target")
    objective = cls(str(tmp_path / "target"), num_draft_layers=1, target_layers=[1, 3], block_size=4,
                    mask_token_id=V - 1, max_anchors=5, loss_chunk_size=7, **options)  # fmt: skip
    torch.manual_seed(3)
    for p in objective.drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, V - 1, (2, 12), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 12, dtype=torch.bool)
    loss_mask[0, :3] = False
    return objective, ids, loss_mask


def naive_dflash(objective: DFlash, ids, loss_mask, name: str) -> tuple[float, list[float]]:
    """Every anchored block drafted alone with a cached context (as the proposer drafts), each trained slot k scored
    toward its label (the data's token, the target's argmax: one-hot; soft: the target's distribution) in float64,
    weighted exp(-(k - 1) / gamma) / sum; alpha_k against the target's distribution, over the trained slots."""
    drafter, target = objective.drafter, objective.target
    c = drafter.config
    b, (B, S) = c.block_size, ids.shape
    trained = F.pad(loss_mask[:, :-1], (1, 0), value=False)
    anchors, keep = objective.anchors(trained, "train")
    out = target.model(ids, output_hidden_states=True)
    head, embedding = target.lm_head_weight, objective.embedding_weight()
    total = weights = 0.0
    alphas, counts = [0.0] * (b - 1), [0] * (b - 1)
    for r in range(B):
        context = drafter.context([out.hidden_states[i][r : r + 1] for i in c.target_layers])
        for j in range(anchors.shape[1]):
            if not keep[r, j]:
                continue
            a = int(anchors[r, j])
            past = drafter.context_kv(context[:, :a], torch.arange(a)[None])
            block = torch.tensor([[int(ids[r, a])] + [c.mask_token_id] * (b - 1)])
            slots = drafter.draft(F.embedding(block, embedding), torch.arange(a, a + b)[None], past)[0]
            for k in range(1, b):
                p = a + k
                if p >= S or not trained[r, p]:
                    continue
                logits = slots[k] @ head.t()
                teacher = torch.softmax(out.logits[r, p - 1].double(), -1)
                if objective.labels == "soft":
                    label = teacher
                else:
                    token = ids[r, p] if objective.labels == "data" else teacher.argmax()
                    label = F.one_hot(token, V).double()
                loss, _ = naive(logits, label, name, objective.loss_spec.eta)
                _, alpha = naive(logits, teacher, "kl")
                w = math.exp(-(k - 1) / objective.gamma)
                total, weights = total + w * loss, weights + w
                alphas[k - 1], counts[k - 1] = alphas[k - 1] + alpha, counts[k - 1] + 1
    return total / weights, [x / n for x, n in zip(alphas, counts)]


@pytest.mark.parametrize("labels", ["data", "argmax", "soft"])
@pytest.mark.parametrize("name", LOSSES)
def test_dflash_loss_and_alpha_equal_the_naive_definitions(name, labels, tmp_path):
    objective, ids, loss_mask = dflash(tmp_path, labels=labels, loss=name, lk_eta=2.0)
    with torch.no_grad():
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        expected, alphas = naive_dflash(objective, ids, loss_mask, name)
    torch.testing.assert_close(float(loss), expected, rtol=2e-5, atol=1e-6)
    for k, alpha in enumerate(alphas, 1):
        assert float(metrics[f"alpha_{k}"]) == pytest.approx(alpha, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("labels", ["argmax", "soft"])
def test_dflash_kl_gradients_equal_the_definitions(labels, tmp_path):
    """``kl``'s closed-form gradients (the engine's q - p) equal autograd through the definitions: lk_hybrid at eta 0
    (lambda = 1: the KL alone, or the cross entropy of a one-hot label), with the loss itself."""
    results = []
    for name, eta in (("kl", 3.0), ("lk_hybrid", 0.0)):
        objective, ids, loss_mask = dflash(tmp_path, labels=labels, loss=name, lk_eta=eta)
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        loss.backward()
        grads = {n: p.grad.clone() for n, p in objective.drafter.named_parameters() if p.grad is not None}
        results.append((loss.detach(), metrics, grads))
    (a, ma, ga), (b, mb, gb) = results
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert ma.keys() == mb.keys() and "alpha_1" in ma
    assert ga.keys() == gb.keys() and len(ga) > 3
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-4, atol=1e-7)


def test_dflash_refuses_a_bad_loss_and_dpace_with_a_non_kl_loss(tmp_path):
    save_target(tmp_path / "target")
    options = dict(num_draft_layers=1, block_size=4, mask_token_id=V - 1)
    with pytest.raises(RecipeError, match=r"model.loss='ce' is not one of kl, tv, nla, lk_hybrid"):
        DFlash(str(tmp_path / "target"), loss="ce", **options)
    with pytest.raises(RecipeError, match=r"model.position_weights: dpace .* model.loss='tv'"):
        DFlash(str(tmp_path / "target"), loss="tv", position_weights="dpace", **options)
    with pytest.raises(RecipeError, match=r"model.loss='ce'"):
        DSpark(str(tmp_path / "target"), loss="ce", **options)


@pytest.mark.parametrize("name", ["kl", "lk_hybrid"])
def test_dspark_confidence_labels_are_the_logged_alpha(name, tmp_path):
    """DSpark passes the loss to DFlash; its confidence head's labels are the slots' acceptance rates, the same numbers
    alpha_k averages over slot k's trained slots."""
    objective, ids, loss_mask = dflash(tmp_path, cls=DSpark, labels="soft", loss=name, markov_rank=4)
    assert objective.loss_spec.name == name
    seen = {}
    inner = objective.refiner_loss

    def spy(hidden, bias, accept, slot):
        seen["accept"], seen["slot"] = accept, slot
        return inner(hidden, bias, accept, slot)

    objective.refiner_loss = spy
    with torch.no_grad():
        _, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    b = objective.drafter.config.block_size
    for k in range(1, b):
        labels = seen["accept"][seen["slot"] == k - 1]
        assert 0.0 < float(metrics[f"alpha_{k}"]) < 1.0
        torch.testing.assert_close(metrics[f"alpha_{k}"], labels.mean())
    torch.testing.assert_close(metrics["accept_rate"], seen["accept"].mean())
