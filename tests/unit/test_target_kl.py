"""The KL to the frozen original target of the fine-tunes that change their target (``target_kl_weight`` of
parallel MTP heads and LayerSkip, and their heads and exits trained on the original's distribution): the loss against a
naive per-position formula, the naive gradients through every head backward, the frozen original kept out of the
module tree and checkpoints (its fingerprint kept), the exports recording the original, the refusals, and the changed
target measured beside its original (``draftsmith eval --original_target``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import tiny_llama
from trainer.decoding.drift import prompt_loss, target_drift
from trainer.decoding.report import markdown
from trainer.interface.errors import RecipeError
from trainer.methods.layerskip import kind as layerskip_kind
from trainer.methods.layerskip.objective import LayerSkip, exit_scales
from trainer.methods.mtp_heads import export as mtp_export
from trainer.methods.mtp_heads import kind as mtp_kind
from trainer.methods.mtp_heads.module import head_labels
from trainer.methods.mtp_heads.objective import ParallelMTPHeads

pytestmark = pytest.mark.usefixtures("one_thread")
V = 48
WEIGHT = 0.3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target_kl") / "model"
    tiny_llama(3, vocab=V, hidden=32, layers=3).save_pretrained(path)
    return path


def batch(seed: int = 0, b: int = 2, s: int = 9) -> dict[str, torch.Tensor]:
    """A batch whose first row has an untrained prompt of 3 positions (outside the loss mask)."""
    ids = torch.randint(0, V, (b, s + 1), generator=torch.Generator().manual_seed(seed))  # [B, S + 1]
    mask = torch.ones(b, s, dtype=torch.bool)  # [B, S]
    mask[0, :3] = False
    return {"input_ids": ids[:, :-1], "labels": torch.where(mask, ids[:, 1:], -100), "loss_mask": mask}


def move(model: torch.nn.Module, seed: int) -> None:
    """What a fine-tune does: every weight moved away from the original's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def naive_kl(original_logits: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the masked positions of ``sum_v p_v (log p_v - log q_v)``, one position at a time in float64."""
    terms = []
    for b, s in mask.nonzero().tolist():
        p = torch.softmax(original_logits[b, s].double(), dim=-1)  # [V]
        q = torch.softmax(logits[b, s].double(), dim=-1)  # [V]
        terms.append((p * (p.log() - q.log())).sum())
    return torch.stack(terms).mean()


