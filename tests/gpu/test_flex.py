"""Flex attention against the dense path on CUDA at real shapes, through the objectives themselves: EAGLE-3's
training-time test, DFlash's anchored blocks and P-EAGLE's cross-depth mask give the same loss and the same drafter
gradients with ``attention: flex`` (compiled, fused) as with ``dense`` (trainer/models/block_attention.py), on the cut
target at DRAFTSMITH_GPU_SEQ tokens. In float32 the two agree to rounding; a bf16-autocast step (the recipes'
precision) agrees to bf16's resolution."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.gpu.conftest import SEQ, settings
from tests.real_width import objective_kwargs

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def batch_of(cut_target, text_data) -> dict[str, torch.Tensor]:
    """One row of SEQ tokens from the text data, every position trained."""
    tok = AutoTokenizer.from_pretrained(cut_target)
    ids: list[int] = []
    for line in text_data.read_text().splitlines():
        ids += tok(json.loads(line)["text"])["input_ids"]
        if len(ids) > SEQ:
            break
    row = torch.tensor(ids[: SEQ + 1])[None]  # [1, S + 1]
    return {
        "input_ids": row[:, :-1].to(DEVICE), "labels": row[:, 1:].to(DEVICE),
        "loss_mask": torch.ones(1, SEQ, dtype=torch.bool, device=DEVICE),
    }  # fmt: skip


def loss_and_grads(objective, batch, attention: str, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    objective.attention = attention
    if hasattr(objective, "sampler"):
        objective.sampler.manual_seed(0)  # P-EAGLE: the same COD elements for both paths
    module = objective.trainable_module()
    module.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        loss, _ = objective.compute_loss(batch)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in module.named_parameters() if p.grad is not None}
    return float(loss), grads


def assert_flex_matches_dense(name: str, objective, batch) -> None:
    """float32: the same loss (rel 1e-4) and the same drafter gradients (relative norm 1e-2) on both paths."""
    dense_loss, dense = loss_and_grads(objective, batch, "dense", autocast=False)
    flex_loss, flex = loss_and_grads(objective, batch, "flex", autocast=False)
    assert flex_loss == pytest.approx(dense_loss, rel=1e-4)
    assert dense.keys() == flex.keys() and dense
    for key, g in dense.items():
        error = float((flex[key] - g).norm()) / max(float(g.norm()), 1e-12)
        assert error < 1e-2, f"{name}: gradient of {key} differs by {error:.2e} (relative norm)"


@pytest.mark.parametrize("name", ["eagle3", "dflash", "peagle"])
def test_flex_matches_dense_on_cuda(name, cut_target, text_data):
    cls, kwargs, _ = objective_kwargs(name, cut_target, settings())
    if name == "eagle3":
        kwargs["ttt_steps"] = 3  # three key lengths (one compilation each) keep the suite in its budget
    objective = cls(**kwargs).to(DEVICE).train()
    batch = batch_of(cut_target, text_data)
    if hasattr(objective, "install_vocab_map"):
        row = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], 1).cpu().numpy()  # [1, S + 1]
        objective.install_vocab_map([(row, np.ones_like(row, dtype=bool))])
    assert_flex_matches_dense(name, objective, batch)
    if name == "dflash":  # the recipe's precision: bf16 autocast
        bf16_dense, _ = loss_and_grads(objective, batch, "dense", autocast=True)
        bf16_flex, _ = loss_and_grads(objective, batch, "flex", autocast=True)
        assert bf16_flex == pytest.approx(bf16_dense, rel=2e-2)


@pytest.mark.parametrize("name", ["eagle3", "dflash", "peagle"])
def test_flex_matches_dense_with_window_and_documents(name, cut_target, text_data):
    """The long-context options on CUDA: a 256-token sliding window and a row packed from three documents
    (``document_ids``, each document's first token no label) give the same loss and drafter gradients through the
    compiled flex path as through the dense one."""
    cls, kwargs, _ = objective_kwargs(name, cut_target, settings())
    if name == "eagle3":
        kwargs["ttt_steps"] = 3
    objective = cls(**kwargs, window=256).to(DEVICE).train()
    batch = batch_of(cut_target, text_data)
    starts = [0, SEQ // 3, (2 * SEQ) // 3]  # document boundaries along the row
    document_ids = torch.zeros(1, SEQ, dtype=torch.long, device=DEVICE)  # [1, S]
    for s in starts[1:]:
        document_ids[:, s:] += 1
        batch["loss_mask"][:, s - 1] = False  # the label at s - 1 is the next document's first token
    batch["document_ids"] = document_ids
    if hasattr(objective, "install_vocab_map"):
        row = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], 1).cpu().numpy()  # [1, S + 1]
        objective.install_vocab_map([(row, np.ones_like(row, dtype=bool))])
    assert_flex_matches_dense(name, objective, batch)
