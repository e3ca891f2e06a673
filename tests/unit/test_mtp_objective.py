"""SequentialMTP: the loss of every mode against a plain reference (full logits, F.cross_entropy, module k scored on
the token k + 2 ahead), the lambda schedule by tokens seen, what each mode trains and freezes, the modules owning no
head or embedding, and the bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import tiny_llama, tiny_model
from trainer.methods.mtp.module import MTPConfig, MTPDrafter, MTPModules
from trainer.methods.mtp.objective import SequentialMTP, mtp_weight


def saved_trunk(path, family: str = "llama"):
    """A tiny float64 trunk saved (float32 on load) where FrozenTarget reads it; returns (path, model)."""
    model = (
        tiny_llama(0, vocab=64, hidden=32, layers=2) if family == "llama" else tiny_model("deepseek_v3", 0, vocab=64)
    )
    model.save_pretrained(path)
    return str(path), model


def batch(vocab: int = 64, B: int = 2, S: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(0, vocab, (B, S + 1), generator=g)
    labels = row[:, 1:].clone()
    labels[0, :3] = -100  # untrained labels (e.g. a prompt)
    return {"input_ids": row[:, :-1], "labels": labels, "loss_mask": labels != -100}


def reference_mtp_losses(mtp: MTPModules, trunk, ids, labels) -> list[torch.Tensor]:
    """Each depth's mean cross entropy from full logits: module k at index i predicts token i + k + 2, which is
    labels[i + k + 1]."""
    with torch.no_grad():
        out = trunk(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # the final normed output
    losses = []
    for k, block_out in mtp.unroll(hidden, ids, trunk.get_input_embeddings()):
        logits = trunk.lm_head(mtp.head_input(k, block_out))  # [B, S - k - 1, V]
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), labels[:, k + 1 :].flatten(), ignore_index=-100))
    return losses


@pytest.mark.parametrize("depth", [1, 2])
def test_refresh_loss_is_the_mean_of_the_depths(depth, tmp_path, one_thread):
    path, _ = saved_trunk(tmp_path / "trunk")
    objective = SequentialMTP(mode="refresh", mtp_depth=depth, target=path, load_target_modules=False)
    data = batch()
    loss, metrics = objective.compute_loss(data)
    trunk = objective.target.model
    expected = reference_mtp_losses(objective.drafter.mtp, trunk, data["input_ids"], data["labels"])
    torch.testing.assert_close(loss, torch.stack(expected).mean(), rtol=1e-5, atol=1e-6)
    for k, value in enumerate(expected, 1):
        torch.testing.assert_close(metrics[f"mtp_loss_{k}"], value, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert all(p.grad is not None for p in objective.drafter.mtp.parameters())
    assert all(p.grad is None for p in trunk.parameters())  # the model is frozen
    assert objective.drafter_record().target == path
    assert not any(k.startswith("_target") for k in objective.state_dict())  # the frozen model is never saved


def test_pretrain_loss_schedule_and_shared_gradients(tiny_corpus, one_thread):
    """loss = CE_main + lambda * mean_k CE_k; lambda switches once the tokens seen reach the schedule's count; the
    MTP loss trains the trunk, its embedding and its lm_head, which the modules share and never own."""
    objective = SequentialMTP(
        mode="pretrain", mtp_depth=2, tokenizer=tiny_corpus.tokenizer_dir, mtp_weights=[[0, 0.3], [48, 0.1]],
        target_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2},
    )  # fmt: skip
    trunk = objective.drafter.trunk
    vocab = trunk.config.vocab_size
    V, H = trunk.get_output_embeddings().weight.shape
    own = [n for n, p in objective.drafter.mtp.named_parameters() if p.shape in ((V, H), (H, V))]
    assert own == []  # no head or embedding of their own
    data = batch(vocab=vocab, B=2, S=12)  # 24 tokens a step
    weights = []
    for _ in range(3):
        loss, metrics = objective.compute_loss(data)
        weights.append(float(metrics["mtp_weight"]))
        main = F.cross_entropy(trunk(input_ids=data["input_ids"]).logits.flatten(0, 1), data["labels"].flatten())
        mtp = torch.stack(reference_mtp_losses(objective.drafter.mtp, trunk, data["input_ids"], data["labels"])).mean()
        torch.testing.assert_close(loss, main + weights[-1] * mtp, rtol=1e-5, atol=1e-6)
    assert weights == pytest.approx([0.3, 0.3, 0.1]) and int(objective.mtp_tokens_seen) == 72
    assert mtp_weight([(0, 0.3), (10, 0.1)], 9) == 0.3 and mtp_weight([(0, 0.3), (10, 0.1)], 10) == 0.1
    # the MTP term alone reaches the trunk, its embedding and its lm_head
    trunk.zero_grad()
    h = trunk.get_decoder()(input_ids=data["input_ids"]).last_hidden_state
    mtp = objective.drafter.mtp
    losses = []
    for k, out in mtp.unroll(h, data["input_ids"], trunk.get_input_embeddings()):
        logits = trunk.lm_head(mtp.head_input(k, out))  # [B, S - k - 1, V]
        losses.append(F.cross_entropy(logits.flatten(0, 1), data["labels"][:, k + 1 :].flatten()))
    sum(losses).backward()
    assert trunk.lm_head.weight.grad.abs().sum() > 0 and trunk.get_input_embeddings().weight.grad.abs().sum() > 0
    assert trunk.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    record = objective.drafter_record()
    assert record.kind == "mtp" and set(record.components) == {"mtp", "trunk"} and record.target is None


def test_pretraining_a_soft_capping_trunk_scores_its_own_logits(tiny_corpus, one_thread):
    """A Gemma-2 trunk soft-caps its logits in its forward: the main loss is on them; the modules' logits go through
    the bare lm_head, as the engines' MTP modules and the proposer compute theirs."""
    objective = SequentialMTP(
        mode="pretrain", mtp_depth=1, tokenizer=tiny_corpus.tokenizer_dir, model_type="gemma2",
        target_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 8, "final_logit_softcapping": 0.5},
    )  # fmt: skip
    trunk = objective.drafter.trunk
    with torch.no_grad():
        trunk.get_output_embeddings().weight.mul_(30.0)  # logits large enough for the cap to matter
    data = batch(vocab=trunk.config.vocab_size, B=2, S=12)
    _, metrics = objective.compute_loss(data)
    with torch.no_grad():
        logits = trunk(input_ids=data["input_ids"]).logits  # [B, S, V], soft-capped
        bare = trunk.lm_head(trunk.get_decoder()(input_ids=data["input_ids"]).last_hidden_state)  # [B, S, V]
    main = F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten())
    torch.testing.assert_close(metrics["main_loss"], main, rtol=1e-5, atol=1e-6)
    assert abs(float(F.cross_entropy(bare.flatten(0, 1), data["labels"].flatten())) - float(main)) > 0.1 * float(main)
    mtp = torch.stack(reference_mtp_losses(objective.drafter.mtp, trunk, data["input_ids"], data["labels"])).mean()
    torch.testing.assert_close(metrics["mtp_loss"], mtp, rtol=1e-5, atol=1e-6)


