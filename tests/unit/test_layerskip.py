"""LayerSkip: dropout rates and exit scales as defined, the loss against HF's own hidden states, skipped layers that
pass their input through with a zero (not missing) gradient, determinism in the step, the export read back as a
LayerSkip model, and transformers' assistant_early_exit running it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from tests.helpers import tiny_llama
from trainer.decoding.evaluate import resolve_drafter
from trainer.decoding.options import ProposerOptions
from trainer.methods.layerskip.objective import LayerSkip, dropout_rates, exit_scales
from trainer.training.registry import load_drafter, recognise

pytestmark = pytest.mark.usefixtures("one_thread")
V = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("layerskip") / "model"
    tiny_llama(0, vocab=V, hidden=16, layers=4, dtype=torch.float32).save_pretrained(path)
    return path


def batch(seed: int = 0, B: int = 3, S: int = 10) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(B, S, dtype=torch.bool)}


def test_rates_scales_and_curricula() -> None:
    rates = dropout_rates(4, 0.3, "exp")
    assert rates[0] == 0 and rates[-1] == 0  # the last layer is never dropped
    assert rates[1] == pytest.approx(0.3 * (2 ** (1 / 3) - 1)) and rates[2] == pytest.approx(0.3 * (2 ** (2 / 3) - 1))
    assert dropout_rates(5, 0.4, "linear") == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.0])
    scales = exit_scales([0, 1, 3], "sum_l")
    assert scales == pytest.approx([1 / 14, 3 / 14, 10 / 14])  # (l + 1)(l + 2) / 2: 1, 3, 10
    assert math.isclose(sum(exit_scales([2, 5], "inv_l")), 1)


def test_curricula_are_functions_of_the_step(model_dir) -> None:
    rot = LayerSkip(str(model_dir), curriculum="rotational", curriculum_period=2)
    assert [rot.enabled_exits(s) for s in range(3)] == [[0, 2], [1], [0, 2]]
    grad = LayerSkip(str(model_dir), curriculum="gradual", curriculum_steps=6)
    assert [grad.enabled_exits(s) for s in (0, 2, 4, 6)] == [[], [2], [1, 2], [0, 1, 2]]
    model = LayerSkip(str(model_dir), p_max=0.5)
    a, b = model.keep_mask(8, 3, 0), model.keep_mask(8, 3, 0)
    assert torch.equal(a, b) and not torch.equal(a, model.keep_mask(8, 4, 0)) and bool(a[:, -1].all())


def test_loss_without_dropout_is_the_scaled_exit_cross_entropies(model_dir) -> None:
    model = LayerSkip(str(model_dir), early_exit_layers=[0, 2], exit_scale="linear_l", loss_chunk_size=7).eval()
    b = batch(1)
    loss, metrics = model.compute_loss(b)
    hf = model.model
    out = hf(b["input_ids"], output_hidden_states=True)
    norm, head = hf.model.norm, hf.lm_head
    ce = [F.cross_entropy(head(norm(out.hidden_states[n + 1])).flatten(0, 1), b["labels"].flatten()) for n in (0, 2)]
    ce.append(F.cross_entropy(out.logits.flatten(0, 1), b["labels"].flatten()))  # the last layer
    expected = (1 * ce[0] + 3 * ce[1] + 4 * ce[2]) / 8
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert set(metrics) == {"exit_0", "exit_2", "exit_3"}
    # under ZeRO-3 the exits' logits come whole through the lm_head module: the same loss
    whole, _, _, _ = model.net(b["input_ids"], b["labels"], None, [0, 2, 3], [1 / 8, 3 / 8, 4 / 8], whole_logits=True)
    torch.testing.assert_close(whole, loss, rtol=1e-5, atol=1e-6)


def test_a_declared_output_scaling_applies_to_every_exit_and_to_the_kl(tmp_path) -> None:
    """A model whose forward scales its logits after the lm_head (a scale and a soft-cap, declared here on a tiny
    Llama's config: the architectures that have one are not run a layer at a time): every exit's cross entropy and
    the KL from the original are on the scaled logits, chunked or whole."""
    path = tmp_path / "scaled"
    tiny_llama(0, vocab=V, hidden=16, layers=4, dtype=torch.float32, logit_scale=4.0, final_logit_softcapping=1.5
               ).save_pretrained(path)  # fmt: skip
    model = LayerSkip(str(path), early_exit_layers=[0, 2], exit_scale="linear_l", loss_chunk_size=7,
                      target_kl_weight=0.5).eval()  # fmt: skip
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a fine-tune moved the model away from its original
        for p in model.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    b = batch(3)
    loss, metrics = model.compute_loss(b)

    def scaled(logits: torch.Tensor) -> torch.Tensor:  # the declared scaling, by hand
        return 1.5 * torch.tanh(4.0 * logits / 1.5)

    hf = model.model
    with torch.no_grad():
        out = hf(b["input_ids"], output_hidden_states=True)
        original = scaled(model.target.model(b["input_ids"]).logits)  # [B, S, V]
    norm, head = hf.model.norm, hf.lm_head
    exits = [scaled(head(norm(out.hidden_states[n + 1]))) for n in (0, 2)] + [scaled(out.logits)]
    ce = [F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten()) for logits in exits]
    log_p, log_q = F.log_softmax(original, -1), F.log_softmax(exits[-1], -1)  # [B, S, V] each
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()  # every position trained
    assert float(kl) > 1e-3
    torch.testing.assert_close(metrics["target_kl"], kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, (1 * ce[0] + 3 * ce[1] + 4 * ce[2]) / 8 + 0.5 * kl, rtol=1e-5, atol=1e-6)
    # under ZeRO-3 the exits' logits come whole through the lm_head module: the same losses
    target = model.target
    frozen = (target.final_hidden(b["input_ids"]), target.lm_head_weight, b["loss_mask"], target.logit_scaling)
    whole, _, whole_kl, _ = model.net(b["input_ids"], b["labels"], None, [0, 2, 3], [1 / 8, 3 / 8, 4 / 8],
                                   whole_logits=True, original=frozen)  # fmt: skip
    torch.testing.assert_close(whole + 0.5 * whole_kl, loss, rtol=1e-5, atol=1e-6)


def test_a_dropped_layer_passes_its_input_through_with_a_zero_gradient(model_dir) -> None:
    model = LayerSkip(str(model_dir), early_exit_layers=[])
    ids = batch(2)["input_ids"]
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[1, 1] = False  # sample 1 skips layer 1
    keep[:, 2] = False  # every sample skips layer 2
    states = model.run_layers(ids, keep, [])
    decoder = model.model.model
    positions = torch.arange(ids.shape[1])[None]
    h = decoder.embed_tokens(ids[1:2])
    rotary = decoder.rotary_emb(h, position_ids=positions)
    for n in (0, 3):  # sample 1 runs layers 0 and 3 only
        h = decoder.layers[n](h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    torch.testing.assert_close(states[3][1:2], h, rtol=1e-5, atol=1e-6)
    states[3].sum().backward()
    grad = decoder.layers[2].mlp.up_proj.weight.grad
    assert grad is not None and float(grad.abs().sum()) == 0.0  # zero, not missing: no rank waits on it
    assert float(decoder.layers[1].mlp.up_proj.weight.grad.abs().sum()) > 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"p_max": 1.0}, r"p_max must be in \[0, 1\)"),
        ({"early_exit_layers": [1, 3]}, r"\[3\] not layers of the model before its last \(0..2"),
        ({"early_exit_layers": [-1]}, r"\[-1\]"),
    ],
)
def test_bad_settings_are_named(model_dir, settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        LayerSkip(str(model_dir), **settings)


def test_a_model_whose_layers_cannot_be_sliced_is_refused(tmp_path) -> None:
    GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="model type 'gpt2' is not one whose layers"):
        LayerSkip(str(tmp_path / "gpt2"))


def test_the_export_is_a_layerskip_model_that_transformers_runs_with_assistant_early_exit(model_dir, tmp_path) -> None:
    from trainer.methods.layerskip.kind import HF

    model = LayerSkip(str(model_dir), early_exit_layers=[1], p_max=0.2)
    out = HF.write(model.model, model.drafter_record(), tmp_path / "out")
    assert json.loads((out / "layerskip.json").read_text())["early_exit_layers"] == [1]
    kind, fmt = recognise(out)
    assert kind.name == "layerskip"  # not a plain draft model, though it is a plain HF checkpoint
    module, record = load_drafter(str(out))
    assert record.config["p_max"] == 0.2
    target = AutoModelForCausalLM.from_pretrained(out).eval()
    with pytest.raises(ValueError, match="give --exit_layer E in 1..3"):
        resolve_drafter(str(out), target)
    assert resolve_drafter(str(out), target, ProposerOptions(exit_layer=2)).exit_layer == 2
    with pytest.raises(ValueError, match="exit layer 4 must be in 1..3"):
        resolve_drafter(str(out), target, ProposerOptions(exit_layer=4))
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(3))
    settings = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    alone = target.generate(prompt, **settings)
    assert torch.equal(target.generate(prompt, assistant_early_exit=2, **settings), alone)
