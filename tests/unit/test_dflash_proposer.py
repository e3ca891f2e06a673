"""DFlash decoding: chain and DDTree proposers are lossless on a real (random) target, every round drafts exactly the
block the training forward computes at that anchor from the target's hidden states, and the DDTree holds the best
prefixes under its node budget."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from tests.helpers import tiny_llama
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer, ProposalContext
from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.dflash.proposer import DFlashProposer, DFlashTreeProposer

VOCAB = 128


def setup(seed: int = 0) -> tuple[torch.nn.Module, DFlashDrafter]:
    target = tiny_llama(seed, vocab=VOCAB, layers=4)  # float64, eval
    config = DFlashConfig.from_target(target.config, 2, (1, 3), block_size=5, mask_token_id=VOCAB - 1)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.3)
    return target, drafter.to(torch.float64).eval()


class Recording(DFlashProposer):
    """The chain proposer, recording each round's committed tokens and block logits."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.rounds: list[tuple[torch.Tensor, torch.Tensor]] = []

    def block_logits(self, ctx):
        logits = super().block_logits(ctx)
        self.rounds.append((ctx.tokens.clone(), logits.clone()))
        return logits


def test_chain_and_tree_are_lossless_and_draft_the_training_blocks(one_thread):
    target, drafter = setup()
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = torch.randint(0, VOCAB - 1, (11,), generator=torch.Generator().manual_seed(0))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=30).tokens
    chain = Recording(drafter, embedding, head)
    tree = DFlashTreeProposer(drafter, embedding, head, top_k=3, budget=10)
    for proposer in (chain, tree):
        result = speculative_generate(target, prompt, proposer, k=4, max_new_tokens=30)
        assert result.tokens == alone
        assert proposer.blocks == sum(r.drafted > 0 for r in result.rounds) and proposer.draft_seconds > 0
    # each round's block is the training forward's block anchored at the root, from the target's own hidden states
    checked = 0
    for tokens, logits in chain.rounds:
        T = tokens.numel()
        with torch.no_grad():
            hidden = target(tokens[None], output_hidden_states=True).hidden_states
            context = drafter.context([hidden[i] for i in drafter.config.target_layers])  # [1, T, H]
            block = drafter.block_ids(tokens[-1:])[None]  # [1, b]
            out = drafter.train_blocks(context, embedding[block], torch.tensor([[T - 1]]), "dense")  # [1, b, H]
        torch.testing.assert_close(logits, out[0, 1:] @ head.t(), rtol=1e-6, atol=1e-6)
        checked += 1
    assert checked >= 5


def test_sampled_chains_return_the_distributions_they_were_drawn_from(one_thread):
    target, drafter = setup(1)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = DFlashProposer(drafter, embedding, head)
    prompt = torch.randint(0, VOCAB - 1, (9,), generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(0)
    result = speculative_generate(target, prompt, proposer, 4, 20, temperature=0.8, generator=generator)
    assert len(result.tokens) == 20 and proposer.blocks == len(result.rounds) - 1
    # one more round by hand: every draft has positive probability under its slot's distribution
    hidden = {i: torch.randn(3, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    proposer.reset()
    ctx = ProposalContext(
        tokens=prompt[:4], k=4, temperature=0.8, generator=generator, vocab_size=VOCAB, hidden_states=hidden
    )
    drafts = proposer.propose(ctx)
    assert drafts.probs.shape == (4, VOCAB) and bool((drafts.probs[torch.arange(4), drafts.tokens] > 0).all())
    torch.testing.assert_close(drafts.probs.sum(-1), torch.ones(4, dtype=drafts.probs.dtype))


class FixedLogits(DFlashTreeProposer):
    def __init__(self, logits: torch.Tensor, **options) -> None:
        _, drafter = setup()
        super().__init__(drafter, torch.zeros(VOCAB, 32), torch.zeros(VOCAB, 32), **options)
        self.fixed = logits

    def block_logits(self, ctx):
        return self.fixed


@pytest.mark.parametrize("budget", [1, 7, 20])
def test_ddtree_holds_the_best_prefixes_of_the_per_slot_top_k(budget):
    depth, top_k = 4, 3
    logits = torch.randn(depth, VOCAB, generator=torch.Generator().manual_seed(budget), dtype=torch.float64) * 3
    proposer = FixedLogits(logits, top_k=top_k, budget=budget, rank_temperature=1.0)
    ctx = ProposalContext(tokens=torch.tensor([1, 2]), k=depth, vocab_size=VOCAB)
    tree = proposer.propose(ctx)
    assert tree.num_nodes == budget and bool((tree.parents < torch.arange(budget)).all())
    # brute force: every prefix of per-slot top-k choices, scored by its summed log-probabilities
    log_p = torch.log_softmax(logits, -1)
    top = log_p.topk(top_k, -1)
    prefixes = {}
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(top_k), repeat=d):
            tokens = tuple(int(top.indices[i, r]) for i, r in enumerate(ranks))
            prefixes[tokens] = sum(float(top.values[i, r]) for i, r in enumerate(ranks))
    best = sorted(prefixes, key=lambda p: -prefixes[p])[:budget]
    held = {tuple(int(tree.tokens[n]) for n in tree.path_to(i)) for i in range(budget)}
    assert held == set(best)
    # the tree is cut at the round's k: no path deeper than ctx.k
    ctx.k = 2
    assert proposer.propose(ctx).max_depth() <= 2