def test_pretraining_starts_from_the_tiny_targets_initial_weights(tiny_corpus):
    """With the same seed and shape, the trunk starts as recipes/quickstart/tiny_target.yaml's model: the held-out
    losses of the two runs compare (README, MTP)."""
    from trainer.methods.draft_model.pretrain import CausalLMPretraining

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4}  # fmt: skip
    plain = CausalLMPretraining(tokenizer=tiny_corpus.tokenizer_dir, **shape).model.state_dict()
    trunk = SequentialMTP(mode="pretrain", tokenizer=tiny_corpus.tokenizer_dir, target_config=shape).drafter.trunk
    assert plain.keys() == trunk.state_dict().keys()
    assert all(torch.equal(value, trunk.state_dict()[name]) for name, value in plain.items())


def test_extend_copies_module_one_and_trains_only_the_new_modules(tmp_path, one_thread):
    path, _ = saved_trunk(tmp_path / "trunk")
    refresh = SequentialMTP(mode="refresh", mtp_depth=1, target=path, load_target_modules=False)
    ckpt = tmp_path / "refresh.ckpt"
    torch.save({"state_dict": refresh.state_dict(), "drafter": refresh.drafter_record().to_dict()}, ckpt)
    objective = SequentialMTP(mode="extend", mtp_depth=3, target=path, init_from=str(ckpt))
    layers = objective.drafter.mtp.layers
    source = refresh.drafter.mtp.layers[0].state_dict()
    for layer in layers:  # every module starts as module 1
        for name, value in layer.state_dict().items():
            torch.testing.assert_close(value, source[name], rtol=0, atol=0)
    assert not any(p.requires_grad for p in layers[0].parameters())
    assert all(p.requires_grad for layer in layers[1:] for p in layer.block.parameters())
    assert layers[2].eh_proj is layers[0].eh_proj  # the mtp.* layout's one fc, frozen with module 1
    data = batch()
    loss, metrics = objective.compute_loss(data)
    assert set(k for k in metrics if k.startswith("mtp_loss_")) == {"mtp_loss_2", "mtp_loss_3"}
    expected = reference_mtp_losses(objective.drafter.mtp, objective.target.model, data["input_ids"], data["labels"])
    torch.testing.assert_close(loss, torch.stack(expected[1:]).mean(), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert all(p.grad is None for p in layers[0].parameters())
    assert all(p.grad is not None for p in layers[2].block.parameters())


def test_trunk_hidden_is_an_explicit_choice(tmp_path, one_thread):
    """Module 1 reads the trunk's hidden state after the final norm by default (what the engines feed) or, when asked,
    before it: the pre-norm hidden state the objective captures is the decoder's input to its final norm."""
    path, _ = saved_trunk(tmp_path / "trunk")
    after = SequentialMTP(mode="refresh", target=path, load_target_modules=False)
    before = SequentialMTP(mode="refresh", target=path, load_target_modules=False, trunk_hidden="before_norm")
    assert after.drafter.config.trunk_hidden == "after_norm" and before.drafter.config.trunk_hidden == "before_norm"
    ids = batch()["input_ids"]
    post, pre = before._trunk_states(ids)
    decoder = before.target.model.get_decoder()
    torch.testing.assert_close(decoder.norm(pre), post, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(pre, post)
    assert after.drafter_record().target_layers == [2] and before.drafter_record().target_layers == [-1]


def test_defaults_follow_the_architecture(tmp_path):
    llama = MTPConfig.for_trunk(tiny_llama(0).config, 1)
    deepseek = MTPConfig.for_trunk(tiny_model("deepseek_v3", 0).config, 1)
    assert (llama.layout, llama.trunk_hidden, llama.step_hidden, llama.zero_first_position) == (
        "qwen3_next", "after_norm", "after_norm", False,
    )  # fmt: skip
    assert (deepseek.layout, deepseek.trunk_hidden, deepseek.step_hidden, deepseek.zero_first_position) == (
        "nextn", "after_norm", "before_norm", True,
    )  # fmt: skip
    block = MTPDrafter(deepseek).mtp.layers[0].block
    assert type(block).__name__ == "DeepseekV3DecoderLayer" and block.self_attn.layer_idx == 3  # index N


def test_bad_input_is_named(tmp_path, tiny_corpus):
    path, _ = saved_trunk(tmp_path / "trunk")
    with pytest.raises(ValueError, match="mtp_depth must be >= 1, got 0"):
        SequentialMTP(mode="refresh", mtp_depth=0, target=path)
    with pytest.raises(ValueError, match=r"MTP depth \(mtp_depth\) must be >= 1, got 0"):
        MTPConfig.for_trunk(tiny_llama(0).config, 0)
    with pytest.raises(ValueError, match="mtp_depth must be >= 2, got 1"):
        SequentialMTP(mode="extend", mtp_depth=1, target=path)
    with pytest.raises(ValueError, match="holds no MTP modules"):
        SequentialMTP(mode="extend", mtp_depth=2, target=path)
    with pytest.raises(ValueError, match="needs model.target"):
        SequentialMTP(mode="refresh")
    with pytest.raises(ValueError, match=r"\['hidden_sise'\] are not keys of a llama config"):
        SequentialMTP(mode="pretrain", tokenizer=tiny_corpus.tokenizer_dir, target_config={"hidden_sise": 8})
    with pytest.raises(ValueError, match="increasing tokens"):
        SequentialMTP(mode="refresh", target=path, mtp_weights=[[10, 0.3], [5, 0.1]])
