"""Medusa: the losses of both stages against naive full-logit formulas, the heads' initialisation, both exports read
back by their engines' rules, and lossless chain and tree drafting."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tests.helpers import tiny_llama, tiny_scaled_model
from trainer.decoding.generate import speculative_generate
from trainer.decoding.head_tree import MEDUSA_SPARSE_TREE
from trainer.decoding.proposers import NoProposer
from trainer.methods.medusa.export import (
    TGI_WEIGHTS,
    VLLM_WEIGHTS,
    load_tgi,
    load_vllm,
    save_tgi,
    save_vllm,
    vllm_config_keys,
)
from trainer.methods.medusa.module import MedusaConfig, MedusaDrafter
from trainer.methods.medusa.objective import Medusa, shifted, warmup_factor
from trainer.methods.medusa.proposer import MedusaProposer
from trainer.training.registry import load_drafter, recognise

pytestmark = pytest.mark.usefixtures("one_thread")
V, H = 48, 16


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("medusa") / "target"
    tiny_llama(0, vocab=V, hidden=H, layers=2, dtype=torch.float32).save_pretrained(path)
    return path


def batch(seed: int = 0, B: int = 2, S: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S + 1), generator=g)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :3] = False  # an untrained prompt
    labels = torch.where(mask, ids[:, 1:], -100)
    return {"input_ids": ids[:, :-1], "labels": labels, "loss_mask": mask}


def randomise(heads: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


def move_away(model: nn.Module, seed: int) -> None:
    """What training does to Medusa-2's target: every weight moved away from the original's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def naive_head_loss(model: Medusa, hidden: torch.Tensor, labels: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Every head's full logits at once, cross entropy against the label 1 + k positions later."""
    heads, total = model.drafter.heads, 0.0
    logits = heads(hidden)  # [B, S, K, V]
    for k, w in enumerate(weights):
        target = torch.full_like(labels, -100)
        target[:, : labels.shape[1] - 1 - k] = labels[:, 1 + k :]
        total = total + w * F.cross_entropy(logits[:, :, k].flatten(0, 1), target.flatten(), ignore_index=-100)
    return total


@pytest.mark.parametrize("labels", ["data", "argmax"])
def test_stage1_loss_is_the_decayed_sum_of_head_cross_entropies(target_dir, labels) -> None:
    model = Medusa(str(target_dir), num_heads=3, num_layers=2, labels=labels, loss_chunk_size=5)
    randomise(model.drafter.heads, 1)
    b = batch(1)
    loss, metrics = model.compute_loss(b)
    target = model.target.model
    with torch.no_grad():
        out = target(b["input_ids"], output_hidden_states=True)
    hidden = out.hidden_states[-1]  # [B, S, H]: HF's last hidden state is the final normed one
    expected_labels = b["labels"] if labels == "data" else torch.where(b["loss_mask"], out.logits.argmax(-1), -100)
    expected = naive_head_loss(model, hidden, expected_labels, [1.0, 0.8, 0.64])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert {"acc_0", "acc_2", "loss_1"} <= set(metrics) and "lm" not in metrics
    assert not any(p.grad is not None for p in target.parameters())


def naive_head_kls(model: Medusa, hidden: torch.Tensor, frozen_logits: torch.Tensor, labels: torch.Tensor) -> list:
    """Head k's mean forward KL from the frozen model's distribution 1 + k positions later, over the positions whose
    token t + 2 + k is trained, from every head's full logits (float64, differentiable)."""
    logits = model.drafter.heads(hidden)  # [B, S, K, V]
    kls = []
    for k in range(logits.shape[2]):
        kept = shifted(labels, k) != -100  # [B, S]
        log_p = F.pad(frozen_logits[:, 1 + k :], (0, 0, 0, 1 + k)).double().log_softmax(-1)  # [B, S, V]
        log_q = logits[:, :, k].double().log_softmax(-1)  # [B, S, V]
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1)[kept].mean())
    return kls


