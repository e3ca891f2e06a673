"""Greedy speculative decoding is lossless: token-for-token identical to the target alone, for any drafter and K.

Property test over seeded random tiny Llama targets in float64 (so that verifying K + 1 tokens at once and decoding
one token at a time cannot flip an argmax through rounding: near-ties closer than ~1e-12 do not occur in practice),
with drafters that are always right, always wrong, random tokens, a random draft model, prompt lookup and a trained
KD student (slow).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers import tiny_llama
from trainer.decoding.generate import speculative_generate
from trainer.decoding.metrics import tau
from trainer.decoding.proposers import (
    NoProposer,
    OracleProposer,
    PromptLookupProposer,
    ProposalContext,
)
from trainer.decoding.tree import DraftTree
from trainer.methods.draft_model.proposer import DraftModelProposer

pytestmark = pytest.mark.usefixtures("one_thread")


class WrongOracle(OracleProposer):
    """Drafts a token different from the target's greedy token at every position: always wrong."""

    def propose(self, ctx: ProposalContext) -> DraftTree:
        tree = super().propose(ctx)
        return DraftTree.chain((tree.tokens + 1) % ctx.vocab_size)


class RandomTokens:
    """Uniformly random drafts, a random number of them (0 to k)."""

    needs_hidden_states: tuple[int, ...] = ()

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        pass

    def propose(self, ctx: ProposalContext) -> DraftTree:
        n = int(torch.randint(0, ctx.k + 1, (), generator=self.gen))
        return DraftTree.chain(torch.randint(0, ctx.vocab_size, (n,), generator=self.gen))


def _drafters(name: str, target, prompt: torch.Tensor, reference: list[int], seed: int):
    full = torch.cat([prompt, torch.tensor(reference)])
    return {
        "oracle": lambda: OracleProposer(full, prompt.numel()),
        "wrong": lambda: WrongOracle(full, prompt.numel()),
        "random": lambda: RandomTokens(seed),
        "draft-model": lambda: DraftModelProposer(tiny_llama(seed + 1000, vocab=target.config.vocab_size)),
        "prompt-lookup": lambda: PromptLookupProposer(),
    }[name]()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("drafter", ["oracle", "wrong", "random", "draft-model", "prompt-lookup"])
def test_greedy_output_identical_to_target(seed: int, drafter: str) -> None:
    vocab = [64, 128, 256][seed]
    target = tiny_llama(seed, vocab=vocab)
    gen = torch.Generator().manual_seed(seed)
    for k in range(1, 9):
        prompt = torch.randint(0, vocab, (int(torch.randint(2, 12, (), generator=gen)),), generator=gen)  # [S]
        reference = speculative_generate(target, prompt, NoProposer(), k, 24).tokens
        proposer = _drafters(drafter, target, prompt, reference, seed * 10 + k)
        result = speculative_generate(target, prompt, proposer, k, 24)
        assert result.tokens == reference, f"seed {seed}, {drafter}, K={k}"
        assert result.target_forwards == len(result.rounds)
        assert all(r.accepted <= r.drafted <= k for r in result.rounds)
        if drafter == "oracle":
            full = [r for r in result.rounds if r.drafted == k]
            assert all(r.accepted == k and r.committed == k + 1 for r in full)
        if drafter == "wrong":
            assert all(r.accepted == 0 for r in result.rounds)
            assert result.target_forwards == 24


def test_target_alone_equals_hf_greedy_generate() -> None:
    target = tiny_llama(3)
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(3))
    ours = speculative_generate(target, prompt, NoProposer(), 4, 30)
    hf = target.generate(prompt[None], max_new_tokens=30, do_sample=False, min_new_tokens=30)[0, 9:].tolist()
    assert ours.tokens == hf
    assert ours.target_forwards == 30 and tau(ours.rounds) == 1.0


def test_eos_stops_generation_and_is_kept() -> None:
    target = tiny_llama(4)
    prompt = torch.randint(0, 128, (6,), generator=torch.Generator().manual_seed(4))
    reference = speculative_generate(target, prompt, NoProposer(), 1, 20).tokens
    eos = reference[7]
    stop = reference.index(eos)
    full = torch.cat([prompt, torch.tensor(reference)])
    result = speculative_generate(target, prompt, OracleProposer(full, 6), 4, 20, eos_token_id=[eos])
    assert result.tokens == reference[: stop + 1]


def train_student(target, vocab: int, steps: int = 150) -> LlamaForCausalLM:
    """A KD student: a smaller model trained on the target's full next-token distributions (forward KL)."""
    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    student = LlamaForCausalLM(config).to(torch.float64)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(8)
    data = []
    for _ in range(8):  # training text: the target's own greedy continuations of random prompts
        prompt = torch.randint(0, vocab, (4,), generator=gen)
        data.append(torch.cat([prompt, torch.tensor(speculative_generate(target, prompt, NoProposer(), 1, 28).tokens)]))
    batch = torch.stack(data)  # [8, 32]
    with torch.no_grad():
        teacher = torch.log_softmax(target(batch).logits, -1)  # [8, 32, V]
    for _ in range(steps):
        log_q = torch.log_softmax(student(batch).logits, -1)  # [8, 32, V]
        loss = torch.nn.functional.kl_div(log_q, teacher, log_target=True, reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad()
    return student.eval()


@pytest.mark.slow
def test_greedy_identity_with_trained_kd_student() -> None:
    vocab = 64
    target = tiny_llama(5, vocab=vocab)
    student = train_student(target, vocab)
    proposer = DraftModelProposer(student)
    gen = torch.Generator().manual_seed(9)
    accepted = 0
    for k in range(1, 9):
        prompt = torch.randint(0, vocab, (4,), generator=gen)
        reference = speculative_generate(target, prompt, NoProposer(), k, 28).tokens
        result = speculative_generate(target, prompt, proposer, k, 28)
        assert result.tokens == reference, f"K={k}"
        accepted += sum(r.accepted for r in result.rounds)
    assert accepted > 0  # the student learned something of the target
