"""The DFlash loss against a naive reference: every anchored block drafted alone with a cached context (as the
proposer drafts), each slot scored against its token (data), the target's argmax or its distribution (soft) and
weighted by exp(-(k - 1) / gamma) or by D-PACE's products of the block's confidences; the anchors; offline steps
equal to online ones at full vocabulary; refusals of bad input."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers import tiny_scaled_model
from trainer.methods.dflash.objective import DFlash

V, LAYERS = 64, 4


def save_target(path: Path, vocab: int = V, tokenizer=None) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model


def naive_loss(objective: DFlash, ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, list[float]]:
    """sum over kept anchors a and slots k (token a + k trained, in the row) of w_k * loss / sum of w_k."""
    drafter, target = objective.drafter, objective.target
    c = drafter.config
    b, (B, S) = c.block_size, ids.shape
    trained = F.pad(loss_mask[:, :-1], (1, 0), value=False)
    anchors, keep = objective.anchors(trained, "train")  # the anchors compute_loss draws at this step
    out = target.model(ids, output_hidden_states=True)  # the whole model: its logits are the soft labels
    head, embedding = target.lm_head_weight, objective.embedding_weight()
    total = weights = 0.0
    slots_trained = 0
    hits, counts = [0] * (b - 1), [0] * (b - 1)
    for r in range(B):
        context = drafter.context([out.hidden_states[i][r : r + 1] for i in c.target_layers])  # [1, S, H]
        for j in range(anchors.shape[1]):
            if not keep[r, j]:
                continue
            a = int(anchors[r, j])
            assert trained[r, a] and trained[r, a + 1]  # the loss mask allows at the anchor and the next token
            past = drafter.context_kv(context[:, :a], torch.arange(a)[None])
            block = torch.tensor([[int(ids[r, a])] + [c.mask_token_id] * (b - 1)])
            slots = drafter.draft(F.embedding(block, embedding), torch.arange(a, a + b)[None], past)[0]  # [b, H]
            scored = []  # (k, loss) of the block's trained slots
            for k in range(1, b):
                p = a + k  # the position of the token slot k drafts
                if p >= S or not trained[r, p]:
                    continue
                logits = slots[k] @ head.t()
                if objective.labels in ("data", "argmax"):  # the data's token, or the target's choice
                    token = ids[r, p] if objective.labels == "data" else out.logits[r, p - 1].argmax()
                    loss = F.cross_entropy(logits[None], token[None])
                    hit = int(logits.argmax() == token)
                else:
                    teacher = out.logits[r, p - 1]  # the target's distribution of the token at p
                    loss = F.kl_div(logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="sum")
                    hit = int(logits.argmax() == teacher.argmax())
                scored.append((k, float(loss)))
                hits[k - 1] += hit
                counts[k - 1] += 1
            for k, loss in scored:
                w = math.exp(-(k - 1) / objective.gamma)
                if objective.position_weights == "dpace":  # sum over trained j >= k of prod over trained i <= j
                    alpha, w = objective.dpace_alpha, 0.0
                    for j, _ in scored:
                        if j >= k:
                            w += math.prod((1 - alpha) * math.exp(-li) + alpha for i, li in scored if i <= j)
                total, weights = total + w * loss, weights + w
            slots_trained += len(scored)
    if objective.position_weights == "dpace":
        return total / slots_trained, [h / max(1, n) for h, n in zip(hits, counts)]
    return total / weights, [h / max(1, n) for h, n in zip(hits, counts)]


def assert_loss_is_naive(objective: DFlash, ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, dict]:
    """The objective's loss and per-slot accuracies equal :func:`naive_loss`'s; returns the naive loss and the
    objective's metrics."""
    with torch.no_grad():
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        expected, accuracies = naive_loss(objective, ids, loss_mask)
    torch.testing.assert_close(float(loss), expected, rtol=1e-5, atol=0)
    for k, accuracy in enumerate(accuracies, 1):
        assert float(metrics[f"acc_{k}"]) == pytest.approx(accuracy, abs=1e-6)
    return expected, metrics