def kl_by_autograd(original_logits: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The same KL from whole logits, differentiable (the gradient reference)."""
    log_p = F.log_softmax(original_logits.double(), dim=-1)  # [B, S, V]
    log_q = F.log_softmax(logits.double(), dim=-1)  # [B, S, V]
    return (log_p.exp() * (log_p - log_q)).sum(-1)[mask].mean()


def mtp_objective(model_dir, **kw) -> ParallelMTPHeads:
    kw = {"num_heads": 3, "target_dtype": "float64", "loss_chunk_size": 5, "target_kl_weight": WEIGHT, **kw}
    return ParallelMTPHeads(target=str(model_dir), **kw)


def test_mtp_heads_loss_is_the_heads_loss_plus_the_weighted_kl_to_the_original(model_dir) -> None:
    objective = mtp_objective(model_dir)
    b = batch(0)
    with torch.no_grad():  # before training: the original is the model itself
        _, metrics = objective.compute_loss(b)
    assert float(metrics["target_kl"]) < 1e-6
    move(objective.mtp.model, 1)
    with torch.no_grad():
        original = objective.target.model(b["input_ids"]).logits  # [B, S, V]
        expected = naive_kl(original, objective.mtp.model(b["input_ids"]).logits, b["loss_mask"])
    assert float(expected) > 1e-3
    for backward in ("sequential", "checkpoint", "naive"):
        objective.head_backward = backward
        loss, metrics = objective.compute_loss(b)
        heads = objective.mtp(b["input_ids"], b["labels"], backward=backward, chunk_size=5).loss
        torch.testing.assert_close(metrics["target_kl"].double(), expected, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(loss.double(), (heads + WEIGHT * metrics["target_kl"]).double())
    with torch.no_grad():  # validation: the same KL, logged
        _, metrics = objective.compute_loss(b)
    torch.testing.assert_close(metrics["target_kl"].double(), expected, rtol=1e-4, atol=1e-7)


def test_mtp_heads_gradients_of_the_kl_are_the_naive_ones_through_every_backward(model_dir) -> None:
    objective = mtp_objective(model_dir)
    move(objective.mtp.model, 2)
    b = batch(1)
    mtp = objective.mtp
    mtp.zero_grad(set_to_none=True)
    heads = mtp(b["input_ids"], b["labels"], backward="naive").loss
    with torch.no_grad():
        original = objective.target.model(b["input_ids"]).logits
    (heads + WEIGHT * kl_by_autograd(original, mtp.model(b["input_ids"]).logits, b["loss_mask"])).backward()
    reference = {n: p.grad.clone() for n, p in mtp.named_parameters()}
    for backward in ("sequential", "checkpoint", "naive"):
        objective.head_backward = backward
        mtp.zero_grad(set_to_none=True)
        objective.compute_loss(b)[0].backward()
        for name, p in mtp.named_parameters():
            torch.testing.assert_close(p.grad, reference[name], rtol=1e-4, atol=1e-7, msg=f"{backward}: {name}")
    assert not any(p.requires_grad for p in objective.target.model.parameters())


@pytest.mark.parametrize("weight", [0.0, WEIGHT])
def test_mtp_heads_learning_the_original_are_each_scored_by_their_kl_to_it_a_few_positions_later(
    model_dir, weight
) -> None:
    """``labels: original``: head i's loss at position t is the naive KL from the frozen original's distribution at
    t + i, over the positions where head i has a label; head 0's once more at ``target_kl_weight``; in every backward
    and in validation, with autograd's gradients through those formulas."""
    objective = mtp_objective(model_dir, target_kl_weight=weight, labels="original")
    assert objective.target is not None  # the original is loaded for the labels even without the KL term
    b = batch(6)
    move(objective.mtp, 7)
    n, mtp = objective.mtp.num_heads, objective.mtp

    def expected_losses(grad: bool) -> list[torch.Tensor]:
        with torch.set_grad_enabled(grad):
            logits = mtp.all_logits(b["input_ids"])  # [B, S, n, V]
        with torch.no_grad():
            original = objective.target.model(b["input_ids"]).logits  # [B, S, V]
        losses = []
        for i in range(n):
            later = F.pad(original[:, i:], (0, 0, 0, i))  # [B, S, V]: position t holds the original's t + i
            mask = head_labels(b["labels"], i) != -100  # [B, S]
            kl = kl_by_autograd if grad else naive_kl
            losses.append(kl(later, logits[:, :, i], mask))
        return losses

    kls = expected_losses(grad=False)
    assert min(float(kl) for kl in kls) > 1e-3
    expected = sum(kls) + weight * kls[0]
    mtp.zero_grad(set_to_none=True)
    (sum(expected_losses(grad=True)) + weight * expected_losses(grad=True)[0]).backward()
    reference = {name: p.grad.clone() for name, p in mtp.named_parameters()}
    for backward in ("sequential", "checkpoint", "naive"):
        objective.head_backward = backward
        mtp.zero_grad(set_to_none=True)
        loss, metrics = objective.compute_loss(b)
        torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-7, msg=backward)
        for i in range(n):
            torch.testing.assert_close(metrics[f"loss_head{i}"].double(), kls[i], rtol=1e-4, atol=1e-7)
        assert ("target_kl" in metrics) == (weight > 0)
        loss.backward()
        for name, p in mtp.named_parameters():
            torch.testing.assert_close(p.grad, reference[name], rtol=1e-4, atol=1e-7, msg=f"{backward}: {name}")
    with torch.no_grad():  # validation: the same losses, one chunk at a time
        loss, metrics = objective.compute_loss(b)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-7)
    for i in range(n):
        torch.testing.assert_close(metrics[f"loss_head{i}"].double(), kls[i], rtol=1e-4, atol=1e-7)
    assert objective.drafter_record().config["labels"] == "original"


def test_layerskip_loss_is_the_exits_loss_plus_the_weighted_kl_to_the_original(model_dir) -> None:
    objective = LayerSkip(str(model_dir), early_exit_layers=[0], loss_chunk_size=5, target_kl_weight=WEIGHT).eval()
    b = batch(2)
    move(objective.model, 3)
    with torch.no_grad():
        out = objective.model(b["input_ids"], output_hidden_states=True)
        original = objective.target.model(b["input_ids"]).logits
    expected_kl = naive_kl(original, out.logits, b["loss_mask"])
    head, norm = objective.model.lm_head, objective.model.model.norm
    ce = [
        F.cross_entropy(head(norm(out.hidden_states[1])).flatten(0, 1), b["labels"].flatten()),
        F.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten()),
    ]
    scales = exit_scales([0, 2], "sum_l")
    loss, metrics = objective.compute_loss(b)
    torch.testing.assert_close(metrics["target_kl"].double(), expected_kl, rtol=1e-4, atol=1e-7)
    expected = scales[0] * ce[0] + scales[1] * ce[1] + WEIGHT * expected_kl.float()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # under ZeRO-3 the logits come whole through the lm_head module: the same KL
    target = objective.target
    frozen = (target.final_hidden(b["input_ids"]), target.lm_head_weight, b["loss_mask"], target.logit_scaling)
    _, _, kl, _ = objective.net(b["input_ids"], b["labels"], None, [0, 2], scales, whole_logits=True, original=frozen)
    torch.testing.assert_close(kl, metrics["target_kl"], rtol=1e-5, atol=1e-7)
    # its gradient: the naive one
    objective.zero_grad(set_to_none=True)
    objective.compute_loss(b)[0].backward()
    got = {n: p.grad.clone() for n, p in objective.model.named_parameters()}
    objective.zero_grad(set_to_none=True)
    out = objective.model(b["input_ids"], output_hidden_states=True)
    exit0 = F.cross_entropy(head(norm(out.hidden_states[1])).flatten(0, 1), b["labels"].flatten())
    last = F.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten())
    kl = kl_by_autograd(original, out.logits, b["loss_mask"])
    (scales[0] * exit0 + scales[1] * last + WEIGHT * kl).backward()
    for name, p in objective.model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("weight", [0.0, WEIGHT])