def test_heads_learning_the_original_are_scored_by_their_kl_to_it_at_both_stages(target_dir) -> None:
    """``labels: original``: head k's loss is its KL from the frozen target's distribution at t + 1 + k (stage 1), or
    the frozen original's with Medusa-2's self-distillation (stage 2, the trained target moved away from it), with
    autograd's gradients through the naive formula."""
    b = batch(5)
    ids = b["input_ids"]
    model = Medusa(str(target_dir), num_heads=3, num_layers=1, labels="original", loss_chunk_size=5)
    randomise(model.drafter.heads, 6)
    with torch.no_grad():
        out = model.target.model(ids, output_hidden_states=True)
    kls = naive_head_kls(model, out.hidden_states[-1], out.logits, b["labels"])
    loss, metrics = model.compute_loss(b)
    for k, kl in enumerate(kls):
        torch.testing.assert_close(metrics[f"loss_{k}"].double(), kl, rtol=1e-4, atol=1e-7)
    expected = sum(w * kl for w, kl in zip([1.0, 0.8, 0.64], kls))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-7)
    grads = torch.autograd.grad(loss, list(model.drafter.heads.parameters()))
    reference = torch.autograd.grad(expected, list(model.drafter.heads.parameters()))
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)
    stage2 = Medusa(str(target_dir), num_heads=2, stage=2, self_distillation=True, labels="original", loss_chunk_size=5)
    randomise(stage2.drafter.heads, 7)
    move_away(stage2.drafter.model, 8)
    _, metrics = stage2.compute_loss(b)
    with torch.no_grad():
        trained_hidden = stage2.drafter.model(ids, output_hidden_states=True).hidden_states[-1]  # [B, S, H]
        original_logits = stage2.original.model(ids).logits  # [B, S, V]
        kls = naive_head_kls(stage2, trained_hidden, original_logits, b["labels"])
    for k, kl in enumerate(kls):
        torch.testing.assert_close(metrics[f"loss_{k}"].double(), kl, rtol=1e-4, atol=1e-7)


def test_labels_shift_and_heads_start_from_the_target_head(target_dir, caplog) -> None:
    labels = torch.arange(6)[None]
    assert shifted(labels, 0).tolist() == [[1, 2, 3, 4, 5, -100]]
    assert shifted(labels, 2).tolist() == [[3, 4, 5, -100, -100, -100]]
    model = Medusa(str(target_dir), num_heads=2)
    heads, target = model.drafter.heads, model.target.model
    assert all(float(layer.weight.detach().abs().sum()) == 0 for block in heads.blocks for layer in block.layers)
    hidden = torch.randn(3, H)
    shift = F.silu(heads.blocks[1].layers[0].bias)  # W = 0: the block adds SiLU(b), b at nn.Linear's default init
    with torch.no_grad():
        torch.testing.assert_close(heads(hidden)[:, 1], target.lm_head(hidden + shift), rtol=1e-6, atol=1e-6)
    tied = tiny_llama(1, vocab=V, hidden=H, dtype=torch.float32, tie_word_embeddings=True)
    tied.save_pretrained(target_dir.parent / "tied")
    with caplog.at_level("INFO", logger="trainer.methods.medusa.objective"):
        heads = Medusa(str(target_dir.parent / "tied"), num_heads=2).drafter.heads  # a tied target: the embedding
    torch.testing.assert_close(heads.lm_heads[0].weight, tied.get_input_embeddings().weight, rtol=0, atol=0)
    assert "ties its input embedding and lm_head" in caplog.text  # the user is told how the heads start


def test_stage2_trains_the_target_with_self_distillation_and_faster_heads(target_dir) -> None:
    model = Medusa(
        str(target_dir), num_heads=2, stage=2, self_distillation=True, heads_warmup="sine", heads_warmup_steps=4
    )
    b = batch(2)
    loss, metrics = model.compute_loss(b)
    assert float(metrics["lm"]) == pytest.approx(0.0, abs=1e-6)  # the trained target starts as the original
    # at step 0 the heads' weight has not risen yet: the loss is the target's alone
    torch.testing.assert_close(loss, metrics["lm"].to(loss.dtype), rtol=0, atol=0)
    assert warmup_factor(2, 4, "sine") == pytest.approx(2**-0.5) and warmup_factor(1, 4, "linear") == 0.25
    assert [(m, mult) for m, mult in model.lr_groups()] == [(model.drafter.model, 1.0), (model.drafter.heads, 4.0)]
    # a subset: only the last layer and the final norm train
    subset = Medusa(str(target_dir), num_heads=2, stage=2, trained_target_layers=1)
    trained = {n for n, p in subset.drafter.model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(("model.layers.1.", "model.norm.")) for n in trained)
    loss, metrics = subset.compute_loss(b)
    loss.backward()
    assert subset.drafter.model.model.layers[1].mlp.up_proj.weight.grad is not None
    assert subset.drafter.model.model.layers[0].mlp.up_proj.weight.grad is None
    assert subset.drafter.heads.lm_heads[0].weight.grad is not None