@pytest.mark.parametrize("labels", ["data", "soft"])
def test_loss_equals_blocks_drafted_alone_and_scored_slot_by_slot(labels, tmp_path):
    save_target(tmp_path / "target")
    objective = DFlash(
        str(tmp_path / "target"), num_draft_layers=2, target_layers=[1, 3], block_size=4, mask_token_id=V - 1,
        max_anchors=5, labels=labels, loss_chunk_size=7,
    )  # fmt: skip
    for p in objective.drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)  # drafts that depend on their inputs
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V - 1, (2, 14), generator=g)
    loss_mask = torch.ones(2, 14, dtype=torch.bool)
    loss_mask[0, :4] = False  # a prompt: tokens 1..4 untrained
    loss_mask[1, 8:10] = False
    _, metrics = assert_loss_is_naive(objective, ids, loss_mask)
    assert 1.0 <= float(metrics["block_tau"]) <= 4.0
    # and the loss trains the drafter's layers, fc and norms, never the target
    loss, _ = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    loss.backward()
    assert (
        objective.drafter.fc.weight.grad.abs().sum() > 0
        and objective.drafter.layers[0].self_attn.k_norm.weight.grad is not None
    )
    assert all(p.grad is None for p in objective.target.model.parameters())


@pytest.mark.parametrize("labels", ["data", "argmax"])
def test_dpace_weights_equal_each_block_scored_alone_with_its_own_confidences(labels, tmp_path):
    """``position_weights: dpace``: every block's slots weighted by sums of products of their smoothed confidences, the
    blocks split over chunks of the loss only at block boundaries (chunk 5 against blocks of 3 slots)."""
    save_target(tmp_path / "target")
    objective = DFlash(
        str(tmp_path / "target"), num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1,
        max_anchors=5, labels=labels, loss_chunk_size=5, position_weights="dpace", dpace_alpha=0.3,
    )  # fmt: skip
    for p in objective.drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V - 1, (2, 14), generator=g)
    loss_mask = torch.ones(2, 14, dtype=torch.bool)
    loss_mask[1, 6:8] = False  # untrained slots inside some blocks
    assert_loss_is_naive(objective, ids, loss_mask)
    loss, _ = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    loss.backward()
    assert objective.drafter.fc.weight.grad.abs().sum() > 0


def test_soft_labels_are_a_soft_capping_targets_own_distribution(tmp_path):
    """Gemma-2 soft-caps its logits in its forward: the soft labels are its forward's distribution (the naive loss
    reads ``out.logits``), the drafter's logits the bare head's (as its proposer computes them)."""
    gemma2 = tiny_scaled_model("gemma2", vocab=V, num_hidden_layers=LAYERS, final_logit_softcapping=2.0)
    with torch.no_grad():
        gemma2.get_output_embeddings().weight.mul_(30.0)  # logits large enough for the cap to matter
    gemma2.float().save_pretrained(tmp_path / "gemma2")
    objective = DFlash(
        str(tmp_path / "gemma2"), num_draft_layers=2, target_layers=[1, 3], block_size=4, mask_token_id=V - 1,
        max_anchors=5, labels="soft", loss_chunk_size=7,
    )  # fmt: skip
    for p in objective.drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, V - 1, (2, 14), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 14, dtype=torch.bool)
    expected, _ = assert_loss_is_naive(objective, ids, loss_mask)
    objective.target.model.config.final_logit_softcapping = None  # the bare head's distribution: another loss
    with torch.no_grad():
        bare, _ = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    assert abs(float(bare) - expected) > 0.05 * expected


def test_anchors_sit_where_the_anchor_and_the_next_token_are_trained(tmp_path):
    save_target(tmp_path / "target")
    objective = DFlash(str(tmp_path / "target"), num_draft_layers=1, block_size=4, mask_token_id=V - 1, max_anchors=6)
    trained = torch.rand(3, 40, generator=torch.Generator().manual_seed(0)) > 0.3
    trained[2] = False
    trained[2, 10:13] = True  # two valid anchors only: 10 and 11
    anchors, keep = objective.anchors(trained, "train")
    assert anchors.shape == (3, 6)
    valid = trained[:, :-1] & trained[:, 1:]
    for r in range(3):
        chosen = anchors[r][keep[r]].tolist()
        assert chosen == sorted(set(chosen)) and all(valid[r, a] for a in chosen)
        assert len(chosen) == min(6, int(valid[r].sum()))
    assert anchors[2][keep[2]].tolist() == [10, 11] and not keep[2, 2:].any()
    again, _ = objective.anchors(trained, "train")
    assert torch.equal(again, anchors)  # deterministic in the seed, the step and the batch
    other, _ = objective.anchors(trained, "val")
    assert not torch.equal(other, anchors)


