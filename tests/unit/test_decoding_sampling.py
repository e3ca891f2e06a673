"""Speculative sampling is distributed as the target: chi-square tests at fixed seeds, with enough samples to detect
the classic mistake (greedy drafts verified with the draft model's softmax probabilities)."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import ProposalContext
from trainer.decoding.tree import DraftTree
from trainer.decoding.verify import probs_from_logits, sampling_verify_chain, sampling_verify_tree
from trainer.methods.draft_model.proposer import DraftModelProposer

pytestmark = pytest.mark.usefixtures("one_thread")

V = 6


def markov(seed: int, sharpness: float) -> torch.Tensor:
    """``[V, V]`` row-stochastic transition matrix."""
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(V, V, generator=gen, dtype=torch.float64), dim=-1)


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square; cells with small expected counts are pooled into one."""
    observed, expected = observed.flatten().double(), expected.flatten().double()
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum()[None]]) if small.any() else observed
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    statistic = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    return float(stats.chi2.sf(statistic, df=obs.numel() - 1))


def run_chains(q: torch.Tensor, p: torch.Tensor, mode: str, n: int, k: int = 3, seed: int = 0):
    """n independent rounds from root token 0 with a Markov target q and drafter p; the committed tokens."""
    gen = torch.Generator().manual_seed(seed)
    prev = torch.zeros(n, dtype=torch.long)
    drafts, draft_probs = [], []
    for _ in range(k):
        rows = p[prev]  # [n, V]
        x = torch.multinomial(rows, 1, generator=gen)[:, 0] if mode == "sampled" else rows.argmax(-1)  # [n]
        drafts.append(x)
        draft_probs.append(rows)
        prev = x
    drafts_t = torch.stack(drafts, 1)  # [n, K]
    context = torch.cat([torch.zeros(n, 1, dtype=torch.long), drafts_t], 1)  # [n, K + 1]
    target_probs = q[context]  # [n, K + 1, V]
    probs = None if mode == "greedy-onehot" else torch.stack(draft_probs, 1)  # [n, K, V]
    n_acc, nxt = sampling_verify_chain(drafts_t, probs, target_probs, gen)
    committed = torch.cat([drafts_t, torch.zeros(n, 1, dtype=torch.long)], 1)  # [n, K + 1]
    committed[torch.arange(n), n_acc] = nxt
    return committed, n_acc


def chain_p_values(q: torch.Tensor, committed: torch.Tensor, n_acc: torch.Tensor) -> tuple[float, float]:
    """First committed token vs q[0]; second token given the first (rounds that accepted >= 1) vs q[first]."""
    first = committed[:, 0]
    p_first = chi_square_p(torch.bincount(first, minlength=V), first.numel() * q[0])
    has_second = n_acc >= 1
    pairs = committed[has_second, 0] * V + committed[has_second, 1]
    observed = torch.bincount(pairs, minlength=V * V).view(V, V)  # [V, V]
    expected = observed.sum(1, keepdim=True) * q  # [V, V]
    return p_first, chi_square_p(observed, expected)


@pytest.mark.parametrize("mode", ["sampled", "greedy-onehot"])
def test_speculative_sampling_matches_target_distribution(mode: str) -> None:
    q, p = markov(0, 1.0), markov(1, 3.0)  # a drafter unlike the target
    committed, n_acc = run_chains(q, p, mode, n=40000)
    p_first, p_second = chain_p_values(q, committed, n_acc)
    assert p_first > 1e-3 and p_second > 1e-3
    assert 0 < float(n_acc.float().mean()) < 3  # both acceptance and rejection happen


def test_greedy_drafts_with_softmax_p_are_detected() -> None:
    q, p = markov(0, 1.0), markov(1, 3.0)
    committed, n_acc = run_chains(q, p, "greedy-softmax", n=40000)
    p_first, p_second = chain_p_values(q, committed, n_acc)
    assert min(p_first, p_second) < 1e-6


