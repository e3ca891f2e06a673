"""EAGLE-3 from target shards (``target_signals: shards``): the same training as online at k = V, a vocabulary map
counted from the shards equal to the online one, refusals of the wrong data, and a target model that is never built.

Choice for the equality test: the shards hold all 512 log-probabilities in float32 and the aux layers' hidden states
in float32 (``hidden_dtype: float32``), so the offline step sees the online step's features exactly and its soft
labels up to float32 rounding (exp of log_softmax, renormalised over the draft vocabulary, against a softmax over it):
the losses agree to 1e-4 relative over the steps, as offline and online KD do in test_shards.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from tests.integration.test_shards import losses, record, text_data
from tests.recipe_runs import fit, merge, trainer_overrides
from trainer.checkpoints.reading import load_training_checkpoint
from trainer.data.precompute import main as precompute_main
from trainer.data.shard_datamodule import ShardDataModule
from trainer.data.text import TextDataModule
from trainer.methods.eagle3.objective import Eagle3
from trainer.methods.eagle3.vocab_map import count_label_tokens, vocab_map_from_rows
from trainer.models.target import FrozenTarget, TargetEmbeddings
from trainer.training.objective import count_params

AUX = [0, 1, 2]  # the tiny target has 2 layers: hidden_states 0..2
MODEL = {"draft_vocab_size": 256, "ttt_steps": 3, "target_layers": AUX}


def data(corpus) -> dict:
    """The test's text data: one training document (94 rows of 64 tokens), in order."""
    return text_data(corpus, max_documents=1)


def run_precompute(corpus, target: Path, out: Path, *args: str) -> int:
    """``draftsmith precompute`` of the training split of :func:`data`."""
    argv = [
        "--target",
        str(target),
        "--output_dir",
        str(out),
        "--data",
        json.dumps(data(corpus)),
        "--progress",
        "false",
    ]
    return precompute_main([*argv, "--splits", '["train"]', *args])


@pytest.fixture(scope="module")
def eagle3_shards(tiny_corpus, tiny_target, tmp_path_factory):
    """Shards of the test data at k = V with float32 log-probabilities and float32 hidden states of the aux layers."""
    out = tmp_path_factory.mktemp("shards_eagle3")
    args = (
        "--top_logprobs",
        "512",
        "--logprob_dtype",
        "float32",
        "--hidden_layers",
        str(AUX),
        "--hidden_dtype",
        "float32",
    )
    assert run_precompute(tiny_corpus, tiny_target, out, *args, "--samples_per_shard", "48", "--batch_size", "4") == 0
    return out


def shard_data(corpus, shards: Path, **extra) -> dict:
    init = {"shards": str(shards), "tokenizer": str(corpus.tokenizer_dir), "batch_size": 4, "num_workers": 0}
    init.update({"shuffle_shards": False, "shuffle_buffer": 0, "hidden_layers": AUX, **extra})  # data-set order
    return {"data": {"init_args": init}}


def offline_override(run: Path, corpus, target: Path, shards: Path, steps: int, callbacks=(), **data) -> dict:
    override = merge(
        trainer_overrides(run, max_steps=steps, every_n=steps),
        shard_data(corpus, shards, **data),
        {"model": {"init_args": {"target": str(target), **MODEL}}},
    )
    override["trainer"]["callbacks"] += list(callbacks)
    return override


@pytest.mark.slow
def test_offline_eagle3_at_full_vocabulary_follows_the_online_loss(tiny_corpus, tiny_target, eagle3_shards, tmp_path):
    steps = 5
    online = tmp_path / "online"
    override = merge(
        trainer_overrides(online, max_steps=steps, every_n=steps),
        {"data": data(tiny_corpus)},
        {"model": {"init_args": {"target": str(tiny_target), **MODEL}}},
    )
    override["trainer"]["callbacks"].append(record(online))
    online_cli = fit("quickstart/eagle3.yaml", override, online)

    offline = tmp_path / "offline"
    override = offline_override(offline, tiny_corpus, tiny_target, eagle3_shards, steps, [record(offline)])
    offline_cli = fit("quickstart/eagle3_offline.yaml", override, offline)

    a, b = torch.tensor(losses(online)), torch.tensor(losses(offline))
    assert len(a) == len(b) == steps, (a, b)
    assert float(a.max() - a.min()) > 1e-2, a  # a moving trajectory, not one repeated value
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=lambda m: f"{m}\nonline {a}\noffline {b}")
    # the same draft vocabulary, counted from the shards' training tokens
    assert torch.equal(offline_cli.model.drafter.d2t, online_cli.model.drafter.d2t)
    assert isinstance(offline_cli.model.target, TargetEmbeddings)
    state, record_ = load_training_checkpoint(str(offline / "checkpoints" / "last.ckpt"))
    assert all(k.startswith("drafter.") for k in state) and record_["config"]["aux_layers"] == AUX


