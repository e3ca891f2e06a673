"""Parallel MTP heads: the layout (trunk + head 0 is the model), the labels of each head, and the three backwards
(sequential, per-head checkpointing, naive) giving the same gradients in float64, with and without gradient
accumulation; the sequential one never saves a head's full logits for backward and fires every parameter's gradient
hook once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import tiny_llama, tiny_model
from trainer.losses.distillation import cross_entropy_with_grads
from trainer.methods.mtp_heads.module import MTPHeads, head_labels
from trainer.models.logit_scaling import LogitScaling

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 48


def batch(seed: int, b: int = 2, s: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels with an untrained prompt (-100) in the first row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)  # [B, S]
    labels = torch.randint(0, VOCAB, (b, s), generator=g)  # [B, S]
    labels[0, :4] = -100
    return ids, labels


def heads_of(seed: int = 0, n: int = 4, **config) -> MTPHeads:
    model = tiny_llama(seed, vocab=VOCAB, hidden=32, layers=3, **config)
    torch.manual_seed(seed + 1)
    return MTPHeads(model, n, head_init="random")


def grads_after(heads: MTPHeads, micro_batches, backward: str, **kw) -> dict[str, torch.Tensor]:
    """The accumulated gradients of the mean loss over ``micro_batches`` (as Lightning accumulates: loss / count)."""
    heads.zero_grad(set_to_none=True)
    for ids, labels in micro_batches:
        out = heads(ids, labels, backward=backward, **kw)
        (out.loss / len(micro_batches)).backward()
    return {n: p.grad.clone() for n, p in heads.named_parameters() if p.grad is not None}


def test_head_labels_shift_by_the_head_index() -> None:
    labels = torch.tensor([[10, 11, 12, 13, -100, 15]])
    assert head_labels(labels, 0).tolist() == [[10, 11, 12, 13, -100, 15]]
    assert head_labels(labels, 2).tolist() == [[12, 13, -100, 15, -100, -100]]  # position t: token t + 3
    assert head_labels(labels, 9).tolist() == [[-100] * 6]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_trunk_and_head_0_are_the_model_itself(family) -> None:
    model = tiny_llama(0, vocab=VOCAB) if family == "llama" else tiny_model("qwen3", 0, vocab=VOCAB)
    heads = MTPHeads(model, 3)
    ids, _ = batch(0)
    logits = heads.all_logits(ids)  # [B, S, n, V]
    torch.testing.assert_close(logits[:, :, 0], model(ids).logits, rtol=0, atol=0)
    z, _ = heads.trunk(ids)
    hidden = model(ids, output_hidden_states=True).hidden_states[heads.hidden_layer]
    torch.testing.assert_close(z, hidden, rtol=0, atol=0)  # the extra heads read HF hidden_states[L - 1]
    torch.testing.assert_close(logits[:, :, 1], logits[:, :, 0], rtol=0, atol=0)  # "copy": head 1 is the last layer


def test_the_loss_is_the_sum_of_each_heads_cross_entropy_on_its_shifted_labels() -> None:
    heads = heads_of()
    ids, labels = batch(1)
    logits = heads.all_logits(ids)  # [B, S, n, V]
    expected = [
        F.cross_entropy(logits[:, :, i].flatten(0, 1), head_labels(labels, i).flatten(), ignore_index=-100)
        for i in range(heads.num_heads)
    ]
    weights = [1.0, 0.5, 0.25, 0.125]
    for backward in ("sequential", "checkpoint", "naive"):
        out = heads(ids, labels, backward=backward, chunk_size=3, weights=weights)
        torch.testing.assert_close(out.head_losses, torch.stack(expected).detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.loss, sum(w * e for w, e in zip(weights, expected)), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        evaluated = heads(ids, labels, chunk_size=5)
    torch.testing.assert_close(evaluated.head_losses, torch.stack(expected), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_sequential_and_checkpointed_gradients_equal_the_naive_ones_in_float64(accumulate, tied) -> None:
    heads = heads_of(2, tie_word_embeddings=tied)
    assert (heads.model.lm_head.weight is heads.model.get_input_embeddings().weight) == tied
    micro = [batch(10 + i) for i in range(accumulate)]
    weights = [1.0, 0.7, 0.5, 0.3]
    naive = grads_after(heads, micro, "naive", weights=weights)
    assert naive.keys() == {name for name, _ in heads.named_parameters()}  # every weight trains
    for backward in ("sequential", "checkpoint"):
        got = grads_after(heads, micro, backward, weights=weights, chunk_size=4)  # chunks split rows unevenly
        assert got.keys() == naive.keys()
        for name in naive:
            torch.testing.assert_close(got[name], naive[name], rtol=1e-12, atol=1e-14, msg=f"{backward}: {name}")


def test_an_output_scaling_is_part_of_the_shared_output_layer() -> None:
    """A model whose forward scales its logits after the lm_head (a scale and a soft-cap, declared here on a tiny
    Llama's config: the architectures that have one are not run a layer at a time): every head's logits are the
    scaled ones, in the loss of every backward and in evaluation, and the three backwards give the same gradients."""
    heads = heads_of(5, logit_scale=4.0, final_logit_softcapping=1.5)
    assert heads.scaling == LogitScaling(multiplier=4.0, softcap=1.5)
    ids, labels = batch(40)
    logits = heads.all_logits(ids)  # [B, S, n, V]
    torch.testing.assert_close(logits[:, :, 0], 1.5 * torch.tanh(4.0 * heads.model(ids).logits / 1.5))  # by hand
    expected = torch.stack([
        F.cross_entropy(logits[:, :, i].flatten(0, 1), head_labels(labels, i).flatten(), ignore_index=-100)
        for i in range(heads.num_heads)
    ]).detach()  # fmt: skip
    for backward in ("sequential", "checkpoint", "naive"):
        out = heads(ids, labels, backward=backward, chunk_size=3)
        torch.testing.assert_close(out.head_losses, expected, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        evaluated = heads(ids, labels, chunk_size=5)
    torch.testing.assert_close(evaluated.head_losses, expected, rtol=1e-12, atol=1e-12)
    micro = [batch(41), batch(42)]
    naive = grads_after(heads, micro, "naive")
    for backward in ("sequential", "checkpoint"):
        got = grads_after(heads, micro, backward, chunk_size=4)
        for name in naive:
            torch.testing.assert_close(got[name], naive[name], rtol=1e-12, atol=1e-14, msg=f"{backward}: {name}")


def test_only_the_extra_heads_train_when_the_model_is_frozen() -> None:
    heads = heads_of(3)
    heads.model.requires_grad_(False)
    micro = [batch(20), batch(21)]
    naive = grads_after(heads, micro, "naive")
    got = grads_after(heads, micro, "sequential", chunk_size=7)
    assert naive.keys() == got.keys() and all(k.startswith("heads.") for k in got) and got
    for name in naive:
        torch.testing.assert_close(got[name], naive[name], rtol=1e-12, atol=1e-14, msg=name)


def test_the_sequential_backward_saves_no_full_logits_and_fires_each_gradient_hook_once() -> None:
    """What DDP and ZeRO rely on: one gradient per parameter per backward (the shared lm_head's summed over heads);
    and the memory saving: no tensor of a head's full logits is kept for backward (only chunk-sized ones exist)."""
    heads = heads_of(4)
    ids, labels = batch(30, b=2, s=12)
    positions = ids.numel()
    fired: dict[str, int] = {}
    for name, p in heads.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.__setitem__(name, fired.get(name, 0) + 1))
    for backward in ("naive", "sequential"):
        saved: list[torch.Size] = []

        def pack(t: torch.Tensor, saved=saved) -> torch.Tensor:
            saved.append(t.shape)
            return t

        fired.clear()
        heads.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = heads(ids, labels, backward=backward, chunk_size=5)
        out.loss.backward()
        logits_saved = [s for s in saved if len(s) and s[-1] == VOCAB and s.numel() >= positions * VOCAB]
        if backward == "naive":
            assert len(logits_saved) >= heads.num_heads  # every head's logits wait for backward
        else:
            assert logits_saved == []
            assert set(fired.values()) == {1} and len(fired) == len(list(heads.parameters()))


def test_cross_entropy_with_grads_matches_autograd_in_float64_and_without_labels() -> None:
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 7, 6, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(13, 6, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 13, (2, 7), generator=g)
    labels[1, 2:] = -100
    loss, g_hidden, g_weight, _ = cross_entropy_with_grads(hidden, weight, labels, chunk_size=3, scale=0.5)
    expected = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref_hidden, ref_weight = torch.autograd.grad(0.5 * expected, (hidden, weight))
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(g_hidden, ref_hidden, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(g_weight, ref_weight, rtol=1e-13, atol=1e-15)
    loss, g_hidden, g_weight, _ = cross_entropy_with_grads(hidden, weight, torch.full_like(labels, -100))
    assert float(loss) == 0 and not g_hidden.any() and not g_weight.any()


def test_evaluation_measures_each_heads_agreement_with_head_0_a_few_positions_later() -> None:
    heads = heads_of(6)
    ids, labels = batch(40)
    with torch.no_grad():
        out = heads(ids, labels, chunk_size=4, measure=True)
        logits = heads.all_logits(ids)  # [B, S, n, V]
    argmax0 = logits[:, :, 0].argmax(-1)  # [B, S]
    top_k = heads.agreement.shape[1]
    for i in range(1, heads.num_heads):
        reference = head_labels(argmax0, i)  # head 0's token at t + i
        valid = (head_labels(labels, i) != -100) & (reference != -100)
        ref_logit = logits[:, :, i].gather(-1, reference.clamp(min=0)[..., None])  # [B, S, 1]
        ranks = (logits[:, :, i] > ref_logit).sum(-1)[valid]  # [N]
        expected = torch.bincount(ranks[ranks < top_k], minlength=top_k).double()
        assert torch.equal(out.agreement[i - 1], expected) and out.agreement_count[i - 1] == valid.sum()
    heads.record_agreement(out.agreement, out.agreement_count)
    rates = (out.agreement / out.agreement_count[:, None]).float().double()
    torch.testing.assert_close(heads.measured_agreement(), rates)


def test_the_objective_picks_its_backward_for_the_strategy_and_can_train_the_heads_alone(tmp_path, monkeypatch):
    from trainer.methods.draft_model.pretrain import causal_lm_flops_per_token
    from trainer.methods.mtp_heads.objective import ParallelMTPHeads, mtp_flops_per_token

    tiny_llama(7, vocab=VOCAB, hidden=32, layers=3).save_pretrained(tmp_path / "model")
    objective = ParallelMTPHeads(target=str(tmp_path / "model"), num_heads=3, train="heads", target_dtype="float64")
    trained = {n for n, p in objective.mtp.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("heads.") for n in trained)
    assert objective.backward_mode() == "sequential"
    monkeypatch.setattr(ParallelMTPHeads, "weights_are_sharded", lambda self: True)
    assert objective.backward_mode() == "checkpoint"  # auto under ZeRO-3 / FSDP2
    objective.head_backward = "sequential"
    with pytest.raises(ValueError, match="head_backward=sequential reads whole parameters"):
        objective.backward_mode()
    plain = causal_lm_flops_per_token(objective.mtp.model, 64)
    assert mtp_flops_per_token(objective.mtp, 64) > 1.5 * plain  # two more layers and unembeddings
    with pytest.raises(ValueError, match="either model.target .* or model.target_config"):
        ParallelMTPHeads(target=str(tmp_path / "model"), target_config={"hidden_size": 8})