@pytest.mark.parametrize("children", ["top3-onehot", "iid-sampled"])
def test_tree_sampling_matches_target_distribution(children: str) -> None:
    q, p = markov(2, 1.0), markov(3, 3.0)
    gen = torch.Generator().manual_seed(1)
    n = 3000
    first = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        if children == "top3-onehot":
            tokens, probs = p[0].topk(3).indices, None  # deterministic distinct candidates
        else:
            tokens = torch.multinomial(p[0], 3, replacement=True, generator=gen)  # i.i.d. from p
            probs = p[0].expand(3, V)
        # each candidate gets one deterministic child: the drafter's argmax after it
        tree = DraftTree(
            tokens=torch.cat([tokens, p[tokens].argmax(-1)]),
            parents=torch.tensor([-1, -1, -1, 0, 1, 2]),
            probs=None if probs is None else torch.cat([probs, torch.nn.functional.one_hot(p[tokens].argmax(-1), V)]),
        )
        target_probs = q[torch.cat([torch.zeros(1, dtype=torch.long), tree.tokens])]  # [N + 1, V]
        path, token = sampling_verify_tree(tree, target_probs, gen)
        first[i] = tree.tokens[path[0]] if path else token
    assert chi_square_p(torch.bincount(first, minlength=V), n * q[0]) > 1e-3


def tiny_llama(seed: int, vocab: int, scale: float = 1.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # sharper or flatter distributions
    return model


class SoftmaxDrafter:
    """A draft model without cache: samples (right) or takes the argmax (wrong) but always reports softmax p."""

    needs_hidden_states: tuple[int, ...] = ()

    def __init__(self, model, greedy: bool) -> None:
        self.model, self.greedy = model, greedy

    def reset(self) -> None:
        pass

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        tokens, drafts, probs = ctx.tokens, [], []
        for _ in range(ctx.k):
            p = probs_from_logits(self.model(input_ids=tokens[None]).logits[0, -1], ctx.temperature)  # [V]
            x = p.argmax()[None] if self.greedy else torch.multinomial(p, 1, generator=ctx.generator)
            drafts.append(x)
            probs.append(p)
            tokens = torch.cat([tokens, x])
        return DraftTree.chain(torch.cat(drafts), torch.stack(probs))


def exact_joint(target, prompt: torch.Tensor, length: int, temperature: float) -> torch.Tensor:
    """``[V] * length`` probability of every output sequence of ``length`` tokens under the target."""
    vocab = target.config.vocab_size
    joint = torch.zeros([vocab] * length, dtype=torch.float64)
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=length):
            ids = torch.cat([prompt, torch.tensor(seq[:-1], dtype=torch.long)])
            probs = probs_from_logits(target(input_ids=ids[None]).logits[0, -length:], temperature)  # [length, V]
            joint[seq] = torch.prod(probs[torch.arange(length), torch.tensor(seq)])
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["draft-model", "wrong-rule"])
def test_engine_samples_are_distributed_as_target(drafter: str) -> None:
    vocab, length, n, temperature = 4, 3, 600, 1.0
    target = tiny_llama(0, vocab, scale=8.0)
    draft = tiny_llama(1, vocab, scale=16.0)  # sharper and different: p unlike q
    prompt = torch.tensor([1, 2, 3, 0])
    expected = exact_joint(target, prompt, length, temperature) * n  # [V, V, V]
    proposer = DraftModelProposer(draft) if drafter == "draft-model" else SoftmaxDrafter(draft, greedy=True)
    counts = torch.zeros([vocab] * length)
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(n):
        result = speculative_generate(target, prompt, proposer, 2, length, temperature, generator=gen)
        counts[tuple(result.tokens)] += 1
        accepted += sum(r.accepted for r in result.rounds)
    p_value = chi_square_p(counts, expected)
    assert accepted > 0
    if drafter == "draft-model":
        assert p_value > 1e-3
    else:
        assert p_value < 1e-6
