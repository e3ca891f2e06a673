"""On-policy distillation: loss identities, the generated-token mask, prompts, the coin, against naive references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers import tiny_scaled_model
from trainer.methods.draft_model.kd import KnowledgeDistillation
from trainer.methods.draft_model.on_policy import OnPolicyDistillation, assemble, left_pad, prompt_lengths
from trainer.models.logit_scaling import LogitScaling

EOS, PAD, VOCAB = 1, 0, 64
STUDENT = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 48}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    torch.manual_seed(123)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=None,
    )
    path = tmp_path_factory.mktemp("teacher")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def make(teacher_dir, **kw) -> OnPolicyDistillation:
    args = dict(target=teacher_dir, drafter_config=STUDENT, max_new_tokens=6, prompt_len=5, loss_chunk_size=7, seed=3)
    model = OnPolicyDistillation(**{**args, **kw})
    return model.train()


def data_batch(B: int = 3, S: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (B, S + 1), generator=g)  # no EOS or pad inside
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :4] = False  # some untrained positions
    labels = torch.where(mask, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return {"input_ids": ids[:, :-1], "labels": labels, "loss_mask": mask}


def naive_kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    return (log_a.exp() * (log_a - log_b)).sum(-1)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3])
def test_loss_is_forward_kl_at_beta_0_and_reverse_kl_at_beta_1(teacher_dir, beta):
    model = make(teacher_dir, lmbda=0.0, beta=beta, temperature=2.0)
    batch = data_batch()
    loss, metrics = model.compute_loss(batch)
    assert float(metrics["on_policy"]) == 0.0
    with torch.no_grad():
        lp = F.log_softmax(model.target.model(batch["input_ids"]).logits.double() / 2.0, -1)  # [B, S, V]
        lq = F.log_softmax(model.student(batch["input_ids"]).logits.double() / 2.0, -1)  # [B, S, V]
    if beta == 0.0:
        per_pos = naive_kl(lp, lq)
    elif beta == 1.0:
        per_pos = naive_kl(lq, lp)
    else:
        m = (beta * lp.exp() + (1 - beta) * lq.exp()).log()
        per_pos = beta * naive_kl(lp, m) + (1 - beta) * naive_kl(lq, m)
    expected = 4.0 * per_pos[batch["loss_mask"]].mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_loss_has_gradients_for_the_student_only(teacher_dir):
    model = make(teacher_dir, lmbda=1.0)
    loss, _ = model.compute_loss(data_batch())
    loss.backward()
    assert all(p.grad is not None for p in model.student.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.target.parameters())


def test_lambda_0_equals_the_kd_objective(teacher_dir):
    batch = data_batch(seed=5)
    ours = make(teacher_dir, lmbda=0.0, beta=0.4, temperature=1.5)
    kd = KnowledgeDistillation(
        target=teacher_dir,
        drafter_config=STUDENT,
        loss="jsd",
        beta=0.4,
        temperature=1.5,
        loss_chunk_size=7,
        seed=3,
    ).train()
    for a, b in zip(ours.student.parameters(), kd.student.parameters(), strict=True):
        assert torch.equal(a, b)  # same initialisation from the same seed
    torch.testing.assert_close(ours.compute_loss(batch)[0], kd.compute_loss(batch)[0], rtol=0, atol=0)


@pytest.fixture(scope="module")
def softcapped_teacher_dir(tmp_path_factory):
    """A Gemma-2 teacher whose forward soft-caps its logits at 2, its (tied) head scaled up so that the cap matters."""
    model = tiny_scaled_model("gemma2", seed=123, vocab=VOCAB, final_logit_softcapping=2.0, eos_token_id=EOS,
                              pad_token_id=PAD, bos_token_id=None, max_position_embeddings=128)  # fmt: skip
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    path = tmp_path_factory.mktemp("softcapped_teacher")
    model.float().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("method", ["kd", "on_policy"])
def test_a_soft_capping_teacher_and_drafter_are_distilled_on_their_forwards_logits(softcapped_teacher_dir, method):
    """Gemma-2 soft-caps its logits in its forward, and so does the drafter built from its config: the chunked loss
    on hidden states and bare heads (each side with its output scaling) is the naive loss on both forwards' logits,
    and the drafter's gradients are the naive ones."""
    T = 1.5
    if method == "kd":
        model = KnowledgeDistillation(target=softcapped_teacher_dir, drafter_config=STUDENT, temperature=T, alpha=0.3,
                                      loss_chunk_size=7, seed=3).train()  # fmt: skip
    else:
        model = make(softcapped_teacher_dir, lmbda=0.0, beta=0.3, temperature=T)
    assert model.target.logit_scaling == LogitScaling(softcap=2.0)
    assert LogitScaling.from_config(model.student.config) == LogitScaling(softcap=2.0)
    with torch.no_grad():
        model.student.get_output_embeddings().weight.mul_(30.0)  # the drafter's cap matters too
    batch = data_batch(seed=6)
    ids, mask, labels = batch["input_ids"], batch["loss_mask"], batch["labels"]
    params = [p for p in model.student.parameters() if p.requires_grad]
    loss, _ = model.compute_loss(batch)
    grads = torch.autograd.grad(loss, params)

    def naive(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        lp = F.log_softmax(teacher_logits.double() / T, -1)  # [B, S, V]
        lq = F.log_softmax(student_logits.double() / T, -1)  # [B, S, V]
        if method == "kd":  # forward KL and 0.3 of the cross entropy on the hard labels
            ce = F.cross_entropy(student_logits.double()[mask], labels[mask])
            return 0.7 * T * T * naive_kl(lp, lq)[mask].mean() + 0.3 * ce
        m = (0.3 * lp.exp() + 0.7 * lq.exp()).log()  # generalized JSD, beta 0.3
        return T * T * (0.3 * naive_kl(lp, m) + 0.7 * naive_kl(lq, m))[mask].mean()

    with torch.no_grad():
        teacher_logits = model.target.model(ids).logits  # [B, S, V], soft-capped
    expected = naive(model.student(ids).logits, teacher_logits)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, torch.autograd.grad(expected, params), strict=True):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # without the caps (the bare heads' logits) the loss would be another one
        bare_student = model.student.lm_head(model.student.get_decoder()(ids).last_hidden_state)
        bare = naive(bare_student, model.target.final_hidden(ids) @ model.target.lm_head_weight.t())
    assert abs(float(bare) - float(expected.detach())) > 0.1 * float(expected.detach())


