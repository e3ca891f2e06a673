"""DFlash's ``argmax`` labels (speculators' default "ce" loss): each slot scored by cross entropy against the target's
argmax at the position before its token, online and from shards (the stored top-1)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.unit.test_dflash_objective import V, save_target
from trainer.methods.dflash.objective import DFlash


def test_argmax_labels_are_the_targets_choice_not_the_data_token(tmp_path):
    model = save_target(tmp_path / "target")
    options = dict(num_draft_layers=1, target_layers=[1, 2], block_size=4, mask_token_id=V - 1, max_anchors=4)
    online = DFlash(str(tmp_path / "target"), labels="argmax", loss_chunk_size=5, **options)
    for p in online.drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, V - 1, (2, 12), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        loss, metrics = online.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        out = model(ids, output_hidden_states=True)
        # the reference: every kept block drafted alone, slot k against argmax of the target's logits at a + k - 1
        drafter, c = online.drafter, online.drafter.config
        trained = F.pad(loss_mask[:, :-1], (1, 0), value=False)
        anchors, keep = online.anchors(trained, "train")
        total = weights = 0.0
        for r in range(2):
            context = drafter.context([out.hidden_states[i][r : r + 1] for i in c.target_layers])
            for j in range(anchors.shape[1]):
                a = int(anchors[r, j])
                if not keep[r, j]:
                    continue
                past = drafter.context_kv(context[:, :a], torch.arange(a)[None])
                block = torch.tensor([[int(ids[r, a])] + [c.mask_token_id] * (c.block_size - 1)])
                embeds = F.embedding(block, online.embedding_weight())
                slots = drafter.draft(embeds, torch.arange(a, a + c.block_size)[None], past)[0]
                for k in range(1, c.block_size):
                    p = a + k
                    if p >= ids.shape[1] or not trained[r, p]:
                        continue
                    label = out.logits[r, p - 1].argmax()
                    w = math.exp(-(k - 1) / online.gamma)
                    total += w * float(
                        F.cross_entropy((slots[k] @ online.target.lm_head_weight.t())[None], label[None])
                    )
                    weights += w
        data = DFlash(str(tmp_path / "target"), labels="data", **options)
        data.drafter.load_state_dict(online.drafter.state_dict())
        data_loss, _ = data.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    torch.testing.assert_close(float(loss), total / weights, rtol=1e-5, atol=0)
    assert abs(float(loss) - float(data_loss)) > 1e-3  # random data: the target's choice is not the data's token

    # from shards: the stored top-1 is the label, the same step at any k
    offline = DFlash(str(tmp_path / "target"), target_signals="shards", labels="argmax", **options)
    offline.drafter.load_state_dict(online.drafter.state_dict())
    top = torch.log_softmax(out.logits.float(), dim=-1).topk(3, dim=-1)
    batch = {
        "input_ids": ids,
        "loss_mask": loss_mask,
        "teacher_topk_ids": top.indices.to(torch.int32),
        "teacher_topk_logprobs": top.values,
        "teacher_hidden": torch.stack([out.hidden_states[i] for i in (1, 2)], dim=1),
    }
    with torch.no_grad():
        shard_loss, shard_metrics = offline.compute_loss(batch)
    torch.testing.assert_close(shard_loss, loss, rtol=1e-5, atol=1e-6)
    for name in metrics:  # alpha_k: against the stored top-3 renormalised, not the full distribution
        if not name.startswith("alpha_"):
            torch.testing.assert_close(shard_metrics[name], metrics[name])