@pytest.mark.parametrize("labels", ["soft", "data"])
def test_a_shard_step_equals_the_online_step_at_full_vocabulary(labels, tmp_path):
    """One compute_loss on a batch made of the target's own outputs (hidden states of the target layers and k = V
    log-probabilities): the same loss and metrics, the target model never built offline."""
    model = save_target(tmp_path / "target")
    options = dict(num_draft_layers=1, target_layers=[1, 2], block_size=4, mask_token_id=V - 1, labels=labels)
    online = DFlash(str(tmp_path / "target"), **options)
    offline = DFlash(str(tmp_path / "target"), target_signals="shards", **options)
    offline.drafter.load_state_dict(online.drafter.state_dict())
    ids = torch.randint(0, V - 1, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    top = torch.log_softmax(out.logits.float(), dim=-1).topk(V, dim=-1)
    batch = {
        "input_ids": ids,
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        "teacher_topk_ids": top.indices.to(torch.int32),
        "teacher_topk_logprobs": top.values,
        "teacher_hidden": torch.stack([out.hidden_states[i] for i in (1, 2)], dim=1),  # [B, m, S, H]
    }
    with torch.no_grad():
        (a, metrics_a), (b, metrics_b) = online.compute_loss(batch), offline.compute_loss(batch)
    assert float(a) > 0
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for name in metrics_a:
        torch.testing.assert_close(metrics_b[name], metrics_a[name])


def test_bad_input_is_refused_naming_the_value(tok, tmp_path):
    n = len(tok)
    save_target(tmp_path / "full", vocab=n, tokenizer=tok)  # no embedding row past the tokenizer
    save_target(tmp_path / "padded", vocab=n + 8, tokenizer=tok)
    with pytest.raises(ValueError, match=r"mask_token_id is not set and the target's embedding has no row past"):
        DFlash(str(tmp_path / "full"), num_draft_layers=1)
    objective = DFlash(str(tmp_path / "padded"), num_draft_layers=1)
    assert objective.drafter.config.mask_token_id == n  # len(tokenizer), as the reference trainer takes it
    with pytest.raises(ValueError, match=r"mask_token_id=1 is the tokenizer's pad token: the tokenizer uses it"):
        DFlash(str(tmp_path / "padded"), num_draft_layers=1, mask_token_id=tok.pad_token_id)
    with pytest.raises(ValueError, match=r"mask_token_id=77 is the token '.*', which the tokenizer uses"):
        DFlash(str(tmp_path / "padded"), num_draft_layers=1, mask_token_id=77)
    with pytest.raises(ValueError, match=r"model.block_size=1: a block needs the anchor"):
        DFlash(str(tmp_path / "padded"), num_draft_layers=1, block_size=1)
    with pytest.raises(ValueError, match=r"model.target_layers=\[1, 4\]: \[4\] outside .* hidden_states 1..3"):
        DFlash(str(tmp_path / "padded"), num_draft_layers=1, target_layers=[1, 4])
    with pytest.raises(ValueError, match=r"model.position_weights: dpace .* set model.labels to argmax or data"):
        DFlash(str(tmp_path / "padded"), num_draft_layers=1, position_weights="dpace", labels="soft")
    with pytest.raises(ValueError, match=r"model.dpace_alpha=0.0 must be in \(0, 1\]"):
        DFlash(str(tmp_path / "padded"), num_draft_layers=1, position_weights="dpace", dpace_alpha=0.0)
    # a special token without a role is accepted, and then refused when the training data holds it
    objective = DFlash(str(tmp_path / "full"), num_draft_layers=1, mask_token_id=2)
    clean = SimpleNamespace(train_dataset=SimpleNamespace(ids=np.full((3, 9), 7)), tokenizer_path=None)
    objective.check_training_data(clean)
    clean.train_dataset.ids[1, 4] = 2
    with pytest.raises(ValueError, match=r"mask_token_id=2 \('<\|system\|>'\) occurs 1 times in the training data"):
        objective.check_training_data(clean)


def test_prefix_rates_are_the_leading_runs_of_right_slots(tmp_path):
    """prefix_k: the blocks whose slots 1..k are all right, among those whose slots 1..k are all trained."""
    save_target(tmp_path / "target")
    objective = DFlash(str(tmp_path / "target"), num_draft_layers=1, block_size=4, mask_token_id=V - 1, max_anchors=6)
    ids = torch.randint(0, 8, (2, 20), generator=torch.Generator().manual_seed(0))  # few ids: some slots right
    loss_mask = torch.ones(2, 20, dtype=torch.bool)
    with torch.no_grad():
        _, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    prefix = [float(metrics[f"prefix_{k}"]) for k in (1, 2, 3)]
    assert prefix[0] == pytest.approx(float(metrics["acc_1"])) and prefix[0] >= prefix[1] >= prefix[2]