def test_lambda_1_trains_exactly_the_generated_tokens(teacher_dir):
    model = make(teacher_dir, lmbda=1.0, do_sample=False, prompt="chat", prompt_len=4)
    batch = data_batch(B=3, S=12, seed=7)
    batch["loss_mask"][1, :6] = False  # chat-like rows: prompts of 5, 7 and 4 (fallback) tokens
    lengths = prompt_lengths(batch["loss_mask"], "chat", 4)
    assert lengths.tolist() == [5, 7, 4]
    gen = model.generate(model.student, batch, sample_seed=0)
    assert model.student.training  # generation leaves the train mode as it found it
    for b in range(3):
        p = int(lengths[b])
        prompt = batch["input_ids"][b : b + 1, :p]
        alone = model.student.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)[
            0, p:
        ]  # one by one, no padding
        if (alone == EOS).any():
            alone = alone[: int((alone == EOS).float().argmax()) + 1]
        assert torch.equal(gen.input_ids[b, :p], prompt[0])
        assert torch.equal(gen.labels[b][gen.loss_mask[b]], alone)
        positions = gen.loss_mask[b].nonzero().squeeze(-1)
        assert positions.tolist() == list(range(p - 1, p - 1 + alone.numel()))
    # the step's loss is the distillation loss on those sequences
    loss, metrics = model.compute_loss(batch)
    assert float(metrics["on_policy"]) == 1.0
    torch.testing.assert_close(loss, model.distill(gen.input_ids, gen.loss_mask).loss)
    # throughput counts the tokens the step ran on (prompts and what was generated), not the data batch's 3 x 12
    assert (
        model._tokens_in_batch == int((gen.prompt_lengths + gen.generated_lengths).sum()) < batch["input_ids"].numel()
    )


def test_sampling_is_deterministic_in_the_seed_and_leaves_the_global_rng(teacher_dir):
    model = make(teacher_dir, lmbda=1.0, generation_temperature=2.0, max_new_tokens=10)
    batch = data_batch(seed=2)
    state = torch.random.get_rng_state()
    a = model.generate(model.student, batch, sample_seed=11)
    b = model.generate(model.student, batch, sample_seed=11)
    c = model.generate(model.student, batch, sample_seed=12)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert not torch.equal(a.labels, c.labels)


def test_seq_kd_trains_on_the_teachers_continuations(teacher_dir):
    model = make(teacher_dir, lmbda=0.0, seq_kd=True, do_sample=False)
    batch = data_batch(seed=4)
    loss, metrics = model.compute_loss(batch)
    gen = model.generate(model.target.model, batch, sample_seed=0)
    assert float(metrics["on_policy"]) == 0.0
    assert float(metrics["generated_tokens"]) == gen.generated_lengths.float().mean()
    torch.testing.assert_close(loss, model.distill(gen.input_ids, gen.loss_mask).loss)


def test_validation_uses_the_data_set(teacher_dir):
    model = make(teacher_dir, lmbda=1.0).eval()
    batch = data_batch()
    loss, metrics = model.compute_loss(batch)
    assert float(metrics["on_policy"]) == 0.0
    torch.testing.assert_close(loss, model.distill(batch["input_ids"], batch["loss_mask"]).loss)


def test_coin_is_a_function_of_seed_and_step(teacher_dir):
    model = make(teacher_dir, lmbda=0.3)
    flips = [model.coin(step) for step in range(2000)]
    assert flips == [model.coin(step) for step in range(2000)]
    assert 0.25 < sum(flips) / len(flips) < 0.35
    assert flips != [model.coin(step, micro=1) for step in range(2000)]
    model.lmbda = 0.0
    assert not any(model.coin(s) for s in range(200))
    model.lmbda = 1.0
    assert all(model.coin(s) for s in range(200))


def test_assemble_cuts_at_the_first_eos_and_right_pads():
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    prompts, attention = left_pad(ids, torch.tensor([3, 1]), PAD)
    assert prompts.tolist() == [[5, 6, 7], [PAD, PAD, 9]] and attention.tolist() == [[1, 1, 1], [0, 0, 1]]
    generated = torch.tensor([[20, EOS, PAD, PAD], [21, 22, 23, 24]])
    out = assemble(prompts, torch.tensor([3, 1]), generated, EOS, PAD)
    assert out.generated_lengths.tolist() == [2, 4]
    # full sequences [5 6 7 20 EOS] and [9 21 22 23 24], inputs drop the last token
    assert out.input_ids.tolist() == [[5, 6, 7, 20], [9, 21, 22, 23]]
    assert out.labels.tolist() == [[-100, -100, 20, EOS], [21, 22, 23, 24]]
    assert out.loss_mask.tolist() == [[False, False, True, True], [True, True, True, True]]


def test_bad_settings_are_named(teacher_dir):
    with pytest.raises(ValueError, match="lmbda"):
        make(teacher_dir, lmbda=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        make(teacher_dir, max_new_tokens=0)