def test_layerskip_exits_learning_the_original_are_each_scored_by_their_kl_to_it(model_dir, weight) -> None:
    """``labels: original``: every exit's loss (the last layer's too) is its naive KL to the frozen original, the
    last layer's once more at ``target_kl_weight``; the gradients are autograd's through those formulas."""
    objective = LayerSkip(
        str(model_dir), early_exit_layers=[0, 1], loss_chunk_size=5, target_kl_weight=weight, labels="original"
    ).eval()
    assert objective.target is not None  # the original is loaded for the labels even without the KL term
    b = batch(4)
    move(objective.model, 5)
    head, norm = objective.model.lm_head, objective.model.model.norm
    with torch.no_grad():
        original = objective.target.model(b["input_ids"]).logits  # [B, S, V]
        out = objective.model(b["input_ids"], output_hidden_states=True)
        exits = [head(norm(out.hidden_states[1])), head(norm(out.hidden_states[2])), out.logits]  # [B, S, V] each
    kls = [naive_kl(original, logits, b["loss_mask"]) for logits in exits]
    assert min(float(kl) for kl in kls) > 1e-3
    scales = exit_scales([0, 1, 2], "sum_l")
    loss, metrics = objective.compute_loss(b)
    for layer, kl in zip([0, 1, 2], kls):
        torch.testing.assert_close(metrics[f"exit_{layer}"].double(), kl, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(metrics["target_kl"].double(), kls[-1], rtol=1e-4, atol=1e-7)
    expected = sum(scale * kl for scale, kl in zip(scales, kls)) + weight * kls[-1]
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-7)
    # under ZeRO-3 the logits come whole through the lm_head module: the same losses
    target = objective.target
    frozen = (target.final_hidden(b["input_ids"]), target.lm_head_weight, b["loss_mask"], target.logit_scaling)
    total, losses, _, _ = objective.net(
        b["input_ids"], b["labels"], None, [0, 1, 2], scales, whole_logits=True, original=frozen, distill=True
    )
    torch.testing.assert_close(torch.stack(losses).double(), torch.stack(kls), rtol=1e-4, atol=1e-7)
    objective.zero_grad(set_to_none=True)
    objective.compute_loss(b)[0].backward()
    got = {n: p.grad.clone() for n, p in objective.model.named_parameters()}
    objective.zero_grad(set_to_none=True)
    out = objective.model(b["input_ids"], output_hidden_states=True)
    exits = [head(norm(out.hidden_states[1])), head(norm(out.hidden_states[2])), out.logits]
    kls = [kl_by_autograd(original, logits, b["loss_mask"]) for logits in exits]
    (sum(scale * kl for scale, kl in zip(scales, kls)) + weight * kls[-1]).backward()
    for name, p in objective.model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-3, atol=1e-6, msg=name)
    assert objective.drafter_record().config["labels"] == "original"


@pytest.mark.parametrize("method", ["mtp_heads", "layerskip"])
def test_the_frozen_original_is_in_no_module_tree_nor_checkpoint_but_its_fingerprint_is(model_dir, method) -> None:
    def build(weight: float):
        if method == "mtp_heads":
            return mtp_objective(model_dir, target_kl_weight=weight)
        return LayerSkip(str(model_dir), target_kl_weight=weight)

    plain, kept = build(0.0), build(WEIGHT)
    assert plain.target is None and kept.target is not None
    assert set(kept.state_dict()) == set(plain.state_dict())
    assert sum(p.numel() for p in kept.parameters()) == sum(p.numel() for p in plain.parameters())
    checkpoint: dict = {}
    kept.on_save_checkpoint(checkpoint)
    assert set(checkpoint["frozen_models"]) == {"original"} and not plain._frozen
    assert checkpoint["drafter"]["config"]["fine_tuned_from"] == str(model_dir)
    assert checkpoint["drafter"]["config"]["target_kl_weight"] == WEIGHT


