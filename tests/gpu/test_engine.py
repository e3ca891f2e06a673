"""The engine's greedy identity and tree tests with the models on CUDA (tests/unit/test_decoding_greedy.py and
tests/unit/test_decoding_tree.py run them on CPU): float64 tiny targets, every drafter of the CPU tests, K = 1..8; and
the real-shape cut target in float32 with an always-right, an always-wrong and a width-2 tree drafter."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_llama
from tests.unit.test_decoding_greedy import RandomTokens, WrongOracle
from tests.unit.test_decoding_tree import TopTwoTree, assert_same_cache, prefilled
from trainer.decoding.generate import speculative_generate, verify_round
from trainer.decoding.proposers import NoProposer, OracleProposer, PromptLookupProposer
from trainer.decoding.tree import DraftTree
from trainer.methods.draft_model.proposer import DraftModelProposer

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


class OnDevice:
    """A CPU tests' drafter whose trees are moved to the committed tokens' device (the project's proposers draft on
    the target's device; these test drafters build their trees on CPU)."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.needs_hidden_states = getattr(proposer, "needs_hidden_states", ())

    def reset(self) -> None:
        self.proposer.reset()

    def propose(self, ctx) -> DraftTree:
        tree = self.proposer.propose(ctx)
        device = ctx.tokens.device
        return DraftTree(tokens=tree.tokens.to(device), parents=tree.parents.to(device))


def drafter(name: str, target, prompt: torch.Tensor, reference: list[int], seed: int):
    full = torch.cat([prompt.cpu(), torch.tensor(reference)])
    return {
        "oracle": lambda: OracleProposer(full, prompt.numel()),
        "wrong": lambda: WrongOracle(full, prompt.numel()),
        "random": lambda: OnDevice(RandomTokens(seed)),
        "draft-model": lambda: DraftModelProposer(tiny_llama(seed + 1000, vocab=target.config.vocab_size).to(CUDA)),
        "prompt-lookup": lambda: PromptLookupProposer(),
    }[name]()


@pytest.mark.parametrize("drafter_name", ["oracle", "wrong", "random", "draft-model", "prompt-lookup"])
def test_greedy_output_identical_to_target_on_cuda(drafter_name):
    for seed, vocab in enumerate([64, 256]):
        target = tiny_llama(seed, vocab=vocab).to(CUDA)
        gen = torch.Generator().manual_seed(seed)
        for k in range(1, 9):
            prompt = torch.randint(0, vocab, (int(torch.randint(2, 12, (), generator=gen)),), generator=gen)
            prompt = prompt.to(CUDA)  # [S]
            reference = speculative_generate(target, prompt, NoProposer(), k, 24).tokens
            proposer = drafter(drafter_name, target, prompt, reference, seed * 10 + k)
            result = speculative_generate(target, prompt, proposer, k, 24)
            assert result.tokens == reference, f"seed {seed}, {drafter_name}, K={k}"
            assert all(r.accepted <= r.drafted <= k for r in result.rounds)
            if drafter_name == "oracle":
                assert all(r.accepted == r.drafted for r in result.rounds)
            if drafter_name == "wrong":
                assert all(r.accepted == 0 for r in result.rounds)


def test_target_alone_equals_hf_greedy_generate_on_cuda():
    target = tiny_llama(3).to(CUDA)
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(3)).to(CUDA)
    ours = speculative_generate(target, prompt, NoProposer(), 4, 30)
    hf = target.generate(prompt[None], max_new_tokens=30, do_sample=False, min_new_tokens=30)[0, 9:].tolist()
    assert ours.tokens == hf


def test_tree_verification_on_cuda():
    """A chain verified as a tree gives the chain's path and cache; a width-2 tree drafter is lossless and accepts
    the right branch at every depth."""
    target = tiny_llama(1, vocab=96).to(CUDA)
    prompt = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(1)).to(CUDA)
    g = speculative_generate(target, prompt, NoProposer(), 1, 4).tokens
    for drafts in ([g[0], g[1], (g[2] + 3) % 96], [g[0], g[1], g[2]], [(g[0] + 1) % 96]):
        tree = DraftTree.chain(torch.tensor(drafts, device=CUDA))
        chain_session, tree_session = prefilled(target, prompt), prefilled(target, prompt)
        as_chain = verify_round(chain_session, prompt[-1:], tree, tree_mask=False)
        as_tree = verify_round(tree_session, prompt[-1:], tree, tree_mask=True)
        assert as_chain.path == as_tree.path and as_chain.token == as_tree.token
        assert_same_cache(chain_session.cache, tree_session.cache)
    reference = speculative_generate(target, prompt, NoProposer(), 1, 20).tokens
    for k in (1, 3, 5):
        result = speculative_generate(target, prompt, OnDevice(TopTwoTree(prompt.tolist() + reference, 96)), k, 20)
        assert result.tokens == reference
        assert all(r.accepted == r.drafted for r in result.rounds)


def test_real_width_greedy_identity_chain_and_tree(cut_target):
    """The cut target in float32 on CUDA (bf16 rounds a batched verification and one-token decoding differently):
    always-right and always-wrong chains and a width-2 tree give the target's own greedy output."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(cut_target, dtype=torch.float32).to(CUDA).eval()
    vocab = target.config.vocab_size
    prompt = torch.randint(0, 4000, (64,), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.no_grad():
        reference = speculative_generate(target, prompt, NoProposer(), 1, 32).tokens
        full = torch.cat([prompt.cpu(), torch.tensor(reference)])
        tree = OnDevice(TopTwoTree(prompt.tolist() + reference, vocab))
        for proposer in (OracleProposer(full, 64), WrongOracle(full, 64), tree):
            result = speculative_generate(target, prompt, proposer, 6, 32)
            assert result.tokens == reference, type(proposer).__name__