@pytest.mark.slow
def test_the_vocabulary_counted_from_shards_is_the_online_one(tiny_corpus, tiny_target, eagle3_shards):
    text = TextDataModule(**data(tiny_corpus)["init_args"])
    text.setup("fit")
    rows = text.train_dataset
    shards = ShardDataModule(str(eagle3_shards), hidden_layers=AUX)
    # the counts themselves, so that a label shifted by one position (first vs last token of a row) would show
    torch.testing.assert_close(
        count_label_tokens(shards.training_rows(chunk_rows=50), 512),
        count_label_tokens([(rows.ids, rows.trained)], 512),
        rtol=0,
        atol=0,
    )
    expected = vocab_map_from_rows([(rows.ids, rows.trained)], 512, 256)
    objective = Eagle3(str(tiny_target), target_signals="shards", **MODEL)
    objective.install_vocab_map(shards.training_rows())
    assert torch.equal(objective.drafter.d2t, expected[0]) and torch.equal(objective.drafter.t2d, expected[1])
    # the draft lm_head starts from the target's lm_head rows of the draft vocabulary
    with safe_open(str(Path(tiny_target) / "model.safetensors"), framework="pt") as f:
        head = f.get_tensor("lm_head.weight")
    torch.testing.assert_close(objective.drafter.lm_head.weight, head[objective.drafter.draft_ids()], rtol=0, atol=0)


@pytest.mark.slow
def test_wrong_data_is_refused(tiny_corpus, tiny_target, eagle3_shards, tmp_path):
    # data.hidden_layers in another order than the aux layers
    run = tmp_path / "order"
    with pytest.raises(
        ValueError, match=r"hidden_layers=\[2, 1, 0\] must equal the drafter's target_layers \[0, 1, 2\]"
    ):
        fit("quickstart/eagle3_offline.yaml", offline_override(run, tiny_corpus, tiny_target, eagle3_shards, 1,
            hidden_layers=[2, 1, 0]), run)  # fmt: skip

    # shards that do not hold every aux layer
    partial = tmp_path / "shards_01"
    args = ("--top_logprobs", "8", "--hidden_layers", "[0, 1]", "--samples_per_shard", "256", "--batch_size", "8")
    assert run_precompute(tiny_corpus, tiny_target, partial, *args) == 0
    run = tmp_path / "missing"
    with pytest.raises(ValueError, match=r"hidden_layers \[2\] not stored \(the shards hold \[0, 1\]\)"):
        fit("quickstart/eagle3_offline.yaml", offline_override(run, tiny_corpus, tiny_target, partial, 1), run)

    # text data with target_signals: shards
    run = tmp_path / "text"
    override = merge(
        trainer_overrides(run, max_steps=1, every_n=1),
        {"data": data(tiny_corpus)},
        {"model": {"init_args": {"target": str(tiny_target), "target_signals": "shards", **MODEL}}},
    )
    with pytest.raises(ValueError, match="target_signals=shards needs data: .*ShardDataModule, got TextDataModule"):
        fit("quickstart/eagle3.yaml", override, run)