def test_the_exports_record_the_original_and_read_it_back(model_dir, tmp_path) -> None:
    objective = mtp_objective(model_dir)
    record = objective.drafter_record()
    mtp_kind.write(objective.mtp, record, tmp_path / "mtp")
    settings = mtp_export.read_config(tmp_path / "mtp")
    assert settings["fine_tuned_from"] == str(model_dir) and settings["target_kl_weight"] == WEIGHT
    assert settings["labels"] == "data"
    _, loaded = mtp_kind.load(tmp_path / "mtp")
    assert loaded.config["fine_tuned_from"] == str(model_dir) and loaded.config["labels"] == "data"
    distilled = mtp_objective(model_dir, labels="original")
    mtp_kind.write(distilled.mtp, distilled.drafter_record(), tmp_path / "distilled")
    assert mtp_kind.load(tmp_path / "distilled")[1].config["labels"] == "original"
    layerskip = LayerSkip(str(model_dir), target_kl_weight=WEIGHT)
    layerskip_kind.write(layerskip.model, layerskip.drafter_record(), tmp_path / "layerskip")
    marker = json.loads((tmp_path / "layerskip" / layerskip_kind.MARKER).read_text())
    assert marker["fine_tuned_from"] == str(model_dir) and marker["target_kl_weight"] == WEIGHT
    _, loaded = layerskip_kind.load(tmp_path / "layerskip")
    assert loaded.config["fine_tuned_from"] == str(model_dir)


def test_a_kl_without_an_original_or_below_zero_is_refused_naming_the_key(model_dir) -> None:
    with pytest.raises(RecipeError, match="model.target_kl_weight must be >= 0, got -0.1"):
        mtp_objective(model_dir, target_kl_weight=-0.1)
    with pytest.raises(RecipeError, match="model.target_kl_weight=0.5 .* needs model.target and train: all"):
        mtp_objective(model_dir, target_kl_weight=0.5, train="heads")
    with pytest.raises(RecipeError, match="model.target_kl_weight=0.5 .* needs model.target"):
        ParallelMTPHeads(tokenizer="unused", target_kl_weight=0.5)
    with pytest.raises(RecipeError, match="model.target_kl_weight must be >= 0, got nan"):
        LayerSkip(str(model_dir), target_kl_weight=float("nan"))
    with pytest.raises(RecipeError, match="model.target_kl_weight=1.0 .* needs model.target"):
        LayerSkip(tokenizer="unused", target_kl_weight=1.0)
    with pytest.raises(RecipeError, match="model.labels=original .* needs model.target"):
        LayerSkip(tokenizer="unused", labels="original")
    with pytest.raises(RecipeError, match="model.labels=original .* needs model.target"):
        ParallelMTPHeads(tokenizer="unused", labels="original")


def test_a_changed_target_is_measured_beside_its_original() -> None:
    original = tiny_llama(5, vocab=V, hidden=32, layers=2)
    changed = tiny_llama(5, vocab=V, hidden=32, layers=2)
    move(changed, 6)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10]]  # the last has no next token to score
    loss, tokens = prompt_loss(changed, prompts)
    with torch.no_grad():
        terms = [
            -torch.log_softmax(changed(torch.tensor([p])).logits[0, i], -1)[p[i + 1]]
            for p in prompts
            for i in range(len(p) - 1)
        ]
    assert tokens == 7 and loss == pytest.approx(float(torch.stack(terms).mean()), rel=1e-9)
    same = target_drift(original, original, prompts, 12, None, original_path="orig")
    assert same["original"] == same["target"] and same["original_path"] == "orig"
    drift = target_drift(original, changed, prompts, 12, None, changed_loop_share=0.25)
    assert drift["target"] == {"heldout_loss": loss, "loop_share": 0.25}
    assert drift["original"] == same["original"] and drift["tokens"] == 7 and drift["heldout"] == "the prompts"
    text_loss, text_tokens = prompt_loss(original, [[3, 4, 5, 6, 7]])  # held-out text instead of the prompts
    on_text = target_drift(original, changed, prompts, 12, None, 0.25, heldout=[[3, 4, 5, 6, 7]], heldout_source="h")
    assert on_text["original"]["heldout_loss"] == text_loss and on_text["tokens"] == text_tokens == 4
    assert on_text["heldout"] == "h" and on_text["original"]["loop_share"] == same["original"]["loop_share"]
    report = {"loops": {"share": 0.25, "looped_prompts": 1, "window": 16, "max_period": 8}, "best_k": 2,
              "baseline": {"target_forwards": 1, "tokens": 1, "forward_seconds": 0.01}, "greedy": [], "sampling": [],
              "original_target": drift}  # fmt: skip
    text = markdown(report)
    assert f"held-out loss on the prompts {loss:.3f}" in text and "loop share of the greedy output 25.0%" in text