def test_stage2_target_loss_is_on_a_soft_capping_targets_own_logits(tmp_path) -> None:
    """Gemma-2 soft-caps its logits in its forward: the trained target's next-token loss, and its KL from the frozen
    original with self-distillation, are those of both forwards' logits."""
    gemma2 = tiny_scaled_model("gemma2", vocab=V, final_logit_softcapping=2.0)
    with torch.no_grad():
        gemma2.get_output_embeddings().weight.mul_(30.0)  # logits large enough for the cap to matter
    gemma2.float().save_pretrained(tmp_path / "gemma2")
    b = batch(3)
    ids, mask = b["input_ids"], b["loss_mask"]
    plain = Medusa(str(tmp_path / "gemma2"), num_heads=2, stage=2, loss_chunk_size=5)
    _, metrics = plain.compute_loss(b)
    with torch.no_grad():
        logits = plain.drafter.model(ids).logits  # [B, S, V], soft-capped
    expected = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
    torch.testing.assert_close(metrics["lm"], expected, rtol=1e-5, atol=1e-6)
    distilled = Medusa(str(tmp_path / "gemma2"), num_heads=2, stage=2, self_distillation=True, loss_chunk_size=5)
    move_away(distilled.drafter.model, 4)
    _, metrics = distilled.compute_loss(b)
    with torch.no_grad():
        log_p = distilled.original.model(ids).logits.double().log_softmax(-1)  # [B, S, V]
        log_q = distilled.drafter.model(ids).logits.double().log_softmax(-1)  # [B, S, V]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)[mask].mean()
    assert float(kl) > 1e-3
    torch.testing.assert_close(metrics["lm"].double(), kl, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"stage": 2, "target_dtype": "float16"}, "float16 cannot hold"),
        ({"stage": 1, "self_distillation": True}, "stage 2 only"),
        ({"stage": 2, "trained_target_layers": 5}, "must be in 1..2"),
        ({"num_heads": 0}, "num_heads"),
        ({"stage": 2, "target_signals": "shards"}, "shards cannot"),
        ({"stage": 2, "labels": "original"}, "labels=original .* self_distillation: true"),
        ({"labels": "original", "target_signals": "shards"}, "labels=original .* target_signals: online"),
    ],
)
def test_bad_settings_are_named(target_dir, settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        Medusa(str(target_dir), **settings)


def drafter(seed: int, heads: int = 3, layers: int = 2, bias: bool = True) -> MedusaDrafter:
    d = MedusaDrafter(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=heads, num_layers=layers, bias=bias))
    randomise(d.heads, seed)  # every block of every head different: untied
    return d


@pytest.mark.parametrize("bias", [True, False])
def test_vllm_export_round_trip_by_vllms_rules(tmp_path, bias) -> None:
    original = drafter(3, bias=bias)
    save_vllm(original, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["medusa_fc_bias"] is bias
    assert vllm_config_keys(config)["num_heads"] == 3 and vllm_config_keys(config)["num_hidden_layers"] == 2
    assert set(load_file(tmp_path / VLLM_WEIGHTS)) == set(original.heads.state_dict())
    reloaded = load_vllm(str(tmp_path))
    hidden = torch.randn(5, H)
    torch.testing.assert_close(reloaded.heads(hidden), original.heads(hidden), rtol=0, atol=0)
    assert recognise(tmp_path)[1].name == "medusa"
    # vLLM built with fewer heads than the file holds drops the rest silently: the loader refuses it
    with pytest.raises(ValueError, match="not consumed"):
        load_vllm(str(tmp_path), num_speculative_tokens=2)
    config["num_attention_heads"] = 4  # a target key would be renamed to num_heads by vLLM
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'num_heads' and 'num_attention_heads' both become 'num_heads'"):
        load_vllm(str(tmp_path))


@pytest.mark.parametrize("bias", [True, False])
def test_tgi_export_round_trip_by_tgis_rules(tmp_path, bias) -> None:
    original = drafter(4, bias=bias)
    save_tgi(original, str(tmp_path), base_model="some/target")
    config = json.loads((tmp_path / "config.json").read_text())
    assert "architectures" not in config and config["medusa_num_layers"] == 2
    tensors = load_file(tmp_path / TGI_WEIGHTS)
    assert {"0.0.linear.weight", "0.1.linear.bias", "2.2.weight"} <= set(tensors)
    reloaded = load_tgi(str(tmp_path))
    hidden = torch.randn(5, H)
    torch.testing.assert_close(reloaded.heads(hidden), original.heads(hidden), rtol=0, atol=0)
    _, record = load_drafter(str(tmp_path))
    assert record.kind == "medusa" and record.target == "some/target"
    config["architectures"] = ["MedusaModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="TGI disables Medusa"):
        load_tgi(str(tmp_path))
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in tensors.items() if k != "1.0.linear.bias"}, str(tmp_path / TGI_WEIGHTS))
    with pytest.raises(ValueError, match="weights missing"):
        load_tgi(str(tmp_path))


@pytest.mark.parametrize("choices", [None, MEDUSA_SPARSE_TREE])
def test_drafting_is_lossless_chain_and_tree(choices) -> None:
    target = tiny_llama(5, vocab=V, hidden=H, layers=2)  # float64
    heads = drafter(6, heads=4).heads.double()
    prompt = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(5))
    reference = speculative_generate(target, prompt, NoProposer(), 1, 30).tokens
    proposer = MedusaProposer(heads, num_layers=2, choices=choices)
    for k in (2, 4):
        assert speculative_generate(target, prompt, proposer, k, 30).tokens == reference
    generator = torch.Generator().manual_seed(0)
    sampled = speculative_generate(target, prompt, proposer, 4, 20, temperature=1.0, generator=generator)
    assert len(sampled.tokens) == 20