def tiny_llama(path: Path, tied: bool, **save) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, **save)
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_shards_mode_reads_two_tensors_and_never_builds_the_target(tied, tmp_path, monkeypatch):
    # a sharded checkpoint (model.safetensors.index.json) for the untied target, a single file for the tied one
    model = tiny_llama(tmp_path / "target", tied, **({} if tied else {"max_shard_size": "10KB"}))
    assert (tmp_path / "target" / "model.safetensors.index.json").is_file() != tied

    def no_models(*args, **kwargs):
        raise AssertionError("a transformers model was built")

    monkeypatch.setattr(PreTrainedModel, "__init__", no_models)
    objective = Eagle3(str(tmp_path / "target"), target_signals="shards", draft_vocab_size=32, target_layers=[1, 2])
    target = objective.target
    assert isinstance(target, TargetEmbeddings) and not isinstance(target, FrozenTarget)
    assert not any(isinstance(m, PreTrainedModel) for m in objective.modules())
    assert all(k.startswith("drafter.") for k in objective.state_dict())
    # what it holds is the embedding and the lm_head (one tensor when tied), equal to the model's
    assert sum(t.numel() for t in target.tensors()) == (1 if tied else 2) * 64 * 16
    torch.testing.assert_close(target.embedding, model.get_input_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(target.lm_head_weight, model.get_output_embeddings().weight, rtol=0, atol=0)
    assert (target.lm_head_weight is target.embedding) == tied and not target.embedding.requires_grad
    assert target.vocab_size == 64 and target.num_layers == 2
    assert objective.flops_per_token() == 3.0 * 2.0 * count_params(objective.drafter) * objective.ttt_steps

    # a compute_loss step on a synthetic shard batch: fused features and embeddings from the batch and the tensors
    g = torch.Generator().manual_seed(0)
    objective.drafter.set_vocab_map(torch.full((32,), 32, dtype=torch.long), torch.arange(64) >= 32)
    logprobs = torch.log_softmax(torch.randn(2, 8, 64, generator=g), -1).topk(4, dim=-1)
    batch = {
        "input_ids": torch.randint(0, 64, (2, 8), generator=g),
        "loss_mask": torch.ones(2, 8, dtype=torch.bool),
        "teacher_topk_ids": logprobs.indices.to(torch.int32),  # [B, S, k]
        "teacher_topk_logprobs": logprobs.values,  # [B, S, k]
        "teacher_hidden": torch.randn(2, 2, 8, 16, generator=g),  # [B, n, S, H]
    }
    loss, metrics = objective.compute_loss(batch)
    assert torch.isfinite(loss) and float(loss) > 0 and {"acc_0", "loss_2"} <= set(metrics)
    loss.backward()
    assert objective.drafter.fc.weight.grad is not None
    # positions none of whose top-k ids is in the draft vocabulary (ids 32..63) carry no soft label: nothing trained
    batch["teacher_topk_ids"] = torch.arange(4, dtype=torch.int32).expand(2, 8, 4)
    assert float(objective.compute_loss(batch)[0]) == 0.0


@pytest.mark.parametrize("labels,ttt_inputs", [("soft", "predicted"), ("argmax", "data")])
def test_a_shard_step_equals_the_online_step_at_full_vocabulary(labels, ttt_inputs, tmp_path):
    """One compute_loss on a batch made of the target's own outputs (k = V): the same loss and metrics."""
    tiny_llama(tmp_path / "target", tied=False)
    options = {
        "draft_vocab_size": 32,
        "target_layers": [0, 2],
        "ttt_steps": 3,
        "labels": labels,
        "ttt_inputs": ttt_inputs,
    }
    online = Eagle3(str(tmp_path / "target"), **options)
    offline = Eagle3(str(tmp_path / "target"), target_signals="shards", **options)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 64, (4, 13), generator=g).numpy()  # [R, S + 1]
    for objective in (online, offline):
        objective.build_vocab_map(rows, rows > 8)
    assert torch.equal(online.drafter.lm_head.weight, offline.drafter.lm_head.weight)
    ids = torch.from_numpy(rows[:, :-1]).long()  # [B, S]
    out = online.target(ids, hidden_layers=[0, 2])
    top = torch.log_softmax(out.logits.float(), dim=-1).topk(64, dim=-1)  # [B, S, V] each
    batch = {
        "input_ids": ids,
        "loss_mask": torch.from_numpy(rows[:, 1:] > 8),
        "teacher_topk_ids": top.indices.to(torch.int32),
        "teacher_topk_logprobs": top.values,
        "teacher_hidden": torch.stack(out.hidden_states, dim=1),  # [B, n, S, H]
    }
    (a, metrics_a), (b, metrics_b) = online.compute_loss(batch), offline.compute_loss(batch)
    assert float(a) > 0
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    assert metrics_a.keys() == metrics_b.keys()
    for name in metrics_a:
        torch.testing.assert_close(metrics_b[name], metrics_a[name], rtol=1e-5, atol=0)


def test_a_missing_tensor_is_named(tmp_path):
    tiny_llama(tmp_path / "target", tied=False)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "target" / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tmp_path / "target" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"target '.*target'.*no tensor named 'lm_head.weight'"):
        TargetEmbeddings.from_pretrained(str(tmp_path / "target"))
    (tmp_path / "target" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"target '.*target': no model.safetensors"):
        TargetEmbeddings.from_pretrained(str(tmp_path / "target"))
