"""The EAGLE-3 training-time-test loss against a naive reference: one element at a time, the drafter drafts a chain
with its cache exactly as at inference (``Eagle3Drafter.forward``), and every draft is scored against the target's
prediction at the position it drafts for."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_eagle3_offline import tiny_llama
from trainer.interface.errors import RecipeError
from trainer.methods.eagle3.objective import Eagle3

K = 3


def naive_ttt_loss(objective: Eagle3, ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, list[float]]:
    """sum_i 0.8^i * mean over trained label positions of CE(target's draft-vocabulary distribution, draft i) (mixed
    with ``argmax_weight`` times CE(that distribution's argmax, draft i)), or with argmax labels of CE(the target's
    argmax, draft i) where that argmax is in the draft vocabulary; the accuracy of draft i against the target's argmax
    over the draft vocabulary (soft labels) or over every token (argmax labels)."""
    drafter, target = objective.drafter, objective.target
    aux = list(drafter.config.aux_layers)
    out = target(ids, hidden_layers=aux)
    draft_ids = drafter.draft_ids()
    embedding = target.model.get_input_embeddings()
    B, S = ids.shape
    sums, counts, hits, hit_total = [0.0] * K, [0] * K, [0] * K, [0] * K
    for b in range(B):
        fused = drafter.fuse([h[b : b + 1, :-1] for h in out.hidden_states])  # [1, S - 1, H]
        for t in range(S - 1):
            # commit elements 0..t (features of tokens 0..t, embeddings of tokens 1..t+1), then draft K tokens
            committed = embedding(ids[b : b + 1, 1 : t + 2])  # [1, t + 1, H]
            feats, logits, past = drafter(committed, fused[:, : t + 1], torch.arange(t + 1)[None])
            feat, logit = feats[:, -1:], logits[0, -1]  # [1, 1, H], [Vd]
            for i in range(K):
                label = t + 1 + i  # draft i of element t predicts token t + 2 + i: the target's output at t + 1 + i
                if label >= S:
                    break
                if i > 0:
                    if objective.ttt_inputs == "data":
                        token = ids[b, t + 1 + i]
                    else:
                        token = drafter.to_target_ids(logit.argmax())
                    position = torch.tensor([[t + i]])
                    feat, step_logits, (k, v) = drafter(embedding(token.view(1, 1)), feat, position, past)
                    past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
                    logit = step_logits[0, -1]
                if not loss_mask[b, label]:
                    continue
                log_q = torch.log_softmax(logit.float(), dim=-1)  # [Vd]
                guess = drafter.to_target_ids(logit.argmax())
                if objective.labels == "soft":
                    p = torch.softmax(out.logits[b, label, draft_ids].float(), dim=-1)  # [Vd]
                    w = objective.argmax_weight
                    sums[i] += float((1 - w) * -(p * log_q).sum() - w * log_q[p.argmax()])
                    counts[i] += 1
                    hits[i] += int(guess == draft_ids[out.logits[b, label, draft_ids].argmax()])
                    continue
                best = out.logits[b, label].argmax()  # over the whole vocabulary
                hits[i] += int(guess == best)
                hit_total[i] += 1
                if drafter.t2d[best]:
                    sums[i] += float(-log_q[int((draft_ids == best).nonzero())])
                    counts[i] += 1
    total = sum(objective.step_decay**i * sums[i] / counts[i] for i in range(K))
    return total, [hits[i] / (counts[i] if objective.labels == "soft" else hit_total[i]) for i in range(K)]


EAGLE31 = {"norm_before_residual": True, "fc_norm": True, "norm_output": True}


@pytest.mark.parametrize(
    ("ttt_inputs", "flags", "labels", "argmax_weight"),
    [
        ("data", {}, "soft", 0.0),
        ("predicted", {}, "soft", 0.0),
        ("data", EAGLE31, "soft", 0.0),
        ("data", EAGLE31, "soft", 0.3),
        ("predicted", {"norm_before_fc": True, "norm_output": True}, "soft", 0.0),
        ("data", {}, "argmax", 0.0),
    ],
)
def test_ttt_loss_equals_chain_drafting_scored_position_by_position(ttt_inputs, flags, labels, argmax_weight, tmp_path):
    """With the EAGLE-3.1 flags too: training feeds each step what drafting feeds (post-norm with norm_output). Soft
    labels project the target onto the draft vocabulary only; the reference projects onto every token and slices."""
    tiny_llama(tmp_path / "target", tied=False)
    objective = Eagle3(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], ttt_steps=K,
                       ttt_inputs=ttt_inputs, labels=labels, argmax_weight=argmax_weight, **flags)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 64, (2, 11), generator=g)  # [B, S + 1]
    objective.build_vocab_map(rows.numpy(), (rows > 4).numpy())
    torch.nn.init.normal_(objective.drafter.midlayer.self_attn.o_proj.weight, std=0.5)  # drafts that depend on inputs
    ids, loss_mask = rows[:, :-1], rows[:, 1:] > 4
    with torch.no_grad():
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        expected, accuracies = naive_ttt_loss(objective, ids, loss_mask)
    torch.testing.assert_close(float(loss), expected, rtol=1e-5, atol=0)
    for i in range(K):
        assert float(metrics[f"acc_{i}"]) == pytest.approx(accuracies[i], abs=1e-6)


def test_recomputing_earlier_steps_changes_neither_loss_nor_gradients(tmp_path):
    """recompute=True (the default) reruns TTT steps 0..K-2 in backward instead of storing them: the same loss,
    metrics and gradients as storing every step, to float32 rounding (the drafter's own guesses fed back, so that
    the recomputed steps must also reproduce the tokens they feed on)."""
    tiny_llama(tmp_path / "target", tied=False)
    rows = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3))  # [B, S + 1]
    ids, loss_mask = rows[:, :-1], rows[:, 1:] > 4
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        objective = Eagle3(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], ttt_steps=4,
                           ttt_inputs="predicted", recompute=recompute)  # fmt: skip
        objective.build_vocab_map(rows.numpy(), (rows > 4).numpy())
        torch.nn.init.normal_(objective.drafter.midlayer.self_attn.o_proj.weight, std=0.5)
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        loss.backward()
        grads = {n: p.grad.clone() for n, p in objective.drafter.named_parameters() if p.grad is not None}
        results.append((loss.detach(), metrics, grads))
    (a, metrics_a, grads_a), (b, metrics_b, grads_b) = results
    assert float(a) > 0 and len(grads_a) > 5
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    assert {k: float(v) for k, v in metrics_a.items()} == pytest.approx({k: float(v) for k, v in metrics_b.items()})
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(
            grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_argmax_weight_is_checked(tmp_path):
    """model.argmax_weight outside [0, 1], or above 0 with argmax labels (which are the argmax alone), is refused by
    name."""
    tiny_llama(tmp_path / "target", tied=False)
    target = str(tmp_path / "target")
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(RecipeError, match=r"model.argmax_weight must be in \[0, 1\], got"):
            Eagle3(target, draft_vocab_size=32, target_layers=[0, 1, 2], argmax_weight=bad)
    with pytest.raises(RecipeError, match="model.argmax_weight=0.3 mixes the argmax into soft labels") as err:
        Eagle3(target, draft_vocab_size=32, target_layers=[0, 1, 2], labels="argmax", argmax_weight=0.3)
    assert "model.labels: soft" in err.value.hint
